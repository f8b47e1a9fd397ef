"""Probe: the plan kernels' launch settings on real maps (masked plan blocks, pair lists), kernel time from traces.

    python -m benchmarks.probes.plan_kernels [--inputs lidar,shell] [--warps 2,4,8] [--chunks 128,256,512,1024]

Maps: the submanifold 3x3x3 map of a ~1M-voxel LiDAR batch (`jsparse.shapes.lidar_batch(0, preset="1m")`) and
of the RES 512 sphere shell (1M sites). For each, every `num_warps` of `gemm_plan.masked_plan` (block_m 128) and
every (chunk_rows, num_warps) of `gemm_plan.pair_lists`, mirrored and not, is compiled alone, checked equal to the
default's result, and traced (`networks.profile_jax`); the table gives each kernel's ms per call and GB/s of
its minimal traffic (plan blocks: the map rows read and the used offsets' block rows written; pair lists:
the map read twice and both [L, capacity] lists written).
"""
import argparse
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from benchmarks import networks, workloads
from pallas_kernels import gemm_plan


def inputs(name: str):
  if name == "lidar":
    coords, _, shape = jsparse.shapes.lidar_batch(0, preset="1m")
    batch = int(coords[:, 0].max()) + 1
  else:
    coords, shape, batch = workloads.sphere_shell_coords(512), (512,) * 3, 1
  x = jsparse.SparseTensor.from_coords(coords, np.zeros((len(coords), 1), np.float32), spatial_shape=shape,
                                       batch_size=batch, capacity="exact")
  nbr = jax.jit(lambda t: jsparse.neighbor_map(t, 3, 1).nbr)(x)
  return jax.block_until_ready(nbr), x.num


def kernel_ms(fn, args, prefix: str, calls: int) -> float:
  prof = networks.profile_jax(jax.jit(fn).lower(*args).compile(), args, calls, tempfile.mkdtemp())
  return sum(ms for k, ms in prof["top_kernels"].items() if k.split(" :: ")[1].startswith(prefix))


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--inputs", default="lidar,shell")
  ap.add_argument("--plan-blocks", action=argparse.BooleanOptionalAction, default=True)
  ap.add_argument("--warps", default="2,4,8")
  ap.add_argument("--chunks", default="32,64,128,256,512")
  ap.add_argument("--calls", type=int, default=20)
  args = ap.parse_args(argv)
  warps = [int(w) for w in args.warps.split(",")]
  chunks = [int(c) for c in args.chunks.split(",")]
  print(f"device: {jax.devices()[0].device_kind}")
  for name in args.inputs.split(","):
    nbr, num = inputs(name)
    cap, v = nbr.shape
    print(f"== {name}: {int(np.asarray(num).reshape(-1)[0]):,} rows, V {v}, {int(jnp.sum(nbr >= 0)):,} pairs")
    base = gemm_plan.masked_plan(nbr, num, 128)
    # The kernel gathers every map row and writes the used offsets' rows only (gemm_plan.MaskedPlan), so the
    # unused slots are not compared either.
    plan_bytes = (cap * v + int(jnp.sum(base.block_counts)) * 128) * 4
    base = base.comparable()
    for w in warps if args.plan_blocks else []:
      fn = lambda n, k, w=w: gemm_plan.masked_plan(n, k, 128, num_warps=w)
      got = jax.jit(fn)(nbr, num).comparable()
      same = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, base))
      ms = kernel_ms(fn, (nbr, num), "masked_plan_blocks", args.calls)
      print(f"  plan blocks  warps {w}: {ms:.4f} ms  {plan_bytes / ms / 1e6:7.0f} GB/s  same={same}")
    for mirrored in (True, False):
      lists = (v + 1) // 2 if mirrored else v
      list_bytes = 2 * cap * lists * 4 * 2
      base = gemm_plan.pair_lists(nbr, mirrored=mirrored)
      default = gemm_plan.pair_list_chunk_rows(lists)
      for c in chunks:
        for w in warps:
          fn = lambda n, c=c, w=w, m=mirrored: gemm_plan.pair_lists(n, mirrored=m, chunk_rows=c, num_warps=w)
          got = jax.jit(fn)(nbr)
          same = all(bool(jnp.array_equal(a, b)) for a, b in zip(got, base))
          ms = kernel_ms(fn, (nbr,), "pair_list", args.calls)
          tag = " (default)" if c == default and w == gemm_plan.PAIR_LIST_WARPS else ""
          print(f"  pair lists L {lists:2d} chunk {c:4d} warps {w}: {ms:.4f} ms  {list_bytes / ms / 1e6:7.0f} GB/s"
                f"  same={same}{tag}")

if __name__ == "__main__":
  main()
