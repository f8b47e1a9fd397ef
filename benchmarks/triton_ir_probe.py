"""Is it the Triton IR or XLA's compile of it? Times a Pallas GEMM kernel two ways on the GPU.

    python -m benchmarks.triton_ir_probe [--out DIR] [--res 256] [--channels 256] [--only REGEX]

For each variant (dtype, tiles) of the masked forward gather-GEMM on a sphere shell:
1. the kernel as jsparse runs it: Pallas lowers it to Triton IR, XLA compiles and launches it;
2. the *same* Triton IR (captured at lowering) compiled by the `triton` package and launched through it
   on the same device buffers (torch via DLPack), with a few other num_stages / num_warps.
It prints median times, useful TFLOP/s, the error between the two, and counts of tensor-core and copy
instructions in the Triton package's PTX/SASS (wgmma = Hopper warpgroup MMA, mma.sync = the older path).
If (2) is much faster than (1) the IR is fine and XLA's Triton pipeline is the difference.
Writes DIR/triton_ir_probe.log and the TTIR / TTGIR / PTX of the first float32 variant.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import re
import subprocess
import sys
import tempfile

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from benchmarks.probe_setup import open_log, shell_layer  # noqa: E402
from jsparse.autotuning import median_ms  # noqa: E402
from pallas_kernels.gather_gemm import gather_gemm  # noqa: E402
from pallas_kernels.gemm_plan import masked_plan  # noqa: E402
from pallas_kernels.tiling import TileConfig  # noqa: E402

# (tag, dtype, K-major weight, tiles)
VARIANTS = [
    ("f32_K_128x128x32_w4s4", jnp.float32, True, TileConfig(128, 128, 32, 4, 4)),
    ("f32_K_128x64x32_w4s4", jnp.float32, True, TileConfig(128, 64, 32, 4, 4)),
    ("f32_N_128x128x32_w4s4", jnp.float32, False, TileConfig(128, 128, 32, 4, 4)),
    ("f16_K_128x256x64_w8s3", jnp.float16, True, TileConfig(128, 256, 64, 8, 3)),
]
# Extra (num_warps, num_stages) tried with the Triton package on the same IR.
TRITON_LAUNCH_VARIANTS = [(4, 3), (4, 4), (8, 4), (4, 2)]


@contextlib.contextmanager
def capture_triton_modules():
  """Collects (ttir text, grid) of every Pallas kernel lowered inside the block (private JAX API)."""
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


def count_instructions(text: str, patterns) -> str:
  return ", ".join(f"{name} {len(re.findall(p, text))}" for name, p in patterns)


PTX_PATTERNS = [("wgmma", r"wgmma\.mma_async"), ("mma.sync", r"\bmma\.sync"), ("cp.async", r"cp\.async\.ca|cp\.async\.cg"),
                ("cp.async.bulk", r"cp\.async\.bulk"), ("ld.global", r"ld\.global")]
SASS_PATTERNS = [("HGMMA", r"\bHGMMA"), ("HMMA", r"\bHMMA"), ("LDGSTS", r"\bLDGSTS"), ("LDG", r"\bLDG\b|\bLDG\."),
                 ("LDL/STL (spills)", r"\bLDL|\bSTL")]


def main(argv=None):
  p = argparse.ArgumentParser()
  p.add_argument("--out", default=os.environ.get("OUT", "/tmp/jsparse_bench"))
  p.add_argument("--res", type=int, default=256)
  p.add_argument("--channels", type=int, default=256)
  p.add_argument("--only", default="")
  p.add_argument("--repeats", type=int, default=20)
  a = p.parse_args(argv)
  log = open_log(a.out, "triton_ir_probe.log")

  import torch
  import triton

  log(f"{jax.devices()[0].device_kind}; jax {jax.__version__}; triton {triton.__version__}; torch {torch.__version__}")
  res, c = a.res, a.channels
  x, w32, cache, flops = shell_layer(res, c)
  nbr, num = cache.nbr, x.num
  log(f"RES {res}: {int(num)} voxels, C {c}: {flops / 1e9:.1f} GFLOP per pass")
  saved_first_f32 = False
  for tag, dtype, kmajor, tiles in VARIANTS:
    if not re.search(a.only, tag):
      continue
    plan = masked_plan(nbr, num, tiles.block_m)
    w = (w32[::-1].transpose(0, 2, 1) if kmajor else w32).astype(dtype)
    feats = x.feats.astype(dtype)
    fn = jax.jit(lambda f, w, plan=plan, tiles=tiles, kmajor=kmajor: gather_gemm(
        f, w, nbr, num, plan=plan, config=tiles, weight_axes="vnk" if kmajor else "vkn", flip_offsets=kmajor))
    with capture_triton_modules() as mods:
      out_xla = jax.block_until_ready(fn(feats, w))
    ms_xla = median_ms(fn, (feats, w), warmup=3, repeats=a.repeats)
    log(f"{tag}: Pallas via XLA {ms_xla:7.3f} ms {flops / ms_xla / 1e9:6.1f} TFLOP/s")
    if len(mods) != 1:
      log(f"  expected one Triton module, captured {len(mods)}; skipping the Triton-package compile")
      continue
    ttir, grid = mods[0]
    path = os.path.join(tempfile.mkdtemp(), f"{tag}.ttir")
    with open(path, "w") as f:
      f.write(ttir)
    # The kernel's operands, in pallas_call order: num, x, weight, nbr, the plan's arrays, out.
    t = lambda arr: torch.from_dlpack(arr)  # noqa: E731  (zero-copy views of the JAX buffers)
    ins = [t(jnp.reshape(num, (1,)).astype(jnp.int32)), t(feats), t(w), t(nbr), t(plan.order), t(plan.block_offsets),
           t(plan.block_counts), t(plan.block_rows)]
    ref = torch.from_dlpack(out_xla).float()
    for warps, stages in [(tiles.num_warps, tiles.num_stages)] + TRITON_LAUNCH_VARIANTS:
      try:
        kernel = triton.compile(path, options=dict(num_warps=warps, num_stages=stages))
        out = torch.zeros(tuple(out_xla.shape), dtype=ins[1].dtype, device="cuda")
        launch = lambda: kernel[grid](*ins, out)  # noqa: E731
        launch()
        torch.cuda.synchronize()
        err = float((out.float() - ref).norm() / ref.norm())
        ms = triton.testing.do_bench(launch, warmup=25, rep=200, return_mode="median")
        ptx = kernel.asm.get("ptx", "")
        sass = ""
        if "cubin" in kernel.asm:
          cubin = path + f".w{warps}s{stages}.cubin"
          with open(cubin, "wb") as f:
            f.write(kernel.asm["cubin"])
          sass = subprocess.run(["cuobjdump", "-sass", cubin], capture_output=True, text=True).stdout
        log(f"  Triton package w{warps}s{stages}: {ms:7.3f} ms {flops / ms / 1e9:6.1f} TFLOP/s, err vs XLA {err:.1e}; "
            f"shared {kernel.metadata.shared} B; PTX: {count_instructions(ptx, PTX_PATTERNS)}; "
            f"SASS: {count_instructions(sass, SASS_PATTERNS)}")
        if dtype == jnp.float32 and not saved_first_f32 and (warps, stages) == (tiles.num_warps, tiles.num_stages):
          saved_first_f32 = True
          for key in ("ttir", "ttgir", "ptx"):
            with open(os.path.join(a.out, f"probe_{tag}.{key}"), "w") as f:
              f.write(str(kernel.asm.get(key, "")))
      except Exception as e:  # noqa: BLE001 (record and go on)
        log(f"  Triton package w{warps}s{stages}: FAILED {type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")


if __name__ == "__main__":
  sys.exit(main())
