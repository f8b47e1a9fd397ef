"""Time jsparse.voxelize against a numpy host path (np.unique based), and count compilations over a stream.

    python -m benchmarks.probes.voxelize_cpu [--sizes 100000 300000 1000000] [--channels 4] [--repeats 11]
        [--stream 20]

Scene: N points uniform in a 10 m cube, 0.1 m voxels (a 100^3 grid), C float32 features, reduce="mean".
Both sides start from the same host arrays and end with the merged voxels (coords, features): the numpy
side quantises in float64, then np.unique(keys, return_inverse, return_counts) and one np.bincount per
channel; jsparse runs `voxelize` (dedup None, i.e. "numpy" on a CPU backend, and dedup="xla") and waits
for the device. Each is warmed up, then timed as the median of --repeats calls. The stream part voxelizes
--stream clouds of distinct N (around 100k), from cold caches, through each host entry point a streamed scan
meets (voxelize, its point rows, SparseTensor.from_coords on numpy voxels), and counts XLA backend
compilations and the time per cloud after the first; it runs on any backend.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import jax
import numpy as np
from jax import monitoring

from benchmarks.suite import time_calls
from jsparse.sparse_tensor import SparseTensor
from jsparse.voxelize import voxelize

VOXEL = 0.1
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def numpy_voxelize(points, feats, voxel_size):
  """The host reference: (coords int64 [M, 3], mean feats float32 [M, C]), rows in key order."""
  p = np.asarray(points, np.float64)
  idx = np.floor((p - p.min(axis=0)) / voxel_size).astype(np.int64)
  X, Y, Z = idx.max(axis=0) + 1
  keys = (idx[:, 0] * Y + idx[:, 1]) * Z + idx[:, 2]
  uniq, inverse, counts = np.unique(keys, return_inverse=True, return_counts=True)
  sums = np.stack([np.bincount(inverse, feats[:, c], minlength=uniq.size) for c in range(feats.shape[1])], 1)
  coords = np.stack([uniq // (Y * Z), uniq // Z % Y, uniq % Z], axis=1)
  return coords, (sums / counts[:, None]).astype(np.float32)


def interleaved_medians(fns, repeats, warmup=2):
  """{name: (median wall ms, median process CPU ms)}, calling the functions in turn each round so that
  all of them see the same machine load."""
  wall, cpu = {name: [] for name in fns}, {name: [] for name in fns}
  for round_ in range(warmup + repeats):
    for name, fn in fns.items():
      c0 = time.process_time()
      ms = time_calls(fn, jax.block_until_ready, 0, 1)["median_ms"]
      if round_ >= warmup:
        wall[name].append(ms)
        cpu[name].append(1e3 * (time.process_time() - c0))
  return {name: (float(np.median(wall[name])), float(np.median(cpu[name]))) for name in fns}


def cloud(n, channels, seed):
  rng = np.random.default_rng(seed)
  return rng.uniform(0, 10, (n, 3)).astype(np.float32), rng.normal(size=(n, channels)).astype(np.float32)


def count_compiles(fn):
  """(fn's result, the number of XLA backend compilations while it ran)."""
  events = []
  listener = lambda event, duration, **kw: events.append(event) if event == COMPILE_EVENT else None
  monitoring.register_event_duration_secs_listener(listener)
  try:
    out = fn()
  finally:
    monitoring.unregister_event_duration_listener(listener)
  return out, len(events)


def stream_calls():
  """The host entry points a streamed scan meets: {name: (prepare, call)}, prepare(points, feats) -> args (not
  timed) and call(*args) -> arrays to wait for. voxelize with either dedup, voxelize with point rows, and
  from_coords on the numpy voxels of the cloud (one point per voxel)."""
  def voxels(pts, feats):
    _, rows = np.unique(np.floor(pts / VOXEL).astype(np.int64) @ np.array([1 << 20, 1 << 10, 1]), return_index=True)
    return np.floor(pts[rows] / VOXEL).astype(np.int32), feats[rows]
  points = lambda pts, feats: (pts, feats)
  return {
      "voxelize": (points, lambda pts, feats: voxelize(pts, feats, voxel_size=VOXEL).feats),
      "voxelize dedup=xla": (points, lambda pts, feats: voxelize(pts, feats, voxel_size=VOXEL, dedup="xla").feats),
      "voxelize return_index": (points, lambda pts, feats: voxelize(pts, feats, voxel_size=VOXEL, return_index=True)),
      "from_coords": (voxels, lambda coords, feats: SparseTensor.from_coords(coords, feats, (101,) * 3, 1).feats)}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--sizes", type=int, nargs="+", default=[100_000, 300_000, 1_000_000])
  ap.add_argument("--channels", type=int, default=4)
  ap.add_argument("--repeats", type=int, default=11)
  ap.add_argument("--stream", type=int, default=20)
  args = ap.parse_args(argv)
  print(f"jax {jax.__version__}, numpy {np.__version__}, backend {jax.default_backend()}, "
        f"{os.cpu_count()} CPUs")
  print("median ms per call, wall (process CPU time in brackets)")
  print(f"{'N':>9} {'voxels':>8} {'numpy':>15} {'jsparse':>15} {'dedup=xla':>15}")
  for n in args.sizes:
    pts, feats = cloud(n, args.channels, n)
    ref_coords, ref_feats = numpy_voxelize(pts, feats, VOXEL)
    t = voxelize(pts, feats, voxel_size=VOXEL)
    m = int(t.num)
    assert m == len(ref_coords)
    np.testing.assert_array_equal(np.asarray(t.coords[:m, 1:]), ref_coords)
    np.testing.assert_allclose(np.asarray(t.feats[:m]), ref_feats, rtol=1e-5, atol=1e-5)
    times = interleaved_medians({
        "numpy": lambda: numpy_voxelize(pts, feats, VOXEL),
        "jsparse": lambda: voxelize(pts, feats, voxel_size=VOXEL).feats,
        "xla": lambda: voxelize(pts, feats, voxel_size=VOXEL, dedup="xla").feats}, args.repeats)
    cells = " ".join(f"{f'{w:.1f} ({c:.1f})':>15}" for w, c in times.values())
    print(f"{n:>9} {m:>8} {cells}")

  rng = np.random.default_rng(1)
  sizes = rng.choice(np.arange(90_000, 110_000), args.stream, replace=False)
  for name, (prepare, call) in stream_calls().items():
    jax.clear_caches()  # count from cold

    def stream():
      per_cloud = []
      for i, n in enumerate(sizes):
        call_args = prepare(*cloud(int(n), args.channels, 100 + i))
        start = time.perf_counter()
        jax.block_until_ready(call(*call_args))
        per_cloud.append(time.perf_counter() - start)
      return per_cloud
    per_cloud, compiles = count_compiles(stream)
    later = f", then median {1e3 * np.median(per_cloud[1:]):.1f} ms a cloud" if len(per_cloud) > 1 else ""
    print(f"stream of {args.stream} clouds, N in [{sizes.min()}, {sizes.max()}], {name}: {compiles} compilations, "
          f"{sum(per_cloud):.2f} s in all{later}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
