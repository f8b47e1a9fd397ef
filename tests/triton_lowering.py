"""Lower a jitted function that contains Pallas kernels to Triton IR on a machine without a GPU.

Exporting for the "cuda" platform runs the Pallas -> Triton lowering (Triton IR is produced at
lowering time), so a kernel that no longer lowers fails here, in CI, on the CPU. It does not compile
the IR to PTX: some failures still only show on the GPU.

This touches private JAX modules; it is the one place to mend after a JAX upgrade.
"""
from __future__ import annotations

import contextlib

import jax


@contextlib.contextmanager
def _pretend_gpu(version: str = "H100"):
  from jax._src.pallas.triton import gpu_info, pallas_call_registration as reg

  saved = reg.gpu_info_lib.get_gpu_info
  gpu_version = getattr(gpu_info.GpuVersion, version)
  reg.gpu_info_lib.get_gpu_info = lambda: gpu_info._get_gpu_info_impl(gpu_version)
  try:
    yield
  finally:
    reg.gpu_info_lib.get_gpu_info = saved


def lower_for_cuda(fn, *args_like) -> str:
  """Exports `jax.jit(fn)` for CUDA with ShapeDtypeStruct args; returns the StableHLO text.

  Raises whatever the Pallas -> Triton lowering raises.
  """
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args_like]
  with _pretend_gpu():
    exported = jax.export.export(
        jax.jit(fn),
        platforms=["cuda"],
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")],
    )(*specs)
  return exported.mlir_module()


@contextlib.contextmanager
def capture_triton_modules():
  """Collects (ttir text, grid) of every Pallas kernel lowered inside the block."""
  from jax._src.pallas.triton import pallas_call_registration as reg

  captured = []
  original = reg.lowering.lower_jaxpr_to_triton_module

  def hook(*args, **kwargs):
    result = original(*args, **kwargs)
    captured.append((result.module.operation.get_asm(enable_debug_info=False), tuple(result.grid)))
    return result

  reg.lowering.lower_jaxpr_to_triton_module = hook
  try:
    yield captured
  finally:
    reg.lowering.lower_jaxpr_to_triton_module = original


def triton_ir(fn, *args_like) -> list[str]:
  """The Triton IR (TTIR text) of every Pallas kernel in `jax.jit(fn)`, lowered for CUDA on the CPU."""
  with capture_triton_modules() as captured:
    lower_for_cuda(fn, *args_like)
  return [ttir for ttir, _ in captured]
