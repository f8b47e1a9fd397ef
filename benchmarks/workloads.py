"""The benchmark workloads: sphere-shell voxel sets and the suite's (RES, C, L) rows.

FlexGEMM's benchmark (tests/submconv/*_benchmark.py) runs stacks of L SubMConv3d 3x3x3 C->C layers on a
one-voxel-thick sphere shell inside a RES^3 grid. This module rebuilds those sites with numpy (same sites,
same row order) so that jsparse and FlexGEMM see identical inputs.

`python -m benchmarks.workloads` checks the site counts against BASELINES.md and prints pair counts.
"""
from __future__ import annotations

import argparse
import dataclasses
import itertools
import time

import numpy as np

# Rows generated one block of CHUNK^3 candidate sites at a time (memory), blocks in (x, y, z) order and
# sites row-major inside a block: the row order FlexGEMM's benchmark feeds its kernels (it matters for
# locality at RES 512, where there are 8 blocks).
CHUNK = 256


@dataclasses.dataclass(frozen=True)
class Row:
  """One suite workload: a RES^3 sphere shell, L SubMConv3d layers of C -> C channels."""

  res: int
  channels: int
  layers: int
  voxels: int  # expected site count (BASELINES.md)
  pairs: int  # expected (site, neighbour) pairs of the 3x3x3 neighbour map, the site itself included

  @property
  def name(self) -> str:
    return f"{self.res},{self.channels},{self.layers}"


# The seven rows of FlexGEMM's benchmark, with the counts BASELINES.md gives.
SUITE = (
    Row(8, 1024, 16, 192, 2_544),
    Row(16, 1024, 8, 848, 10_544),
    Row(32, 1024, 4, 3_840, 50_304),
    Row(64, 1024, 2, 15_192, 191_208),
    Row(128, 512, 2, 64_160, 831_680),
    Row(256, 256, 2, 252_392, 3_203_048),
    Row(512, 128, 2, 1_026_536, 13_155_032),
)


def sphere_shell_coords(res: int, batch_size: int = 1) -> np.ndarray:
  """int32 [N, 4] rows (batch, x, y, z) of the sites p with RES/2 - 1.25 <= |p + 0.5 - RES/2| <= RES/2.

  Exact integer test: with s = sum_i (2 p_i + 1 - RES)^2 = 4 |p + 0.5 - RES/2|^2, the condition reads
  (2 RES - 5)^2 <= 4 s <= 4 RES^2 (RES >= 3). Batches repeat the same sites, batch 0 first.
  """
  if res < 3:
    raise ValueError(f"res must be >= 3, got {res}")
  lo, hi = (2 * res - 5) ** 2, 4 * res * res
  axis = (2 * np.arange(res, dtype=np.int64) + 1 - res) ** 2  # (2p + 1 - RES)^2 along one axis
  blocks = []
  starts = range(0, res, CHUNK)
  for i, j, k in itertools.product(starts, starts, starts):
    ax, ay, az = axis[i:i + CHUNK], axis[j:j + CHUNK], axis[k:k + CHUNK]
    s4 = 4 * (ax[:, None, None] + ay[None, :, None] + az[None, None, :])
    local = np.argwhere((s4 >= lo) & (s4 <= hi))  # row-major inside the block
    blocks.append(local + np.array([i, j, k]))
  xyz = np.concatenate(blocks).astype(np.int32)
  batch = np.repeat(np.arange(batch_size, dtype=np.int32), len(xyz))
  return np.concatenate([batch[:, None], np.tile(xyz, (batch_size, 1))], axis=1)


def neighbor_pairs(coords: np.ndarray, spatial_shape, kernel_size: int = 3) -> int:
  """Number of (site, neighbour) pairs of a submanifold kxkxk map (numpy reference, the centre included)."""
  coords = np.asarray(coords, np.int64)
  x, y, z = spatial_shape
  dims = np.array([x, y, z])

  def key(c):
    return ((c[:, 0] * x + c[:, 1]) * y + c[:, 2]) * z + c[:, 3]

  keys = np.sort(key(coords))
  r = kernel_size // 2
  total = 0
  for off in itertools.product(range(-r, r + 1), repeat=3):
    q = coords.copy()
    q[:, 1:] += np.array(off)
    inside = np.all((q[:, 1:] >= 0) & (q[:, 1:] < dims), axis=1)
    qk = key(q[inside])
    pos = np.minimum(np.searchsorted(keys, qk), len(keys) - 1)
    total += int(np.count_nonzero(keys[pos] == qk))
  return total


def useful_flops(pairs: int, channels: int, layers: int, train: bool) -> float:
  """2 * pairs * C * C per layer for the forward pass; a training step counts 3x (forward, dX, dW)."""
  return 2.0 * pairs * channels * channels * layers * (3 if train else 1)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--pairs-up-to", type=int, default=128, help="count neighbour pairs for RES <= this")
  args = ap.parse_args()
  ok = True
  for row in SUITE:
    t0 = time.perf_counter()
    coords = sphere_shell_coords(row.res)
    n = len(coords)
    line = f"RES {row.res:4d}: N = {n:9,d} (BASELINES {row.voxels:9,d}) {'ok' if n == row.voxels else 'MISMATCH'}"
    ok &= n == row.voxels
    if row.res <= args.pairs_up_to:
      pairs = neighbor_pairs(coords, (row.res,) * 3)
      ok &= pairs == row.pairs
      line += (f"; pairs = {pairs:11,d} (BASELINES {row.pairs:11,d}) {'ok' if pairs == row.pairs else 'MISMATCH'}"
               f"; fwd GFLOP (all L) = {useful_flops(pairs, row.channels, row.layers, False) / 1e9:.0f}")
    print(line + f"  [{time.perf_counter() - t0:.2f} s]")
  print("all counts match BASELINES.md" if ok else "COUNTS DIFFER FROM BASELINES.md")
  raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
  main()
