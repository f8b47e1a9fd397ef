"""The kernels' matrix multiply-accumulate: `mma(a, b, acc, precision)` = acc + a @ b, accumulated in float32.

Why not `acc + jnp.dot(a, b)` for TF32: XLA's Triton pipeline (jaxlib 0.11.2's CUDA plugin) rewrites every
float32 TF32 `tt.dot` to round both operands with `cvt.rna.tf32.f32` first, unless the dot carries the unit
attribute `tf32_arguments_rounded`. That elementwise pass over the operand tiles pulls them out of shared
memory into registers every step and writes the right one back, so the tensor cores wait on it
(docs/perf_notes.md). Triton itself, like FlexGEMM and PyTorch's allow_tf32, feeds float32 tiles straight to
the TF32 MMA, which ignores the low mantissa bits. So float32 TF32 dots here go through a small primitive
whose Triton lowering emits the `tt.dot` with the accumulator and that attribute. Everything else (half
precision, full float32, interpret mode, the CPU) is the plain `acc + jnp.dot`. Every kernel's GEMM loop
multiplies through `mma` (the weight gradient's float32 path runs as bf16 products, so it never takes the
TF32 branch).

This touches private Pallas modules (the Triton lowering-rule table): it is the one place to mend after a
JAX upgrade, and `tests/test_mma.py` lowers it on the CPU so a break shows in CI.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend import core as jex_core
from jax.interpreters import mlir

_TF32 = (lax.Precision.DEFAULT, lax.Precision.HIGH)


def _reference(a, b, acc):
  return acc + jnp.dot(a, b, preferred_element_type=jnp.float32)


# acc + a @ b for float32 a, b at TF32 precision on the GPU; full float32 elsewhere (interpret mode, CPU).
tf32_mma_p = jex_core.Primitive("jsparse_tf32_mma")
tf32_mma_p.def_impl(_reference)
tf32_mma_p.def_abstract_eval(lambda a, b, acc: jax.core.ShapedArray(acc.shape, jnp.float32))
mlir.register_lowering(tf32_mma_p, mlir.lower_fun(_reference, multiple_results=False))


def _register_triton_lowering() -> None:
  from jax._src.lib.mlir import ir
  from jax._src.lib.triton import dialect as tt_dialect
  from jax._src.pallas.triton import lowering as triton_lowering

  def lower(ctx, a, b, acc):
    del ctx
    out = tt_dialect.dot(a, b, acc, input_precision=tt_dialect.InputPrecision.TF32)
    out.owner.attributes["tf32_arguments_rounded"] = ir.UnitAttr.get()
    return out

  triton_lowering.register_lowering(tf32_mma_p)(lower)


_register_triton_lowering()


def mma(a, b, acc, precision: lax.Precision):
  """acc + a @ b in float32 (acc: float32 [M, N]; a: [M, K]; b: [K, N]; precision from `tiling.dot_precision`)."""
  if a.dtype == jnp.float32 and b.dtype == jnp.float32 and precision in _TF32:
    return tf32_mma_p.bind(a, b, acc)
  return acc + jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)
