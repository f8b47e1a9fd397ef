"""Tests for pallas_kernels/occupancy_sites.py (strided-convolution output sites from an occupancy map).

CPU: interpret-mode kernels against the numpy reference of tests/test_hash_table.py, hypothesis over geometries
(strided and transposed rules), the dispatch rule, its edges and both sides of it through `pair_map` and
`transpose_map`, and Triton lowering. GPU (``-m gpu``): tests/test_hash_table.py::test_gpu_output_sites_sphere_shell
runs both site searches against the XLA path.
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


_MATCH_CASES = OUTPUT_SITE_CASES + [((41, 16, 14), 2, 300, 320, (3, 1, 1), 2, 0, 1),  # + a LiDAR backbone's last down
                                    ((40, 36, 38), 2, 200, 210, (3, 3, 3), 17, 1, 1)]  # 17^3 classes: one class of all


@pytest.mark.parametrize("case", range(len(_MATCH_CASES)))
def test_occupied_sites_match_numpy(case):
  in_shape, batch, num, capacity, kernel_size, stride, padding, dilation = _MATCH_CASES[case]
  rng = np.random.default_rng(num * 7 + capacity)
  coords = random_points(rng, in_shape, batch, num, capacity, pad="garbage")
  geom = _conv_geometry(kernel_size, stride, padding, dilation, in_shape)
  count = ref_output_sites(coords, num, geom, 0)[2]
  assert count > 0
  # Exact in every case, then (each out_capacity a compilation of its own, so a covering set over the cases rather
  # than every case with each) one of spare rows, too few rows (the smallest keys are kept), one and none: each
  # appears in some case, spare and too few rows in two each. test_occupied_sites_property draws out_capacity
  # anywhere in [0, count + 5] on every geometry.
  for out_capacity in (count, (count + 9, count // 2, 1, 0)[case % 4]):
    _check_against_reference(coords, num, geom, batch, out_capacity)


def test_packed_words_are_the_bytes_bits():
  # Byte b of each group of 32 is bit b of its word: random maps, an all-ones word (bit 31, the sign) and an
  # all-zeros one; the ranks the lookup computes rest on this.
  rng = np.random.default_rng(5)
  occupied = (rng.random((40, 32)) < 0.3).astype(np.int8)
  occupied[3], occupied[7] = 1, 0
  words = np.asarray(occupancy_sites._pack_words(jnp.asarray(occupied.reshape(-1))))
  expect = (occupied.astype(np.int64) << np.arange(32)).sum(axis=1)
  np.testing.assert_array_equal(words.view(np.uint32), expect.astype(np.uint32))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_lanes_serve_exactly_the_offsets_an_input_proposes_at(data):
  # Any offsets (negative, dilated, kernel < stride), strides and paddings per axis, inputs at any position
  # (negative ones included): the class table's offsets for a row are exactly those where (c + padding - d) is
  # a multiple of the stride on every axis, each offset is in one class, and a row needs per_row lanes.
  stride = tuple(data.draw(st.lists(st.integers(1, 20), min_size=3, max_size=3)))
  padding = tuple(data.draw(st.lists(st.integers(0, 4), min_size=3, max_size=3)))
  offsets = tuple(tuple(o) for o in data.draw(st.lists(st.lists(st.integers(-6, 6), min_size=3, max_size=3),
                                                       min_size=1, max_size=30, unique_by=tuple)))
  geom = unique_keys.ProposalGeometry(offsets, stride, padding, (8, 8, 8))
  lanes = occupancy_sites.lanes_for(geom)
  assert len(lanes.table) % lanes.per_row == 0
  classes = np.asarray(lanes.table).reshape(-1, lanes.per_row)
  if np.prod(stride) * unique_keys.proposals_per_site(geom) > occupancy_sites.MAX_CLASS_TABLE:
    # Too many classes for the table: one class, every row runs every offset.
    assert lanes == occupancy_sites.Lanes((1, 1, 1), len(offsets), tuple(range(len(offsets))))
    return
  assert lanes.class_stride == stride and lanes.per_row == unique_keys.proposals_per_site(geom)
  assert sorted(v for v in lanes.table if v >= 0) == list(range(len(offsets)))
  offs = np.asarray(offsets)
  for c in data.draw(st.lists(st.lists(st.integers(-50, 50), min_size=3, max_size=3), min_size=1, max_size=8)):
    shifted = np.asarray(c) + np.asarray(padding) - offs
    proposes = set(np.nonzero(np.all(shifted % np.asarray(stride) == 0, axis=1))[0].tolist())
    r = (np.asarray(c) + np.asarray(padding)) % np.asarray(stride)
    cls = (r[0] * stride[1] + r[1]) * stride[2] + r[2]
    assert set(int(v) for v in classes[cls] if v >= 0) == proposes


@settings(max_examples=12, deadline=None)  # every example's geometry and shapes compile the kernels anew
@given(data=st.data())
def test_occupied_sites_property(data):
  # Any geometry (stride, padding and dilation per axis: anisotropic, kernel < stride, padding > kernel), the
  # strided rule or the transposed convolution's (negated padding and offsets on coordinates scaled by the
  # stride), batch, density, padding-row contents and out_capacity: the numpy reference exactly, and the count
  # of distinct sites whatever out_capacity is.
  from jsparse.sparse_conv import _proposal_geometry, geometry, transpose_geometry

  draw = data.draw
  triple = lambda lo, hi: tuple(draw(st.integers(lo, hi)) for _ in range(3))
  in_shape, kernel_size, stride = triple(1, 9), triple(1, 3), triple(1, 3)
  padding, dilation = triple(0, 3), triple(1, 2)
  transposed = draw(st.booleans())
  try:
    if transposed:
      rule = transpose_geometry(in_shape, kernel_size, stride, padding, 0, dilation).proposal_rule()
    else:
      rule = _proposal_geometry(geometry(in_shape, kernel_size, stride, padding, dilation))
  except ValueError:  # an empty output grid
    return
  batch = draw(st.integers(1, 3))
  sites = batch * int(np.prod(in_shape))
  num = draw(st.integers(0, min(sites, 80)))
  capacity = num + draw(st.integers(0, 8))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  coords = random_points(rng, in_shape, batch, num, capacity, pad=draw(st.sampled_from(["neg1", "garbage", "zero"])))
  if transposed:  # as sparse_conv._transpose_map: the rows scaled by the stride (padding rows too)
    coords = coords * np.asarray((1,) + stride, np.int32)
  count = ref_output_sites(coords, num, rule, 0)[2]
  out_capacity = draw(st.integers(0, count + 5))
  assert _check_against_reference(coords, num, rule, batch, out_capacity) == count


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


def test_zero_fill_cannot_merge_with_another_int32_zero_fill():
  """The int32 zero fill seen as the int8 grid comes through a barrier: XLA merged it with another int32 zero
  array of the same shape into one multi-output fusion of an int32 array and its int8 view, which crashed XLA's GPU
  emitter (the 2:4 fine-tuning probe on an H200). The barrier is what the GPU fix rests on; test_gpu.py runs the
  probe that crashed."""
  shape, cap, batch = (5, 4, 6), 40, 2
  coords = random_points(np.random.default_rng(3), shape, batch, cap, cap, pad="neg1")
  geom = _conv_geometry((3, 3, 3), 2, 1, 1, shape)
  quads = -(-occupancy_sites.grid_sites(geom, batch) // 32) * 8  # the fill's int32 elements

  def f(c, n):
    occ = occupancy_sites.mark_occupancy(c, n, geometry=geom, batch_size=batch, interpret=True)
    return occ.words, jnp.zeros((quads,), jnp.int32) + n

  text = jax.jit(f).lower(jnp.asarray(coords), jnp.int32(cap)).as_text()
  assert text.count("optimization_barrier") == 1


def test_lanes_of_rows_below_the_padding_read_their_class_table_row():
  # Negative offsets with strides above 1 (a rule the module takes, though no jsparse op builds one) and valid
  # rows at positions outside the grid: position + padding is negative for some rows that still propose, so a
  # row's class must be the non-negative residue (lax.rem keeps the sign). The class tests elsewhere only see
  # rows inside the grid and offsets >= 0, where a negative residue never proposes.
  offsets = tuple(tuple(-a * d for a, d in zip(o, (1, 2, 1))) for o in np.ndindex(3, 3, 3))
  geom = unique_keys.ProposalGeometry(offsets, (2, 3, 2), (1, 0, 2), (5, 4, 5))
  rng = np.random.default_rng(8)
  num, capacity, batch = 150, 160, 2
  coords = np.stack([rng.integers(0, batch, capacity)] + [rng.integers(-7, 12, capacity) for _ in range(3)],
                    axis=1).astype(np.int32)
  coords = np.unique(coords[:num], axis=0)
  num = len(coords)
  coords = np.concatenate([coords[rng.permutation(num)], rng.integers(-99, 99, (capacity - num, 4))]).astype(np.int32)
  count = ref_output_sites(coords, num, geom, 0)[2]
  proposes = np.any(ref_output_sites(coords, num, geom, count)[1][:num] >= 0, axis=1)
  below = np.any(coords[:num, 1:] + np.asarray(geom.padding) < 0, axis=1)
  assert np.sum(proposes & below) > 10  # the case under test: rows below the padding that propose
  for out_capacity in (count, count // 2):
    _check_against_reference(coords, num, geom, batch, out_capacity)


def test_rows_with_a_bad_batch_index_propose_nothing():
  # A valid row whose batch index lies outside [0, batch_size) must not address outside the map.
  geom = _conv_geometry((2, 2, 2), 2, 0, 1, (4, 4, 4))
  coords = np.array([[0, 1, 1, 1], [5, 0, 0, 0], [-2, 2, 2, 2], [1, 3, 3, 3]], np.int32)
  count, keys, inv, _ = _occupied(coords, 4, geom, 2, 4)
  assert count == 2
  np.testing.assert_array_equal(keys[:2], [0, 8 + 7])  # (b 0, site 0) and (b 1, site (1, 1, 1)) of 2x2x2
  assert (inv[1:3] == -1).all()


def _sites_of(keys, batch, out_shape):
  """[n, 4] sites of linear keys, -1 rows for BIG (no site)."""
  keys = np.asarray(keys, np.int64)
  filled = keys != unique_keys.BIG
  sites = np.stack(np.unravel_index(np.where(filled, keys, 0), (batch,) + tuple(out_shape)), axis=1)
  return np.where(filled[:, None], sites, -1)


def _search(name, coords, num, geom, batch, out_capacity):
  """(sites [out_capacity, 4], inv [capacity, V]) of one site search, run as sparse_conv runs it."""
  from jsparse.sparse_conv import _compact, _sorted_proposals

  c, n = jnp.asarray(coords), jnp.int32(num)
  if name == "occupancy":
    _, keys, inv, _ = _occupied(coords, num, geom, batch, out_capacity)
    return _sites_of(keys, batch, geom.out_shape), inv
  if name == "xla":
    sites, _, _, inv = _compact(*_sorted_proposals(c, n, geom, batch), geom.out_shape, batch, out_capacity)
    return np.asarray(sites), np.asarray(inv)
  wide = name == "hash_table_wide"  # proposal indices in the table, compared by their sites
  table = unique_keys.dedupe_proposals(c, n, geometry=geom, batch_size=batch, interpret=True, wide_keys=wide)
  out, inv, overflow = unique_keys.output_sites(c, n, table, out_capacity, geometry=geom, batch_size=batch,
                                                interpret=True, wide_keys=wide)
  assert not bool(overflow | table.overflow)
  return (np.asarray(out) if wide else _sites_of(out, batch, geom.out_shape)), np.asarray(inv)


@pytest.mark.parametrize("search", ["occupancy", "hash_table", "hash_table_wide", "xla"])
def test_rows_outside_the_batch_propose_nothing_on_every_search(search):
  # A valid row whose batch index lies outside [0, batch_size) (only a tensor built without from_coords' checks
  # holds one) proposes nothing on every site search, so the searches agree: the occupancy map dropped such rows
  # while the hash table and the sort kept their keys (a batch of -1 keys negatively, EMPTY among them).
  rng = np.random.default_rng(21)
  shape, batch, num, cap = (7, 5, 9), 2, 60, 66
  coords = random_points(rng, shape, batch, num, cap, pad="garbage")
  coords[[3, 17, 40, 59], 0] = [-1, 2, -7, 1000]
  geom = _conv_geometry((3, 3, 3), 2, 1, 1, shape)
  count = ref_output_sites(coords, num, geom, 0, batch_size=batch)[2]
  assert count < ref_output_sites(coords, num, geom, 0)[2]  # those rows would have proposed more sites
  for out_capacity in (count, count + 3, count // 2):
    ref_keys, ref_inv, _ = ref_output_sites(coords, num, geom, out_capacity, batch_size=batch)
    sites, inv = _search(search, coords, num, geom, batch, out_capacity)
    np.testing.assert_array_equal(sites, _sites_of(ref_keys, batch, geom.out_shape))
    np.testing.assert_array_equal(inv, ref_inv)
    assert (inv[[3, 17, 40, 59]] == -1).all()


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
  with pytest.raises(ValueError, match="batch_size"):
    occupancy_sites.mark_occupancy(jnp.zeros((8, 4), jnp.int32), 0, geometry=geom, batch_size=0, interpret=True)
  with pytest.raises(ValueError, match="output grid"):  # 2**31 sites: no int32 byte index
    occupancy_sites.mark_occupancy(jnp.zeros((8, 4), jnp.int32), 0, geometry=geom._replace(out_shape=(2048,) * 3),
                                   batch_size=256, interpret=True)
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


# (capacity, batch, output grid of a k2 s2 convolution, whether occupancy_sites.fits): maps of exactly
# BYTES_PER_ROW bytes a row (96, 288 and 192 sites) and of one site more (97, 289, 193), a grid of one site, up to
# 193 batch items, site counts off a multiple of 32.
_FITS_EDGES = [(1, 1, (4, 4, 6), True), (1, 1, (97, 1, 1), False), (1, 1, (1, 1, 1), True),
               (3, 32, (1, 1, 9), True), (3, 17, (17, 1, 1), False), (2, 64, (1, 1, 3), True),
               (2, 193, (1, 1, 1), False), (4, 5, (3, 3, 5), True)]


@pytest.mark.parametrize("capacity,batch,out_shape,fits", _FITS_EDGES)
def test_pair_map_at_the_edges_of_fits(capacity, batch, out_shape, fits):
  # Just inside and just outside the dispatch rule, with garbage padding rows and one free row: pair_map's
  # Pallas path (either search) gives the XLA path's map, for a counted, a too small and an empty out_capacity.
  import jsparse
  from jsparse.sparse_conv import _proposal_geometry, geometry, pair_map

  in_shape = tuple(2 * n for n in out_shape)
  assert occupancy_sites.fits(capacity, _proposal_geometry(geometry(in_shape, 2, 2)), batch) == fits
  rng = np.random.default_rng(capacity * 1000 + batch)
  for num in {capacity, capacity - 1}:
    coords = random_points(rng, in_shape, batch, num, capacity, pad="garbage")
    x = jsparse.SparseTensor(jnp.asarray(coords), jnp.ones((capacity, 1), jnp.float32), jnp.int32(num), in_shape,
                             batch)
    count = int(pair_map(x, 2, 2, implementation="xla").out_num)
    for out_capacity in (None, max(count - 1, 0), 0):
      got, ref = (pair_map(x, 2, 2, out_capacity=out_capacity, check=False, implementation=impl)
                  for impl in ("pallas", "xla"))
      for name in ("out_coords", "out_num", "nbr", "inv", "overflow"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(ref, name)),
                                      err_msg=f"{name} num={num} out_capacity={out_capacity}")


@pytest.mark.parametrize("spatial_shape,expect_occupancy", [((5, 4, 6), True), ((300, 200, 250), False)])
def test_transpose_map_takes_either_search_and_matches_xla(spatial_shape, expect_occupancy):
  # The general transposed convolution's rule (negated padding and offsets on scaled coordinates) on both sides
  # of the dispatch: small grids take the occupancy map, so only a large sparse grid still reaches the hash table
  # with int32 keys. Exact, and too few rows under jit (the smallest sites and the flag).
  import jsparse
  from jsparse.sparse_conv import transpose_geometry, transpose_map

  rng = np.random.default_rng(8)
  batch, num, cap = 2, 40, 47
  pts = random_points(rng, spatial_shape, batch, num, cap, pad="garbage")
  x = jsparse.SparseTensor(jnp.asarray(pts), jnp.ones((cap, 1), jnp.float32), jnp.int32(num), spatial_shape, batch)
  geo = dict(kernel_size=(3, 2, 3), stride=(2, 1, 3), padding=(1, 0, 2), output_padding=(1, 0, 0), dilation=1)
  rule = transpose_geometry(spatial_shape, **geo).proposal_rule()
  assert jsparse.key_width(batch, rule.out_shape) == 1
  assert occupancy_sites.fits(cap, rule, batch) == expect_occupancy
  count = int(transpose_map(x, out_capacity="exact", implementation="xla", **geo)[1])
  assert count > 100
  for out_capacity in (count, count - count // 3):
    got, ref = (jax.jit(lambda x, impl=impl: transpose_map(x, out_capacity=out_capacity, implementation=impl,
                                                            check=False, **geo))(x) for impl in ("pallas", "xla"))
    for name, a, b in zip(("out_coords", "out_num", "nbr", "inv", "overflow"), got, ref):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)
    assert bool(got[4]) == (out_capacity < count)


def test_triton_lowering():
  from triton_lowering import lower_for_cuda

  geom = _conv_geometry((3, 3, 3), 2, 1, 1, (32, 17, 9))

  def f(c, n):
    occ = occupancy_sites.mark_occupancy(c, n, geometry=geom, batch_size=2)
    return occ.count, *occupancy_sites.occupied_sites(c, n, occ, out_capacity=700, geometry=geom, batch_size=2)

  text = lower_for_cuda(f, jnp.zeros((1000, 4), jnp.int32), jnp.int32(0))
  assert text.count("__gpu$xla.gpu.triton") == 4  # the mark, the two prefix-count passes, the lookup
  for name in ("occupancy_mark", "occupancy_chunk_counts", "occupancy_prefix", "occupancy_lookup"):
    assert name in text
