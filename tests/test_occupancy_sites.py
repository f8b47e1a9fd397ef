"""Tests for pallas_kernels/occupancy_sites.py (strided-convolution output sites from an occupancy map).

CPU: interpret-mode kernels against the numpy reference of tests/test_hash_table.py, hypothesis over geometries,
the dispatch rule and both sides of it through `pair_map`, and Triton lowering. GPU (``-m gpu``):
tests/test_hash_table.py::test_gpu_output_sites_sphere_shell runs both site searches against the XLA path.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import occupancy_sites, unique_keys
from test_hash_table import OUTPUT_SITE_CASES, _conv_geometry, random_points, ref_output_sites


def _occupied(coords, num, geom, batch, out_capacity):
  occ = occupancy_sites.mark_occupancy(jnp.asarray(coords), jnp.int32(num), geometry=geom, batch_size=batch,
                                       interpret=True)
  keys, inv, nbr = occupancy_sites.occupied_sites(jnp.asarray(coords), jnp.int32(num), occ,
                                                  out_capacity=out_capacity, geometry=geom, batch_size=batch,
                                                  interpret=True)
  return int(occ.count), np.asarray(keys), np.asarray(inv), np.asarray(nbr)


def _transpose(inv, rows_out):
  """nbr of an inv map (numpy): nbr[i, v] = j iff inv[j, v] = i."""
  nbr = np.full((rows_out, inv.shape[1]), -1, np.int64)
  j, v = np.nonzero(inv >= 0)
  nbr[inv[j, v], v] = j
  return nbr


def _check_against_reference(coords, num, geom, batch, out_capacity):
  count, keys, inv, nbr = _occupied(coords, num, geom, batch, out_capacity)
  ref_keys, ref_inv, ref_count = ref_output_sites(coords, num, geom, out_capacity)
  assert count == ref_count
  np.testing.assert_array_equal(keys, ref_keys)
  np.testing.assert_array_equal(inv, ref_inv)
  np.testing.assert_array_equal(nbr, _transpose(ref_inv, out_capacity))
  return count


@pytest.mark.parametrize(
    "in_shape,batch,num,capacity,kernel_size,stride,padding,dilation",
    OUTPUT_SITE_CASES + [((41, 16, 14), 2, 300, 320, (3, 1, 1), 2, 0, 1)],  # + a LiDAR backbone's last down
)
def test_occupied_sites_match_numpy(in_shape, batch, num, capacity, kernel_size, stride, padding, dilation):
  rng = np.random.default_rng(num * 7 + capacity)
  coords = random_points(rng, in_shape, batch, num, capacity, pad="garbage")
  geom = _conv_geometry(kernel_size, stride, padding, dilation, in_shape)
  count = ref_output_sites(coords, num, geom, 0)[2]
  assert count > 0
  # Exact, spare, too few rows (the smallest keys are kept), one and none.
  for out_capacity in (count, count + 9, count // 2, 1, 0):
    _check_against_reference(coords, num, geom, batch, out_capacity)


@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_occupied_sites_property(data):
  # Any geometry, batch, density, padding-row contents and out_capacity: the numpy reference exactly, and the
  # count of distinct sites whatever out_capacity is.
  draw = data.draw
  in_shape = tuple(draw(st.integers(1, 9)) for _ in range(3))
  batch = draw(st.integers(1, 3))
  kernel_size = tuple(draw(st.integers(1, 3)) for _ in range(3))
  stride = draw(st.integers(1, 3))
  dilation = draw(st.integers(1, 2))
  padding = draw(st.integers(0, 2))
  geom = _conv_geometry(kernel_size, stride, padding, dilation, in_shape)
  if min(geom.out_shape) < 1:
    return
  sites = batch * int(np.prod(in_shape))
  num = draw(st.integers(0, min(sites, 80)))
  capacity = num + draw(st.integers(0, 8))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  coords = random_points(rng, in_shape, batch, num, capacity, pad=draw(st.sampled_from(["neg1", "garbage", "zero"])))
  count = ref_output_sites(coords, num, geom, 0)[2]
  out_capacity = draw(st.integers(0, count + 5))
  assert _check_against_reference(coords, num, geom, batch, out_capacity) == count


def test_traced_num_compiles_once():
  rng = np.random.default_rng(3)
  shape, cap, batch = (5, 4, 6), 40, 2
  coords = random_points(rng, shape, batch, cap, cap, pad="neg1")
  geom = _conv_geometry((3, 3, 3), 2, 1, 1, shape)

  @jax.jit
  def f(c, n):
    occ = occupancy_sites.mark_occupancy(c, n, geometry=geom, batch_size=batch, interpret=True)
    return occ.count, *occupancy_sites.occupied_sites(c, n, occ, out_capacity=cap, geometry=geom,
                                                      batch_size=batch, interpret=True)

  for num in (0, 17, cap):
    count, keys, inv, nbr = f(jnp.asarray(coords), jnp.int32(num))
    ref_keys, ref_inv, ref_count = ref_output_sites(coords, num, geom, cap)
    assert int(count) == ref_count
    np.testing.assert_array_equal(np.asarray(keys), ref_keys)
    np.testing.assert_array_equal(np.asarray(inv), ref_inv)
    np.testing.assert_array_equal(np.asarray(nbr), _transpose(ref_inv, cap))
  assert f._cache_size() == 1


def test_rows_with_a_bad_batch_index_propose_nothing():
  # A valid row whose batch index lies outside [0, batch_size) must not address outside the map.
  geom = _conv_geometry((2, 2, 2), 2, 0, 1, (4, 4, 4))
  coords = np.array([[0, 1, 1, 1], [5, 0, 0, 0], [-2, 2, 2, 2], [1, 3, 3, 3]], np.int32)
  count, keys, inv, _ = _occupied(coords, 4, geom, 2, 4)
  assert count == 2
  np.testing.assert_array_equal(keys[:2], [0, 8 + 7])  # (b 0, site 0) and (b 1, site (1, 1, 1)) of 2x2x2
  assert (inv[1:3] == -1).all()


def test_fits_rule():
  lidar_down = unique_keys.ProposalGeometry(_conv_geometry((3, 3, 3), 2, 1, 1, (41, 1600, 1408)).offsets,
                                            (2, 2, 2), (1, 1, 1), (21, 800, 704))
  assert occupancy_sites.fits(1_100_000, lidar_down, 4)  # 47M sites: 43 bytes a row
  minkunet_down = unique_keys.ProposalGeometry(_conv_geometry((2, 2, 2), 2, 0, 1, (8,) * 3).offsets, (2, 2, 2),
                                               (0, 0, 0), (20, 800, 704))
  assert occupancy_sites.fits(1_100_000, minkunet_down, 4)  # one proposal a row, still 41 bytes of map a row
  assert not occupancy_sites.fits(100_000, _conv_geometry((3, 3, 3), 2, 1, 1, (1024,) * 3), 1)  # 134M sites
  assert not occupancy_sites.fits(2**28, _conv_geometry((2, 2, 2), 2, 0, 1, (2048,) * 3), 2)  # wide keys
  assert not occupancy_sites.fits(0, _conv_geometry((2, 2, 2), 2, 0, 1, (8,) * 3), 1)  # no rows


def test_bad_arguments():
  geom = _conv_geometry((3, 3, 3), 2, 1, 1, (4, 4, 4))
  with pytest.raises(ValueError, match="coords"):
    occupancy_sites.mark_occupancy(jnp.zeros((8, 3), jnp.int32), 0, geometry=geom, batch_size=1, interpret=True)
  with pytest.raises(ValueError, match="output grid"):
    occupancy_sites.mark_occupancy(jnp.zeros((8, 4), jnp.int32), 0, geometry=geom, batch_size=0, interpret=True)
  occ = occupancy_sites.mark_occupancy(jnp.zeros((8, 4), jnp.int32), 0, geometry=geom, batch_size=1,
                                       interpret=True)
  with pytest.raises(ValueError, match="out_capacity"):
    occupancy_sites.occupied_sites(jnp.zeros((8, 4), jnp.int32), 0, occ, out_capacity=-1, geometry=geom,
                                   batch_size=1, interpret=True)


@pytest.mark.parametrize("spatial_shape,expect_occupancy", [((12, 10, 9), True), ((600, 600, 600), False)])
def test_pair_map_takes_either_search_and_matches_xla(spatial_shape, expect_occupancy):
  # pair_map's Pallas path picks the occupancy map for a small grid and the hash table for a large sparse one;
  # either gives the XLA path's map exactly, under jit, with spare and too few output rows.
  import jsparse
  from jsparse.sparse_conv import _proposal_geometry, geometry, pair_map

  rng = np.random.default_rng(5)
  batch, num, cap = 2, 150, 170
  pts = random_points(rng, spatial_shape, batch, num, num)
  x = jsparse.SparseTensor.from_coords(pts, np.zeros((num, 1), np.float32), spatial_shape, batch, capacity=cap)
  rule = _proposal_geometry(geometry(spatial_shape, (3, 3, 3), (2, 2, 2), (1, 1, 1), (1, 1, 1)))
  assert occupancy_sites.fits(cap, rule, batch) == expect_occupancy
  count = int(pair_map(x, 3, 2, 1, implementation="xla").out_num)
  for out_capacity in (count + 7, count - count // 4):
    got, ref = (jax.jit(lambda x, impl=impl: pair_map(x, 3, 2, 1, out_capacity=out_capacity, check=False,
                                                      implementation=impl))(x) for impl in ("pallas", "xla"))
    for name in ("out_coords", "out_num", "nbr", "inv", "overflow"):
      np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(ref, name)), err_msg=name)


def test_triton_lowering():
  from triton_lowering import lower_for_cuda

  geom = _conv_geometry((3, 3, 3), 2, 1, 1, (32, 17, 9))

  def f(c, n):
    occ = occupancy_sites.mark_occupancy(c, n, geometry=geom, batch_size=2)
    return occ.count, *occupancy_sites.occupied_sites(c, n, occ, out_capacity=700, geometry=geom, batch_size=2)

  text = lower_for_cuda(f, jnp.zeros((1000, 4), jnp.int32), jnp.int32(0))
  assert text.count("__gpu$xla.gpu.triton") == 2
  for name in ("occupancy_mark", "occupancy_lookup"):
    assert name in text
