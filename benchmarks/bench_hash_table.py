"""Time pallas_kernels.hash_table.neighbor_map_hashed on sphere-shell voxels (GPU).

    python -m benchmarks.bench_hash_table [--res 64 128 256 512] [--lidar small large] [--repeats 30]
        [--block-rows R] [--block-pairs P] [--num-warps W] [--num-warps-build W] [--table-factor F]

Sphere shell at resolution RES (workloads.sphere_shell_coords: 15k, 64k, 252k and 1.03M voxels for 64,
128, 256, 512), 3x3x3 offsets, batch 0, rows shuffled; with --lidar, also the networks benchmark's LiDAR
batches (SECOND's grid, `networks.make_inputs`; the ray casting of "large" takes ~20 s).
Each case is jitted, warmed up, then timed as the median of --repeats device-synchronised calls
(block_until_ready); 'pipelined' is the mean over --repeats calls issued back to back with one
sync at the end. Checks the result against a numpy reference once per case.

    python -m benchmarks.bench_hash_table --wide [--res ...] [--repeats 30]

The int32-key path against the wide-key path (grids of 2**31 sites or more, keys of two words): per RES,
the neighbour map and a strided convolution's output sites (3^3 kernel, stride 2, Pallas) on the shell in
a RES^3 grid (int32 keys), and on the same shell moved to batch 7, offset (777, 555, 333), of a
2048^3 x 8 grid (wide keys). Both are checked against the XLA path once.
"""
from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import networks
from benchmarks.suite import time_calls
from benchmarks.workloads import sphere_shell_coords
from pallas_kernels.hash_table import neighbor_map_hashed, table_size_for

OFFS_333 = tuple((a, b, c) for a in (-1, 0, 1) for b in (-1, 0, 1) for c in (-1, 0, 1))


def reference(coords, shape, offsets):
  c = coords.astype(np.int64)
  X, Y, Z = shape
  keys = ((c[:, 0] * X + c[:, 1]) * Y + c[:, 2]) * Z + c[:, 3]
  order = np.argsort(keys)
  sk = keys[order]
  out = np.full((len(c), len(offsets)), -1, np.int32)
  for v, (dx, dy, dz) in enumerate(offsets):
    nx, ny, nz = c[:, 1] + dx, c[:, 2] + dy, c[:, 3] + dz
    inside = (nx >= 0) & (nx < X) & (ny >= 0) & (ny < Y) & (nz >= 0) & (nz < Z)
    q = ((c[:, 0] * X + nx) * Y + ny) * Z + nz
    pos = np.minimum(np.searchsorted(sk, q), len(sk) - 1)
    out[:, v] = np.where(inside & (sk[pos] == q), order[pos], -1)
  return out


def _median_ms(fn, *args, repeats):
  return time_calls(lambda: fn(*args), jax.block_until_ready, 1, repeats)["median_ms"]


def compare_wide(res_list, repeats):
  """Median ms of the int32-key and wide-key paths on the same shell (module docstring, --wide)."""
  import jsparse
  from jsparse.sparse_conv import pair_map

  print(f"{'RES':>5} {'voxels':>9} {'nbr int32':>10} {'nbr wide':>9} {'sites int32':>12} {'sites wide':>11} "
        f"{'check':>6}")
  rng = np.random.default_rng(0)
  for res in res_list:
    pts = sphere_shell_coords(res)
    pts = pts[rng.permutation(len(pts))]
    n = len(pts)
    cap = jsparse.round_capacity(n)
    row = [f"{res:>5} {n:>9}"]
    results = {}
    for name, shift, grid, batch in (("int32", (0, 0, 0, 0), (res,) * 3, 1),
                                     ("wide", (7, 777, 555, 333), (2048,) * 3, 8)):
      coords = np.full((cap, 4), -1, np.int32)
      coords[:n] = pts + np.array(shift, np.int32)
      x = jsparse.SparseTensor(jnp.asarray(coords), jnp.zeros((cap, 1), jnp.float32), jnp.int32(n), grid, batch)
      assert x.key_width == (1 if name == "int32" else 2)
      nbr_fn = jax.jit(lambda x: jsparse.neighbor_map(x, 3, implementation="pallas", plan_block_sizes=()).nbr)
      sites_fn = jax.jit(lambda x: pair_map(x, 3, 2, 1, out_capacity=cap, implementation="pallas").inv)
      results[name] = (_median_ms(nbr_fn, x, repeats=repeats), _median_ms(sites_fn, x, repeats=repeats))
      ok = (np.array_equal(nbr_fn(x), jsparse.neighbor_map(x, 3, implementation="xla").nbr)
            and np.array_equal(sites_fn(x), pair_map(x, 3, 2, 1, out_capacity=cap, implementation="xla").inv))
      results[name + "_ok"] = ok
    check = "ok" if results["int32_ok"] and results["wide_ok"] else "FAIL"
    print(f"{row[0]} {results['int32'][0]:>10.3f} {results['wide'][0]:>9.3f} {results['int32'][1]:>12.3f} "
          f"{results['wide'][1]:>11.3f} {check:>6}", flush=True)


def cases(res_list, lidar_sizes):
  """(label, coords int32 [N, 4], spatial_shape) to time: the sphere shells of res_list (rows shuffled), then the
  networks benchmark's LiDAR batches of lidar_sizes (its SECOND grid; rows in their order there)."""
  rng = np.random.default_rng(0)
  for res in res_list:
    pts = sphere_shell_coords(res)
    yield res, pts[rng.permutation(len(pts))], (res, res, res)
  for size in lidar_sizes:
    inp = networks.make_inputs(networks.workload("second", size))
    yield f"lidar {size}", inp.coords, tuple(inp.spatial_shape)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--res", type=int, nargs="+", default=[64, 128, 256, 512])
  ap.add_argument("--lidar", nargs="*", default=[], choices=("tiny", "small", "large"),
                  help="also the networks benchmark's LiDAR batches of these sizes (large: ~1.07M sites, batch 4)")
  ap.add_argument("--repeats", type=int, default=30)
  # Unset tuning arguments take neighbor_map_hashed's defaults.
  ap.add_argument("--block-rows", type=int)
  ap.add_argument("--block-pairs", type=int)
  ap.add_argument("--num-warps", type=int)
  ap.add_argument("--num-warps-build", type=int)
  ap.add_argument("--table-factor", type=int,
                  help="table size = smallest power of two >= this x voxels")
  ap.add_argument("--interleave", type=int, choices=(0, 1),
                  help="1: keys and values in one table, 0: two tables (default: the function's)")
  ap.add_argument("--no-check", action="store_true")
  ap.add_argument("--wide", action="store_true", help="time the int32-key path against the wide-key path")
  args = ap.parse_args()

  print(f"backend={jax.default_backend()} devices={jax.devices()}")
  if args.wide:
    compare_wide(args.res, args.repeats)
    return
  tune = {k: getattr(args, k) for k in ("block_rows", "block_pairs", "num_warps",
                                         "num_warps_build", "interleave")
          if getattr(args, k) is not None}
  print(f"tuning: {tune or 'defaults'}, table_factor={args.table_factor or 'default'}")
  print(f"{'RES':>11} {'voxels':>9} {'median ms':>10} {'min ms':>8} {'pipelined':>10} "
        f"{'Mpairs/s':>9} {'check':>6}")
  for res, pts, shape in cases(args.res, args.lidar):
    n = len(pts)
    kw = dict(tune)
    if args.table_factor:
      kw["table_size"] = table_size_for(n, args.table_factor)
    fn = jax.jit(lambda c, k, shape=shape, kw=kw: neighbor_map_hashed(
        c, k, spatial_shape=shape, offsets=OFFS_333, **kw))
    coords = jnp.asarray(pts)
    num = jnp.int32(n)
    nbr, ovf = fn(coords, num)
    jax.block_until_ready((nbr, ovf))
    timed = time_calls(lambda: fn(coords, num), jax.block_until_ready, 3, args.repeats)
    med, best = timed["median_ms"], timed["min_ms"]
    # Pipelined: many calls in flight, one sync (hides the host round trip of each sync).
    t0 = time.perf_counter()
    outs = [fn(coords, num) for _ in range(args.repeats)]
    jax.block_until_ready(outs)
    piped = 1e3 * (time.perf_counter() - t0) / args.repeats
    del outs
    check = "-"
    if not args.no_check:
      ok = (not bool(ovf)) and np.array_equal(np.asarray(nbr), reference(pts, shape, OFFS_333))
      check = "ok" if ok else "FAIL"
    print(f"{res!s:>11} {n:>9} {med:>10.3f} {best:>8.3f} {piped:>10.3f} "
          f"{n * 27 / med / 1e3:>9.1f} {check:>6}", flush=True)


if __name__ == "__main__":
  main()
