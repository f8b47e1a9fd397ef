"""Does the weight tile's memory order decide the TF32 speed? (docs/perf_notes.md, 2026-11-22)

The forward can read W_v = w[v] ([K, N], N contiguous) or the same values from w[::-1].transpose(0, 2, 1)
through the transposed path (K contiguous), which is how the input gradient already reads its weight.
Times both for fp32 (TF32) and fp16 on sphere shells; checks both against the XLA path.
    python -m benchmarks.weight_layout_probe
"""
import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from benchmarks.workloads import sphere_shell_coords
from jsparse.autotuning import median_ms
from pallas_kernels.gather_gemm import gather_gemm
from pallas_kernels.gemm_plan import masked_plan
from pallas_kernels.tiling import TileConfig


def main():
  print(jax.devices()[0].device_kind)
  for res, c in ((256, 256), (64, 1024)):
    coords = sphere_shell_coords(res)
    rng = np.random.default_rng(0)
    for dtype in (jnp.float32, jnp.float16):
      x = jsparse.SparseTensor.from_coords(coords, jnp.asarray(rng.standard_normal((len(coords), c)), dtype), (res,) * 3)
      w = jnp.asarray(rng.standard_normal((27, c, c)) / np.sqrt(27 * c), dtype)
      cache = jsparse.neighbor_map(x, 3)
      pairs = int(cache.num_pairs())
      ref = jsparse.submconv_xla(x.feats.astype(jnp.float32), w.astype(jnp.float32), None, cache.nbr, x.num,
                                 precision="highest")
      for tiles in (TileConfig(128, 64, 32, 4, 3), TileConfig(128, 128, 32, 8, 3), TileConfig(128, 128, 64, 8, 3)):
        if dtype == jnp.float32 and tiles.block_k == 64:
          continue
        plan = masked_plan(cache.nbr, x.num, tiles.block_m)
        wt = w[::-1].transpose(0, 2, 1)
        f_n = jax.jit(lambda f, w: gather_gemm(f, w, cache.nbr, x.num, plan=plan, config=tiles))
        f_k = jax.jit(lambda f, w: gather_gemm(f, w, cache.nbr, x.num, plan=plan, config=tiles, weight_axes="vnk",
                                               flip_offsets=True))
        for name, fn, wa in (("N-contig", f_n, w), ("K-contig", f_k, wt)):
          out = fn(x.feats, wa)
          err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
          ms = median_ms(fn, (x.feats, wa), warmup=2, repeats=20)
          print(f"RES {res} C {c} {jnp.dtype(dtype).name} {tiles.block_m}x{tiles.block_n}x{tiles.block_k} "
                f"w{tiles.num_warps}: {name}: {ms:.3f} ms, {2 * pairs * c * c / ms / 1e9:.0f} TFLOP/s, "
                f"rel err {err:.1e}", flush=True)


if __name__ == "__main__":
  main()
