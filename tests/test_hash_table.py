"""Tests for pallas_kernels/hash_table.py (GPU hash-table neighbour map).

CPU: interpret-mode kernels against a numpy reference, and Triton lowering (no GPU needed).
GPU (``-m gpu``, skipped elsewhere): the real Triton kernels, including atomic_xchg.
"""
from __future__ import annotations

import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))
for _p in (_HERE, os.path.dirname(_HERE)):
  if _p not in sys.path:
    sys.path.insert(0, _p)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from pallas_kernels.hash_table import neighbor_map_hashed  # noqa: E402


def _cube(k=3, dilation=1):
  r = range(-(k // 2), k // 2 + 1)
  return tuple((a * dilation, b * dilation, c * dilation) for a in r for b in r for c in r)


OFFS_333 = _cube(3)
OFFS_331 = tuple((a, b, 0) for a in (-1, 0, 1) for b in (-1, 0, 1))
OFFS_DIL2 = _cube(3, dilation=2)
OFFS_ODD = ((0, 0, 0), (1, 0, 0), (0, 2, -1), (-3, 1, 1), (2, 2, 2))  # not symmetric


# ------------------------------------------------------------------------------------------
# References
# ------------------------------------------------------------------------------------------


def ref_dict(coords, num, spatial_shape, offsets):
  """Plain python/numpy reference: dict of coords -> row."""
  coords = np.asarray(coords)
  X, Y, Z = spatial_shape
  cap = coords.shape[0]
  table = {tuple(int(c) for c in coords[i]): i for i in range(num)}
  out = np.full((cap, len(offsets)), -1, np.int32)
  for i in range(num):
    b, x, y, z = (int(c) for c in coords[i])
    for v, (dx, dy, dz) in enumerate(offsets):
      nx, ny, nz = x + dx, y + dy, z + dz
      if 0 <= nx < X and 0 <= ny < Y and 0 <= nz < Z:
        out[i, v] = table.get((b, nx, ny, nz), -1)
  return out


def ref_sorted(coords, num, spatial_shape, offsets):
  """Vectorised numpy reference (sorted keys + searchsorted), fast for 1e5-1e6 points."""
  coords = np.asarray(coords, np.int64)
  X, Y, Z = spatial_shape
  cap = coords.shape[0]
  c = coords[:num]
  keys = ((c[:, 0] * X + c[:, 1]) * Y + c[:, 2]) * Z + c[:, 3]
  order = np.argsort(keys, kind="stable")
  skeys = keys[order]
  out = np.full((cap, len(offsets)), -1, np.int32)
  if num == 0:
    return out
  for v, (dx, dy, dz) in enumerate(offsets):
    nx, ny, nz = c[:, 1] + dx, c[:, 2] + dy, c[:, 3] + dz
    inside = (nx >= 0) & (nx < X) & (ny >= 0) & (ny < Y) & (nz >= 0) & (nz < Z)
    q = ((c[:, 0] * X + nx) * Y + ny) * Z + nz
    pos = np.minimum(np.searchsorted(skeys, q), num - 1)
    hit = inside & (skeys[pos] == q)
    out[:num, v] = np.where(hit, order[pos], -1)
  return out


def random_points(rng, spatial_shape, batch, num, capacity, pad="neg1"):
  """num distinct random sites over `batch` batches, shuffled, in a [capacity, 4] array."""
  X, Y, Z = spatial_shape
  vol = X * Y * Z
  lin = rng.choice(batch * vol, size=num, replace=False)
  b, r = np.divmod(lin, vol)
  x, r = np.divmod(r, Y * Z)
  y, z = np.divmod(r, Z)
  coords = np.empty((capacity, 4), np.int32)
  coords[:num] = np.stack([b, x, y, z], axis=1)
  if pad == "neg1":
    coords[num:] = -1
  elif pad == "garbage":
    coords[num:] = rng.integers(-50, 50, size=(capacity - num, 4))
    if capacity > num and num > 0:  # also copies of valid rows: must stay ignored
      coords[num] = coords[0]
  elif pad == "zero":
    coords[num:] = 0
  return coords


def sphere_shell(res):
  """Voxels p with res/2 - 1.25 <= |p + 0.5 - res/2| <= res/2, batch 0 ([N, 4] int32)."""
  c = res / 2.0
  t = (np.arange(res, dtype=np.float64) + 0.5 - c) ** 2
  lo, hi = (c - 1.25) ** 2, c ** 2
  parts = []
  yz = t[:, None] + t[None, :]
  for x in range(res):  # slab by slab: bounded memory for large res
    d2 = t[x] + yz
    y, z = np.nonzero((d2 >= lo) & (d2 <= hi))
    if y.size:
      parts.append(np.stack([np.zeros_like(y), np.full_like(y, x), y, z], axis=1))
  return np.concatenate(parts).astype(np.int32)


# ------------------------------------------------------------------------------------------
# CPU: interpret mode
# ------------------------------------------------------------------------------------------


def _run_interpret(coords, num, spatial_shape, offsets, **kw):
  nbr, ovf = neighbor_map_hashed(jnp.asarray(coords), jnp.int32(num), spatial_shape=spatial_shape,
                                 offsets=offsets, interpret=True, **kw)
  return np.asarray(nbr), bool(ovf)


def test_reference_self_consistent():
  rng = np.random.default_rng(1)
  coords = random_points(rng, (7, 5, 9), 2, 120, 150, pad="garbage")
  for offs in (OFFS_333, OFFS_DIL2, OFFS_ODD):
    np.testing.assert_array_equal(ref_sorted(coords, 120, (7, 5, 9), offs),
                                  ref_dict(coords, 120, (7, 5, 9), offs))


@pytest.mark.parametrize(
    "spatial_shape,batch,num,capacity,offsets,pad",
    [
        ((7, 5, 9), 1, 60, 64, OFFS_333, "neg1"),
        ((7, 5, 9), 3, 150, 200, OFFS_333, "garbage"),
        ((4, 11, 6), 2, 90, 128, OFFS_331, "neg1"),
        ((9, 9, 8), 2, 200, 237, OFFS_DIL2, "garbage"),
        ((5, 6, 7), 2, 100, 100, OFFS_ODD, "zero"),  # no padding rows at all
        ((3, 3, 3), 1, 27, 40, OFFS_333, "neg1"),  # dense: every in-grid neighbour exists
    ],
)
def test_interpret_matches_reference(spatial_shape, batch, num, capacity, offsets, pad):
  rng = np.random.default_rng(hash((spatial_shape, batch, num, capacity, pad)) % 2**32)
  coords = random_points(rng, spatial_shape, batch, num, capacity, pad=pad)
  nbr, ovf = _run_interpret(coords, num, spatial_shape, offsets)
  assert not ovf
  assert nbr.shape == (capacity, len(offsets)) and nbr.dtype == np.int32
  np.testing.assert_array_equal(nbr, ref_dict(coords, num, spatial_shape, offsets))


@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("table_size", [256, 2048])  # load factor 100/256, 100/2048
def test_interpret_layouts_blocks_table_sizes(interleave, table_size):
  # Both table layouts; the smallest allowed table (2 x capacity, rounded up) and a large one;
  # block_pairs not dividing capacity*V.
  rng = np.random.default_rng(7)
  coords = random_points(rng, (6, 6, 6), 2, 100, 100, pad="garbage")
  nbr, ovf = _run_interpret(coords, 100, (6, 6, 6), OFFS_333, block_rows=8, block_pairs=64,
                            table_size=table_size, interleave=interleave)
  assert not ovf
  np.testing.assert_array_equal(nbr, ref_dict(coords, 100, (6, 6, 6), OFFS_333))


def test_interpret_empty():
  coords = np.full((16, 4), -1, np.int32)
  nbr, ovf = _run_interpret(coords, 0, (4, 4, 4), OFFS_333)
  assert not ovf
  np.testing.assert_array_equal(nbr, np.full((16, 27), -1, np.int32))


def test_interpret_jit_traced_num():
  rng = np.random.default_rng(3)
  shape = (8, 5, 7)
  cap = 96
  coords = random_points(rng, shape, 2, cap, cap, pad="neg1")  # first k rows valid for any k

  @jax.jit
  def f(c, n):
    return neighbor_map_hashed(c, n, spatial_shape=shape, offsets=OFFS_333, interpret=True)

  for num in (0, 1, 50, 96):
    c = coords.copy()
    c[num:] = rng.integers(-3, 9, size=(cap - num, 4))  # garbage padding
    nbr, ovf = f(jnp.asarray(c), jnp.int32(num))
    assert not bool(ovf)
    np.testing.assert_array_equal(np.asarray(nbr), ref_dict(c, num, shape, OFFS_333))
  assert f._cache_size() == 1  # num traced: one compilation


def test_interpret_overflow_flag_with_tiny_probe_bound():
  # max_probes=1: collisions are certain with 128 keys in 256 slots; must flag, not hang.
  rng = np.random.default_rng(5)
  coords = random_points(rng, (8, 8, 8), 1, 128, 128)
  _, ovf = _run_interpret(coords, 128, (8, 8, 8), OFFS_333, max_probes=1)
  assert ovf


def test_bad_arguments():
  c = jnp.zeros((8, 4), jnp.int32)
  with pytest.raises(ValueError):
    neighbor_map_hashed(c, 0, spatial_shape=(4, 4, 4), offsets=OFFS_333, table_size=8)
  with pytest.raises(ValueError):
    neighbor_map_hashed(c, 0, spatial_shape=(4, 4, 4), offsets=OFFS_333, block_pairs=100)


# ------------------------------------------------------------------------------------------
# CPU: Triton lowering (GPU path, interpret=False)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("offsets,interleave", [(OFFS_333, True), (OFFS_331, False)])
def test_triton_lowering(offsets, interleave):
  from triton_lowering import lower_for_cuda

  def f(c, n):
    return neighbor_map_hashed(c, n, spatial_shape=(32, 17, 9), offsets=offsets,
                               interleave=interleave)

  text = lower_for_cuda(f, jnp.zeros((1000, 4), jnp.int32), jnp.int32(0))
  assert text.count("__gpu$xla.gpu.triton") == 3
  for name in ("hash_build", "hash_fill", "hash_query"):
    assert name in text


# ------------------------------------------------------------------------------------------
# GPU: real Triton kernels
# ------------------------------------------------------------------------------------------


_on_gpu = jax.default_backend() == "gpu"


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu, reason="needs a CUDA GPU")
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("res", [64, 256])
def test_gpu_sphere_shell(res, interleave):
  pts = sphere_shell(res)
  rng = np.random.default_rng(res)
  pts = pts[rng.permutation(len(pts))]
  num = len(pts)
  cap = num + 37
  coords = np.full((cap, 4), -1, np.int32)
  coords[:num] = pts
  shape = (res, res, res)
  f = jax.jit(lambda c, n: neighbor_map_hashed(c, n, spatial_shape=shape, offsets=OFFS_333,
                                               interleave=interleave))
  nbr, ovf = f(jnp.asarray(coords), jnp.int32(num))
  assert not bool(ovf)
  ref = ref_sorted(coords, num, shape, OFFS_333)
  nbr = np.asarray(nbr)
  mism = np.argwhere(nbr != ref)
  assert mism.size == 0, f"{len(mism)} mismatches, first {mism[:5].tolist()}"
  if res == 256:
    assert num > 200_000


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu, reason="needs a CUDA GPU")
@pytest.mark.parametrize("offsets", [OFFS_333, OFFS_DIL2, OFFS_ODD])
def test_gpu_random_batched_padded(offsets):
  rng = np.random.default_rng(11)
  shape = (61, 40, 77)
  num, cap = 60_000, 70_001
  coords = random_points(rng, shape, 2, num, cap, pad="garbage")
  f = jax.jit(lambda c, n: neighbor_map_hashed(c, n, spatial_shape=shape, offsets=offsets))
  for n in (num, num // 3):  # traced num, same compiled function
    nbr, ovf = f(jnp.asarray(coords), jnp.int32(n))
    assert not bool(ovf)
    np.testing.assert_array_equal(np.asarray(nbr), ref_sorted(coords, n, shape, offsets))
