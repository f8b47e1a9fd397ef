"""Probe: a first-level submanifold map (rows in any order) through the hash table against the rows' occupancy map.

    python -m benchmarks.probes.first_level_map [--res 64,128,256,512] [--orders generated,shuffled]
                                                [--lidar 100k,1m] [--repeats 20]

For each RES, the sphere shell of `benchmarks.kernels --sections neighbor_map` in the order it is generated
("generated": blocks of the grid in turn) and shuffled ("shuffled", as rows from a loader may come), 3x3x3 map:
`hash_table.neighbor_map_hashed` against `occupancy_neighbors.rows_occupancy` then
`neighbor_map_from_occupancy(rows_by_rank=...)`, each jitted over `--inner` distinct input sets (kernels.bench_jax:
ms per call), both maps checked equal first. Then one trace per path (`networks.profile_jax`): the kernels' ms per
call. `--lidar`: the same for `jsparse.shapes.lidar_batch(0, preset=...)` (SECOND's first level, in its order).
"""
import argparse
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from benchmarks import kernels, networks, workloads
from pallas_kernels import hash_table, occupancy_neighbors

OFFSETS = tuple((dx, dy, dz) for dx in (-1, 0, 1) for dy in (-1, 0, 1) for dz in (-1, 0, 1))


def hashed(coords, num, shape, batch):
  return hash_table.neighbor_map_hashed(coords, num, spatial_shape=shape, offsets=OFFSETS)[0]


def occupancy(coords, num, shape, batch):
  occ, rows = occupancy_neighbors.rows_occupancy(coords, num, spatial_shape=shape, batch_size=batch)
  return occupancy_neighbors.neighbor_map_from_occupancy(coords, num, occ, spatial_shape=shape, batch_size=batch,
                                                         offsets=OFFSETS, rows_by_rank=rows)


def inputs(args):
  """(label, coords int32 [N, 4], spatial shape, batch size) of every input asked for."""
  for res in [int(r) for r in args.res.split(",") if r]:
    base = workloads.sphere_shell_coords(res)
    for order in args.orders.split(","):
      pts = base if order == "generated" else base[np.random.default_rng(res).permutation(len(base))]
      yield f"RES {res} {order}", pts.astype(np.int32), (res,) * 3, 1
  for preset in [p for p in args.lidar.split(",") if p]:
    coords, _, shape = jsparse.shapes.lidar_batch(0, preset=preset)
    yield f"lidar {preset}", np.asarray(coords, np.int32), tuple(shape), int(coords[:, 0].max()) + 1


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--res", default="64,128,256,512")
  ap.add_argument("--orders", default="generated,shuffled")
  ap.add_argument("--lidar", default="100k,1m")
  ap.add_argument("--inner", type=int, default=8)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--calls", type=int, default=10)
  args = ap.parse_args(argv)
  print("| input | rows | occupancy fits | hash ms | occupancy ms | hash / occupancy | hash kernels ms | "
        "occupancy kernels ms |")
  print("|---|---|---|---|---|---|---|---|")
  for label, coords, shape, batch in inputs(args):
    fits = occupancy_neighbors.rows_fit(len(coords), len(OFFSETS), shape, batch)
    sets = [(jnp.asarray(coords) + 0, jnp.int32(len(coords))) for _ in range(args.inner)]
    want = np.asarray(jax.jit(lambda c, n: hashed(c, n, shape, batch))(*sets[0]))
    got = np.asarray(jax.jit(lambda c, n: occupancy(c, n, shape, batch))(*sets[0]))
    assert np.array_equal(got, want), f"{label}: {int(np.sum(got != want))} entries differ"
    times, traced = {}, {}
    for name, fn in (("hash", hashed), ("occupancy", occupancy)):
      run = lambda c, n, fn=fn: fn(c, n, shape, batch)  # noqa: E731
      times[name] = kernels.bench_jax(run, sets, args.warmup, args.repeats)["ms"]
      prof = networks.profile_jax(jax.jit(run).lower(*sets[0]).compile(), sets[0], args.calls, tempfile.mkdtemp())
      traced[name] = sum(prof["ms"].values())
      print(f"  {name} {label}: " + ", ".join(f"{k.split(' :: ')[1]} {v:.4f}" for k, v in
                                             list(prof["top_kernels"].items())[:8]), flush=True)
    print(f"| {label} | {len(coords):,} | {fits} | {times['hash']:.4f} | {times['occupancy']:.4f} | "
          f"{times['hash'] / times['occupancy']:.2f}x | {traced['hash']:.4f} | {traced['occupancy']:.4f} |", flush=True)

if __name__ == "__main__":
  main()
