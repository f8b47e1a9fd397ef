"""A review of serialization (space-filling-curve keys) and voxelization / sampling against plain references.

The curves are checked against a bit-by-bit Python interleave and a brute-force walk of the Hilbert path; the
voxelizers and grid_sample against numpy / jax.scipy computations on a dense grid.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.ndimage as jnd
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jsparse import serialize
from jsparse.sampling import grid_sample, lookup_rows
from jsparse.sparse_tensor import SparseTensor
from jsparse.voxelize import devoxelize, voxelize, voxelize_jit


def _morton_reference(p, bits: int) -> int:
  """Bit i of x goes to bit 3i+2, of y to 3i+1, of z to 3i (the module's layout), as a Python int."""
  return sum(((int(p[a]) >> i) & 1) << (3 * i + 2 - a) for i in range(bits) for a in range(3))


def _as_words(key: int, bits: int) -> list[int]:
  w = serialize.num_words(bits)
  return [(key >> (30 * (w - 1 - i))) & (2**30 - 1) for i in range(w)]


@settings(max_examples=25, deadline=None)
@given(bits=st.integers(1, 21), data=st.data())
def test_morton_keys_are_the_bit_interleave_and_hilbert_keys_invert(bits, data):
  coord = st.integers(0, 2**bits - 1)
  xyz = np.array(data.draw(st.lists(st.tuples(coord, coord, coord), min_size=1, max_size=8)), np.int64)
  xyz[0] = 2**bits - 1  # the grid's upper corner
  k = np.asarray(serialize.encode_morton(xyz, bits))
  want = np.array([_as_words(_morton_reference(p, bits), bits) for p in xyz]).reshape(k.shape)
  np.testing.assert_array_equal(k, want)
  np.testing.assert_array_equal(np.asarray(serialize.decode_morton(k, bits)), xyz)
  h = np.asarray(serialize.encode_hilbert(xyz, bits))
  assert h.min() >= 0
  np.testing.assert_array_equal(np.asarray(serialize.decode_hilbert(h, bits)), xyz)


@pytest.mark.parametrize("bits", [1, 2, 4])
def test_hilbert_walks_the_whole_cube_by_face_steps(bits):
  path = np.asarray(jax.jit(lambda k: serialize.decode_hilbert(k, bits))(jnp.arange(2 ** (3 * bits))))
  assert len({tuple(p) for p in path}) == 2 ** (3 * bits)  # a bijection onto the cube
  assert np.all(np.abs(np.diff(path, axis=0)).sum(axis=1) == 1)


@pytest.mark.parametrize("bits", [11, 21])
def test_wide_hilbert_keys_step_to_face_neighbours_across_word_boundaries(bits):
  top = 2 ** (3 * bits)
  runs = [range(s, s + 12) for s in (0, 2**30 - 6, 5 * 2**30 - 6, top // 2 - 6, top - 12)]
  words = np.array([[_as_words(k, bits) for k in run] for run in runs], np.int32)  # [runs, 12, W]
  path = np.asarray(serialize.decode_hilbert(words, bits))
  assert np.all(np.abs(np.diff(path, axis=1)).sum(axis=-1) == 1)
  np.testing.assert_array_equal(np.asarray(jax.vmap(lambda p: serialize.encode_hilbert(p, bits))(path)), words)


def test_fold_batch_at_its_limit_raises_or_marks_instead_of_colliding():
  bits = 10
  last = serialize.max_folded_batch(bits) - 1
  assert int(serialize.fold_batch(last, 2**30 - 1, bits)) == 2**31 - 1
  with pytest.raises(ValueError, match="batch"):
    serialize.fold_batch(last + 1, 0, bits)
  folded = jax.jit(lambda b: serialize.fold_batch(b, jnp.zeros_like(b), bits))(jnp.array([last, last + 1, -1]))
  np.testing.assert_array_equal(np.asarray(folded), [last << 30, -1, -1])


# ---- voxelize / voxelize_jit / devoxelize -------------------------------------------------------------

@pytest.mark.parametrize("reduce", ["mean", "sum", "max", "first"])
def test_voxel_reductions_match_a_numpy_reference(reduce):
  rng = np.random.default_rng(0)
  points, batch = rng.uniform(0, 4, (150, 3)), rng.integers(0, 3, 150)
  feats = rng.normal(size=(150, 2)).astype(np.float32)
  point_sites = [tuple(int(v) for v in site) for site in zip(batch, *np.floor(points / 0.7).astype(int).T)]
  groups = {}
  for i, site in enumerate(point_sites):
    groups.setdefault(site, []).append(i)
  sites = sorted(groups)  # rows are in linear key order
  pick = {"mean": lambda g: g.mean(0), "sum": lambda g: g.sum(0), "max": lambda g: g.max(0), "first": lambda g: g[0]}
  want = np.array([pick[reduce](feats[groups[s]]) for s in sites])
  t, rows = voxelize(points, feats, voxel_size=0.7, origin=0.0, batch=batch, reduce=reduce, return_index=True)
  n = int(t.num)
  assert [tuple(c) for c in np.asarray(t.coords[:n]).tolist()] == sites
  np.testing.assert_allclose(np.asarray(t.feats[:n]), want, rtol=1e-5, atol=1e-6)
  want_at_points = want[[sites.index(s) for s in point_sites]]
  np.testing.assert_allclose(np.asarray(devoxelize(t, rows)), want_at_points, rtol=1e-5, atol=1e-6)
  tj, overflow, rows_j = jax.jit(lambda p, f, b: voxelize_jit(
      p, f, voxel_size=0.7, origin=0.0, spatial_shape=t.spatial_shape, capacity=n, batch=b, batch_size=3,
      reduce=reduce, return_index=True))(points, feats, batch)
  assert not bool(overflow)
  np.testing.assert_array_equal(np.asarray(tj.coords), np.asarray(t.coords[:n]))
  np.testing.assert_allclose(np.asarray(tj.feats), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(rows_j), np.asarray(rows))


def test_voxelize_jit_drops_non_finite_and_outside_points_and_flags_overflow():
  points = np.array([[np.nan, 0, 0], [np.inf, 0, 0], [-np.inf, 1, 1], [4.0, 0, 0], [3.999, 0, 0], [-1e-6, 0, 0],
                     [0.5, 0.5, 0.5], [1.5, 0.5, 0.5]])
  t, overflow, rows = voxelize_jit(points, voxel_size=1.0, origin=0.0, spatial_shape=(4, 4, 4), capacity=2,
                                   return_index=True)
  assert int(t.num) == 2 and bool(overflow)  # voxels (0,0,0), (1,0,0), (3,0,0) for 2 rows
  np.testing.assert_array_equal(np.asarray(rows), [-1, -1, -1, -1, -1, -1, 0, 1])


# ---- complex points: refused, not cast to their real part ---------------------------------------------

def test_complex_points_are_refused_naming_points():
  points = np.array([[0.5 + 2j, 0.5, 0.5]])
  x = voxelize(np.array([[0.5, 0.5, 0.5]]), voxel_size=1.0, origin=0.0)
  for call in (lambda: voxelize(points, voxel_size=1.0, origin=0.0),
               lambda: voxelize_jit(points, voxel_size=1.0, origin=0.0, spatial_shape=(2, 2, 2), capacity=2),
               lambda: grid_sample(x, points),
               lambda: grid_sample(x, points, "nearest")):
    with pytest.raises(TypeError, match="points must be real"):
      call()


# ---- float64 points on voxel faces: every path quantises as voxelize does -----------------------------

def test_float64_points_on_voxel_faces_land_where_voxelize_puts_them():
  # 0.3 / 0.1 is 2.9999999999999996 in float64 (voxel 2), but XLA rewrites a division by a broadcast divisor as a
  # multiplication by its reciprocal, 0.3 * 10.0 = 3.0000000000000004 (voxel 3), so the jitted paths disagreed.
  with jax.enable_x64(True):
    points = np.stack([np.arange(40) * 0.1, np.arange(40)[::-1] * 0.1, np.full(40, 0.7)], axis=1)
    kwargs = dict(voxel_size=0.1, origin=0.0, spatial_shape=(40, 40, 40))
    t, rows = voxelize(points, np.arange(40.0), return_index=True, **kwargs)
    tj, _, rows_j = jax.jit(lambda p: voxelize_jit(p, np.arange(40.0), capacity=t.capacity, return_index=True,
                                                   **kwargs))(points)
    np.testing.assert_array_equal(np.asarray(tj.coords), np.asarray(t.coords))
    np.testing.assert_array_equal(np.asarray(rows_j), np.asarray(rows))
    want = np.asarray(devoxelize(t, rows))
    for sample in (jax.jit(lambda p: grid_sample(t, p, "nearest", voxel_size=0.1, origin=0.0)),
                   lambda p: grid_sample(t, p, "nearest", voxel_size=0.1, origin=0.0)):
      np.testing.assert_array_equal(np.asarray(sample(points)), want)


# ---- grid_sample against a dense reference -------------------------------------------------------------

def test_grid_sample_matches_map_coordinates_on_the_dense_grid_and_its_feats_gradient():
  rng = np.random.default_rng(1)
  shape = (5, 4, 6)
  coords = np.argwhere(rng.random((2,) + shape) < 0.5).astype(np.int32)
  feats = rng.normal(size=(len(coords), 2)).astype(np.float32)
  x = SparseTensor.from_coords(coords, feats, spatial_shape=shape, batch_size=2, capacity=len(coords) + 3)
  u = np.concatenate([rng.uniform(-1.5, 7.5, (120, 3)), rng.integers(-1, 8, (60, 3)) + rng.choice([0.0, 0.5], (60, 3)),
                      [[5.0, 4.0, 6.0], [4.9999, 3.9999, 5.9999], [0.0, 0.0, 0.0], [-0.5, 0.5, 0.5]]])
  b = rng.integers(0, 2, len(u))
  cot = rng.normal(size=(len(u), 2)).astype(np.float32)

  def dense_reference(f):
    dense = jnp.zeros((2,) + shape + (2,)).at[tuple(coords.T)].set(f)
    # The batch is a 4th axis sampled at integers, where the linear blend takes that item alone.
    at = [b.astype(np.float32), *(u - 0.5).T]
    return jnp.stack([jnd.map_coordinates(dense[..., c], at, order=1, mode="constant", cval=0.0) for c in range(2)],
                     axis=-1)

  np.testing.assert_allclose(np.asarray(grid_sample(x, u, batch=b)), np.asarray(dense_reference(feats)), atol=1e-6)
  # Jitted: op-by-op, the gradient's segmented scan compiles for seconds.
  grad = jax.jit(jax.grad(lambda f: jnp.sum(grid_sample(x.replace(feats=f), u, batch=b) * cot)))(x.feats)
  grad_ref = jax.jit(jax.grad(lambda f: jnp.sum(dense_reference(f) * cot)))(jnp.asarray(feats))
  np.testing.assert_allclose(np.asarray(grad[: len(coords)]), np.asarray(grad_ref), atol=1e-5)
  assert not np.any(np.asarray(grad[len(coords):]))  # padding rows get nothing
  # nearest: floor(u), zero outside the grid or at a missing site
  site = np.floor(u).astype(np.int32)
  rows = np.asarray(lookup_rows(x, np.concatenate([b[:, None], site], axis=1)))
  want = np.where((rows >= 0)[:, None], feats[rows], 0)
  np.testing.assert_array_equal(np.asarray(grid_sample(x, u, "nearest", batch=b)), want)
  # non-finite points sample zeros, with zero (not NaN) gradients
  bad = jnp.array([[np.nan, 1, 1], [np.inf, 1, 1], [-np.inf, 1, 1], [1e30, 1, 1]], jnp.float32)
  assert not np.any(np.asarray(grid_sample(x, bad)))
  assert not np.any(np.asarray(jax.jit(jax.grad(lambda p: jnp.sum(grid_sample(x, p))))(bad)))


# ---- gather_sites: rows outside [-1, M) -------------------------------------------------------------------

def test_gather_sites_rows_outside_the_values_raise_or_read_zeros():
  # Rows past M read the clamped last row (a real site's features), and an int64 row 2**32 wrapped to row 0.
  from jax.experimental import checkify

  import jsparse
  from jsparse.sampling import gather_sites
  values = jnp.arange(6.0).reshape(3, 2)
  for rows in (np.array([0, 3]), np.array([7]), np.array([-5]), np.array([2**32], np.int64)):
    with pytest.raises(ValueError, match="rows"):
      gather_sites(values, rows)
  np.testing.assert_array_equal(np.asarray(gather_sites(values, np.array([2, -1, 0]))), [[4, 5], [0, 0], [0, 1]])
  read = jax.jit(gather_sites)
  np.testing.assert_array_equal(np.asarray(read(values, jnp.array([0, 3, 7, -5]))), [[0, 1], [0, 0], [0, 0], [0, 0]])
  with jsparse.error_checks():
    err, _ = checkify.checkify(read)(values, jnp.array([1, 3]))
  assert "rows" in str(err.get())
  grad = jax.grad(lambda v: jnp.sum(read(v, jnp.array([2, 3, -4]))))(values)  # only row 2 was read
  np.testing.assert_array_equal(np.asarray(grad), [[0, 0], [0, 0], [1, 1]])


def test_voxel_centres_under_x64_are_float64_and_voxelize_back_to_their_voxels():
  # Centres were float32 whatever the mode: at a UTM-like origin (4e6, where float32 values are 0.25 apart) a
  # 0.1 voxel's centre landed voxels away from it, against the module's "voxelizing a centre gives its voxel back".
  from jsparse.voxelize import voxel_centres
  with jax.enable_x64(True):
    origin = np.array([5e5, 4e6, 100.0])
    points = origin + np.random.default_rng(0).uniform(0, 20, (200, 3))
    t = voxelize(points, voxel_size=0.1, origin=origin)
    centres, valid = voxel_centres(t, voxel_size=0.1, origin=origin)
    assert centres.dtype == jnp.float64
    back = voxelize(np.asarray(centres)[np.asarray(valid)], voxel_size=0.1, origin=origin,
                    spatial_shape=t.spatial_shape)
    np.testing.assert_array_equal(np.asarray(back.coords), np.asarray(t.coords))
  centres, _ = voxel_centres(t)
  assert centres.dtype == jnp.float32  # without x64, float32 as before


@settings(max_examples=15, deadline=None)
@given(size=st.floats(0.01, 3.0), steps=st.lists(st.integers(0, 60), min_size=3, max_size=3))
def test_float64_lattice_points_quantise_alike_in_every_path(size, steps):
  # Points on multiples of the voxel size sit on faces up to rounding: the traced voxel_size is broadcast too, and
  # XLA's reciprocal rewrite moved some of them (e.g. size 0.1) off voxelize's voxel.
  with jax.enable_x64(True):
    k = np.arange(64)
    points = np.stack([(k + s) % 61 * size for s in steps], axis=1)
    t, rows = voxelize(points, voxel_size=size, origin=0.0, spatial_shape=(61, 61, 61), return_index=True)
    _, _, rows_j = jax.jit(lambda p, v: voxelize_jit(p, voxel_size=v, origin=0.0, spatial_shape=(61, 61, 61),
                                                      capacity=t.capacity, return_index=True))(points, size)
    np.testing.assert_array_equal(np.asarray(rows_j), np.asarray(rows))
    site = np.floor(np.asarray(points) / size)  # numpy's true division, as voxelize's
    np.testing.assert_array_equal(np.asarray(t.coords)[np.asarray(rows), 1:], site)


def test_serialization_ignores_padding_rows_whatever_they_hold():
  x = SparseTensor.from_coords(np.array([[0, 3, 2, 1], [1, 0, 0, 0], [0, 7, 7, 7]]), np.ones((3, 1), np.float32),
                               spatial_shape=(8, 8, 8), batch_size=2, capacity=6)
  x = x.replace(coords=x.coords.at[3:].set(jnp.array([[5, 2**30, -7, 9], [-3, -1, -1, -1], [0, 0, 0, 0]])))
  for order, bits in (("morton", None), ("morton", 11), ("hilbert", None), ("hilbert", 11), ("linear", None)):
    k = np.asarray(jax.jit(lambda x: serialize.serialization_keys(x, order, bits))(x)).reshape(6, -1)
    assert np.all(k[3:] == 2**31 - 1) and np.all((k[:3] >= 0) & (k[:3] < 2**31 - 1))
    _, perm = serialize.sort_by(x, order, bits)
    np.testing.assert_array_equal(np.asarray(perm), [0, 2, 1, 3, 4, 5])  # (batch, key), padding last
