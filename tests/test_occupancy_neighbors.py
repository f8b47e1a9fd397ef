"""Tests for pallas_kernels/occupancy_neighbors.py (submanifold maps of sites ranked in an occupancy map).

CPU: the interpret-mode kernel and its XLA form against a numpy dictionary of the sites (hypothesis over grids,
offsets, batches, padding rows and occupied sites that are not rows), the rule that picks it in
`build_neighbor_map` (the output of a strided convolution or pool, and nothing else), whole convolutions
through it against the XLA path (values and gradients), and Triton lowering. Rows in any order
(`rows_occupancy`, a network's first level on a dense enough grid): its occupancy and rank-to-row table against
numpy, the map through it, the rule that picks it, and convolutions through it against dense references. GPU
(``-m gpu``): the kernel on the output of a strided convolution of a 1M-site sphere shell against the XLA map,
and a shuffled 1M-site shell's first-level map against the XLA map.
"""
from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import jsparse
from jsparse import neighbors
from jsparse.sparse_conv import pair_map
from pallas_kernels import occupancy_sites
from pallas_kernels import occupancy_neighbors
from pallas_kernels.gemm_plan import MASK_BITS, masked_plan
from pallas_kernels.occupancy_neighbors import (neighbor_map_and_masks, neighbor_map_from_occupancy,
                                                neighbor_map_from_occupancy_reference, rows_occupancy,
                                                rows_occupancy_reference)

_on_gpu = jax.default_backend() == "gpu"


def _occupancy_of_keys(keys, sites: int) -> occupancy_sites.Occupancy:
  """numpy: the packed words and prefix counts of a grid of `sites` sites with `keys` occupied."""
  num_words = -(-sites // 32)
  bits = np.zeros(num_words * 32, np.int64)
  bits[np.asarray(keys, np.int64)] = 1
  words = (bits.reshape(-1, 32) << np.arange(32)).sum(axis=1).astype(np.uint32).view(np.int32)
  per_word = bits.reshape(-1, 32).sum(axis=1)
  prefix = (np.cumsum(per_word) - per_word).astype(np.int32)
  return occupancy_sites.Occupancy(jnp.asarray(words), jnp.asarray(prefix), jnp.int32(len(keys)))


def _ranked_sites(rng, shape, batch, occupied, num, capacity, pad):
  """(coords [capacity, 4], occupancy): `occupied` distinct random sites, the `num` smallest-keyed as rows in key
  order (the rest occupied but not rows, as after an out_capacity overflow), then padding rows."""
  X, Y, Z = shape
  keys = np.sort(rng.choice(batch * X * Y * Z, size=occupied, replace=False))
  coords = np.empty((capacity, 4), np.int32)
  b, r = np.divmod(keys[:num], X * Y * Z)
  x, r = np.divmod(r, Y * Z)
  y, z = np.divmod(r, Z)
  coords[:num] = np.stack([b, x, y, z], axis=1)
  coords[num:] = -1 if pad == "neg1" else rng.integers(-9, 9 + max(shape), size=(capacity - num, 4))
  if pad == "copies" and capacity > num > 0:
    coords[num:] = coords[rng.integers(0, num, capacity - num)]  # copies of valid rows: must stay ignored
  return coords, _occupancy_of_keys(keys, batch * X * Y * Z)


def _numpy_map(coords, num, shape, offsets):
  """The submanifold map of rows < num by a dictionary of their sites."""
  row_of = {tuple(c): i for i, c in enumerate(coords[:num].tolist())}
  nbr = np.full((len(coords), len(offsets)), -1, np.int64)
  for i in range(num):
    b, *p = coords[i].tolist()
    for v, d in enumerate(offsets):
      q = [a + e for a, e in zip(p, d)]
      if all(0 <= a < n for a, n in zip(q, shape)):
        nbr[i, v] = row_of.get((b, *q), -1)
  return nbr


def _offsets(kernel_size, dilation=(1, 1, 1)):
  return tuple(tuple((i - k // 2) * d for i, k, d in zip(idx, kernel_size, dilation))
               for idx in itertools.product(*(range(k) for k in kernel_size)))


# The XLA reference jitted: one program per geometry instead of its ~25 ops compiled one by one (eager, each
# hypothesis example's shapes cost ~1.6 s of compiling; the kernel itself ~0.4 s). The same integer ops either way.
_reference = jax.jit(neighbor_map_from_occupancy_reference, static_argnames=("spatial_shape", "batch_size", "offsets"))


def _expected_masks(nbr) -> np.ndarray:
  """int32 [capacity]: each row's neighbour bitmask over its first MASK_BITS offsets (as the plan's sort reads)."""
  bits = min(nbr.shape[1], MASK_BITS)
  return ((nbr[:, :bits] >= 0).astype(np.int64) << np.arange(bits)).sum(axis=1).astype(np.uint32).view(np.int32)


def _both(coords, num, occ, shape, batch, offsets):
  """The kernel's map (its row masks checked against the map) and the XLA form's."""
  kwargs = dict(spatial_shape=shape, batch_size=batch, offsets=offsets)
  got, masks = neighbor_map_and_masks(jnp.asarray(coords), jnp.int32(num), occ, interpret=True, **kwargs)
  ref = _reference(jnp.asarray(coords), jnp.int32(num), occ, **kwargs)
  np.testing.assert_array_equal(masks, _expected_masks(np.asarray(got)))
  return np.asarray(got), np.asarray(ref)


@pytest.mark.parametrize("shape,batch,occupied,num,capacity,kernel_size,dilation,pad", [
    ((7, 6, 9), 2, 150, 150, 170, (3, 3, 3), (1, 1, 1), "garbage"),
    ((12, 10, 5), 3, 300, 260, 300, (3, 3, 3), (2, 1, 1), "copies"),  # 40 occupied sites are not rows
    ((9, 9, 9), 1, 90, 90, 90, (5, 1, 3), (1, 1, 1), "neg1"),  # anisotropic kernel, no padding rows
    ((4, 33, 2), 2, 100, 60, 64, (1, 3, 1), (1, 3, 1), "garbage"),  # a word boundary inside a y-column
])
def test_map_matches_numpy(shape, batch, occupied, num, capacity, kernel_size, dilation, pad):
  rng = np.random.default_rng(occupied * 3 + num)
  coords, occ = _ranked_sites(rng, shape, batch, occupied, num, capacity, pad)
  offsets = _offsets(kernel_size, dilation)
  got, ref = _both(coords, num, occ, shape, batch, offsets)
  expect = _numpy_map(coords, num, shape, offsets)
  assert (expect >= 0).sum() > num  # real neighbours besides the centres
  np.testing.assert_array_equal(got, expect)
  np.testing.assert_array_equal(ref, expect)


def _draw_grid(draw):
  """(shape, batch, offsets) for the property tests: grids of 1-12 per axis (a 32-site word spanning several rows,
  or one row spanning several words), 1-3 items, 1-12 offsets (negative, repeated, past the grid)."""
  shape = tuple(draw(st.integers(1, 12)) for _ in range(3))
  batch = draw(st.integers(1, 3))
  offsets = tuple(tuple(o) for o in draw(st.lists(st.lists(st.integers(-4, 4), min_size=3, max_size=3),
                                                  min_size=1, max_size=12)))
  return shape, batch, offsets


@settings(max_examples=15, deadline=None)  # every example's shapes compile the kernel anew
@given(data=st.data())
def test_map_property(data):
  # Any grid (a 32-site word spanning several rows, or one row spanning several words), batch, density, offsets
  # (negative, repeated, past the grid), rows beyond num, and a traced num: the dictionary map exactly.
  draw = data.draw
  shape, batch, offsets = _draw_grid(draw)
  sites = batch * int(np.prod(shape))
  occupied = draw(st.integers(0, min(sites, 120)))
  num = draw(st.integers(0, occupied))
  capacity = num + draw(st.integers(0, 6))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  coords, occ = _ranked_sites(rng, shape, batch, occupied, num, capacity,
                              draw(st.sampled_from(["neg1", "garbage", "copies"])))
  got, ref = _both(coords, num, occ, shape, batch, offsets)
  expect = _numpy_map(coords, num, shape, offsets)
  np.testing.assert_array_equal(got, expect)
  np.testing.assert_array_equal(ref, expect)


def test_rows_with_a_bad_batch_index_read_nothing():
  # A valid row outside the batch (only a tensor built without from_coords' checks holds one) must not address
  # outside the words; it gets no neighbours.
  shape, batch = (4, 4, 4), 2
  coords, occ = _ranked_sites(np.random.default_rng(1), shape, batch, 40, 40, 42, "neg1")
  coords[5] = (2, 1, 1, 1)
  coords[6] = (-1, 0, 0, 0)
  got, ref = _both(coords, 40, occ, shape, batch, _offsets((3, 3, 3)))
  assert (got[5:7] == -1).all() and (ref[5:7] == -1).all()


def test_checks_name_the_argument():
  coords, occ = _ranked_sites(np.random.default_rng(2), (4, 4, 4), 1, 10, 10, 10, "neg1")
  with pytest.raises(ValueError, match="occupancy must hold 4 words"):
    neighbor_map_from_occupancy(coords, 10, occ, spatial_shape=(8, 4, 4), batch_size=1, offsets=((0, 0, 0),))
  with pytest.raises(ValueError, match="coords must be"):
    neighbor_map_from_occupancy(coords[:, :3], 10, occ, spatial_shape=(4, 4, 4), batch_size=1,
                                offsets=((0, 0, 0),))


def _strided_output(rng, shape, batch, num, capacity, out_capacity=None, implementation="pallas"):
  pts = rng.choice(batch * int(np.prod(shape)), size=num, replace=False)
  sites = np.stack(np.unravel_index(pts, (batch,) + shape), axis=1).astype(np.int32)
  x = jsparse.SparseTensor.from_coords(sites, rng.standard_normal((num, 3)).astype(np.float32), shape, batch,
                                       capacity=capacity)
  pm = pair_map(x, 3, 2, 1, out_capacity=out_capacity, implementation=implementation, check=False)
  return x, pm, pm.output(jnp.zeros((pm.out_capacity, 3), jnp.float32), x)


def _both_maps(y, kernel_size, dilation):
  """y's submanifold map by the Pallas dispatch and by XLA, each jitted with y as a constant (its arrays keep
  their identity, so the occupancy rule applies) and returning the map alone, so the plans are not built."""
  def build(impl):
    return np.asarray(jax.jit(lambda: neighbors.build_neighbor_map(
        y, kernel_size, dilation, jsparse.dispatch.resolve(impl)).nbr)())
  return build("pallas"), build("xla")


def test_strided_output_reads_its_occupancy():
  # The Pallas search of a small grid ranks its output sites in an occupancy map; the submanifold map on the
  # output reads it (no hash table), equal to the XLA map, also when out_capacity dropped sites (the dropped
  # ones are occupied but no rows) and with spare rows. Each map is two compilations: the counted output takes
  # both kernels, the other two one each (a covering set of out_capacity x kernel).
  rng = np.random.default_rng(3)
  kernels = (((3, 3, 3), (1, 1, 1)), ((3, 1, 5), (1, 2, 1)))
  for out_capacity, kernels_here in ((None, kernels), (50, kernels[1:]), (400, kernels[:1])):
    x, pm, y = _strided_output(rng, (14, 11, 9), 2, 300, 320, out_capacity)
    assert pm.occupancy is not None and neighbors._ranking_occupancy(y) is pm.occupancy
    for ks, dil in kernels_here:
      got, want = _both_maps(y, ks, dil)
      np.testing.assert_array_equal(got, want)
  # It queries the search's occupancy: no second one built from the rows (mark, rank), nor a hash table.
  names = _pallas_kernel_names(lambda: neighbors.build_neighbor_map(
      y, (3, 3, 3), (1, 1, 1), jsparse.dispatch.resolve("pallas")).nbr)
  assert names == {"occupancy_query"}, names


def test_only_the_ranked_coordinates_read_the_occupancy():
  # The XLA search keeps no occupancy; a tensor whose coordinates are not the map's output (another array, even
  # of equal values) or whose grid differs does not read it.
  rng = np.random.default_rng(4)
  _, pm_xla, y_xla = _strided_output(rng, (10, 10, 10), 1, 200, 200, implementation="xla")
  assert pm_xla.occupancy is None and neighbors._ranking_occupancy(y_xla) is None
  _, pm, y = _strided_output(rng, (10, 10, 10), 1, 200, 200)
  assert neighbors._ranking_occupancy(y.replace(coords=y.coords + 0)) is None
  assert neighbors._ranking_occupancy(jsparse.SparseTensor(y.coords, y.feats, y.num, (5, 5, 6), 1, y.caches)) is None
  assert neighbors._ranking_occupancy(y) is pm.occupancy


def test_pool_and_2d_outputs_read_their_occupancy():
  # Pools build their output through the same pair map, and a 2D convolution runs on the lifted 3D grid (leading
  # extent 1): both outputs read the occupancy map, and their maps (dilated, anisotropic) equal the XLA maps.
  # Each map is two compilations: the 2D output takes both kernels, each pool one (a covering set).
  rng = np.random.default_rng(7)
  sites = np.argwhere(rng.random((2, 9, 8, 7)) < 0.25).astype(np.int32)
  x = jsparse.SparseTensor.from_coords(sites, np.ones((len(sites), 1), np.float32), (9, 8, 7), 2)
  pts = np.argwhere(rng.random((2, 13, 11)) < 0.3).astype(np.int32)
  x2 = jsparse.SparseTensor.from_coords(pts, np.ones((len(pts), 2), np.float32), (13, 11), 2)
  w2 = jnp.ones((3, 2, 2, 2), jnp.float32)
  kernels = (((3, 3, 3), (1, 1, 1)), ((1, 5, 3), (1, 2, 3)))
  outputs = [(jsparse.sparse_max_pool3d(x, 2, implementation="pallas"), kernels[:1]),
             (jsparse.sparse_avg_pool3d(x, (3, 1, 2), (2, 1, 2), (1, 0, 0), implementation="pallas"), kernels[1:]),
             (jsparse.sparse_conv2d(x2, w2, stride=(2, 1), padding=(1, 0), implementation="pallas"), kernels)]
  for y, kernels_here in outputs:
    assert neighbors._ranking_occupancy(y) is not None
    for ks, dil in kernels_here:
      got, want = _both_maps(y, ks, dil)
      np.testing.assert_array_equal(got, want)
      assert int(np.sum(want >= 0)) > int(y.num)  # real neighbours besides the centres


def test_downsampled_network_matches_xla():
  # sparse_conv3d (the occupancy search) then two submconv3d on its output (the occupancy map) then the inverse
  # convolution, under jit: values and every gradient equal the XLA path's.
  rng = np.random.default_rng(5)
  shape, batch, num = (12, 10, 8), 2, 260
  pts = rng.choice(batch * int(np.prod(shape)), size=num, replace=False)
  sites = np.stack(np.unravel_index(pts, (batch,) + shape), axis=1).astype(np.int32)
  x = jsparse.SparseTensor.from_coords(sites, rng.standard_normal((num, 4)).astype(np.float32), shape, batch,
                                       capacity=272)
  w_down, w1, w2, w_up = (jnp.asarray(rng.standard_normal(s) * 0.3, jnp.float32)
                          for s in ((3, 3, 3, 4, 8), (3, 3, 3, 8, 8), (3, 3, 3, 8, 8), (3, 3, 3, 8, 4)))

  def loss(feats, weights, impl):
    wd, a, b, wu = weights
    xi = x.replace(feats=feats)
    y = jsparse.sparse_conv3d(xi, wd, stride=2, padding=1, out_capacity=200, implementation=impl,
                              precision="highest")
    assert (neighbors._ranking_occupancy(y) is not None) == (impl == "pallas")  # the path under test
    y = jsparse.submconv3d(y, a, implementation=impl, precision="highest")
    y = y.replace(feats=jnp.tanh(y.feats))
    y = jsparse.submconv3d(y, b, implementation=impl, precision="highest")
    out = jsparse.sparse_inverse_conv3d(y, wu, like=xi, stride=2, padding=1, implementation=impl,
                                        precision="highest")
    return jnp.sum(out.feats * jnp.cos(out.feats)), out.feats

  weights = (w_down, w1, w2, w_up)
  results = {}
  for impl in ("xla", "pallas"):
    f = jax.jit(jax.value_and_grad(lambda f_, w_: loss(f_, w_, impl), argnums=(0, 1), has_aux=True))
    results[impl] = f(x.feats, weights)
  (lx, fx), gx = results["xla"]
  (lp, fp), gp = results["pallas"]
  # float32 sums in another order: a wrong map entry would move these by O(1), rounding by ~1e-6.
  rel = lambda a, b: float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))
  assert rel(fp, fx) < 1e-5 and abs(float(lp) - float(lx)) <= 1e-5 * abs(float(lx))
  for a, b in zip(jax.tree.leaves(gp), jax.tree.leaves(gx)):
    assert rel(a, b) < 1e-5


def test_triton_lowering():
  from triton_lowering import lower_for_cuda

  text = lower_for_cuda(
      lambda c, n, words, prefix: neighbor_map_from_occupancy(
          c, n, occupancy_sites.Occupancy(words, prefix, n), spatial_shape=(8, 12, 8), batch_size=2,
          offsets=_offsets((3, 3, 3))),
      jnp.zeros((1000, 4), jnp.int32), jnp.int32(0), jnp.zeros((48,), jnp.int32), jnp.zeros((48,), jnp.int32))
  assert text.count("__gpu$xla.gpu.triton") == 1 and "occupancy_query" in text


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu, reason="needs a CUDA GPU")
@pytest.mark.parametrize("kernel_size,dilation", [((3, 3, 3), (1, 1, 1)), ((5, 5, 5), (1, 1, 1)),
                                                  ((3, 3, 3), (2, 2, 2))])
def test_gpu_map_of_a_strided_output_matches_xla(kernel_size, dilation):
  # A RES 512 sphere shell (1M sites, two items) downsampled by a k3 s2 convolution (the occupancy search), and
  # out_capacity a third short (sites occupied but dropped): the kernel's map equals the XLA map.
  check_map_of_a_strided_output(512, kernel_size, dilation)


@pytest.mark.parametrize("kernel_size,dilation", [((3, 3, 3), (1, 1, 1)), ((3, 3, 3), (2, 2, 2))])
def test_map_of_a_strided_output_matches_xla_interpret(kernel_size, dilation):
  # The GPU test's body on a small shell, so the test itself runs on every machine.
  check_map_of_a_strided_output(16, kernel_size, dilation)


def check_map_of_a_strided_output(res, kernel_size, dilation):
  from benchmarks.workloads import sphere_shell_coords

  pts = sphere_shell_coords(res, 2)
  rng = np.random.default_rng(6)
  pts = pts[rng.permutation(len(pts))]
  x = jsparse.SparseTensor.from_coords(pts, np.zeros((len(pts), 1), np.float32), (res,) * 3, 2,
                                       capacity=len(pts) + 100)
  count = int(pair_map(x, 3, 2, 1, implementation="xla").out_num)
  for out_capacity in (count + 1000, count - count // 3):
    def maps(x):  # in one program: the output's coordinates are then the map's own array
      pm = pair_map(x, 3, 2, 1, out_capacity=out_capacity, implementation="pallas", check=False)
      y = pm.output(jnp.zeros((pm.out_capacity, 1), jnp.float32), x)
      assert neighbors._ranking_occupancy(y) is pm.occupancy is not None
      return (neighbors.build_neighbor_map(y, kernel_size, dilation, jsparse.dispatch.resolve("pallas")).nbr,
              neighbors.build_neighbor_map(y, kernel_size, dilation, jsparse.dispatch.resolve("xla")).nbr,
              pm.out_num)
    got, want, out_num = jax.jit(maps)(x)
    got, want = np.asarray(got), np.asarray(want)
    mism = np.argwhere(got != want)
    assert mism.size == 0, f"{len(mism)} mismatches, first {mism[:5].tolist()}"
    assert (want >= 0).sum() > 5 * int(out_num)


# ---------------------------------------------------------------------------------------------------------------
# Rows in any order: rows_occupancy (the rows' own sites marked, each stored at its rank) and the map through it
# ---------------------------------------------------------------------------------------------------------------


def _unordered_rows(rng, shape, batch, num, capacity, pad, strays=0):
  """coords [capacity, 4]: `num` distinct random sites in random order (`strays` of them then moved outside the
  grid or the batch, as only a directly built tensor holds them), then padding rows."""
  X, Y, Z = shape
  keys = rng.choice(batch * X * Y * Z, size=num, replace=False)
  coords = np.empty((capacity, 4), np.int32)
  coords[:num] = np.stack(np.unravel_index(keys, (batch, X, Y, Z)), axis=1)
  for i in rng.choice(num, size=min(strays, num), replace=False):
    axis = rng.integers(0, 4)
    coords[i, axis] = -1 - rng.integers(0, 3) if rng.random() < 0.5 else (batch, X, Y, Z)[axis] + rng.integers(0, 3)
  coords[num:] = -1 if pad == "neg1" else rng.integers(-9, 9 + max(shape), size=(capacity - num, 4))
  if pad == "copies" and capacity > num > 0:
    coords[num:] = coords[rng.integers(0, num, capacity - num)]
  return coords


def _inside(coords, shape, batch):
  return np.all((coords >= 0) & (coords < np.asarray((batch,) + tuple(shape))), axis=1)


def _check_rows_occupancy(coords, num, shape, batch, offsets):
  """rows_occupancy (interpret) and its XLA form against numpy, then the map through it against the dictionary
  map of the in-grid rows (a valid row outside the grid is padding: no neighbours, nobody's neighbour)."""
  c, n = jnp.asarray(coords), jnp.int32(num)
  occ, rows = rows_occupancy(c, n, spatial_shape=shape, batch_size=batch, interpret=True)
  ref_occ, ref_rows = rows_occupancy_reference(c, n, spatial_shape=shape, batch_size=batch)
  inside = _inside(coords[:num], shape, batch)
  keys = np.ravel_multi_index(tuple(coords[:num][inside].T), (batch,) + tuple(shape))
  expect_occ = _occupancy_of_keys(keys, batch * int(np.prod(shape)))
  expect_rows = np.flatnonzero(inside)[np.argsort(keys)]
  for got in (occ, ref_occ):
    np.testing.assert_array_equal(got.words, expect_occ.words)
    np.testing.assert_array_equal(got.prefix, expect_occ.prefix)
    assert int(got.count) == len(keys)
  np.testing.assert_array_equal(np.asarray(rows)[:len(keys)], expect_rows)
  np.testing.assert_array_equal(np.asarray(ref_rows)[:len(keys)], expect_rows)
  kwargs = dict(spatial_shape=shape, batch_size=batch, offsets=offsets)
  got, masks = neighbor_map_and_masks(c, n, occ, rows_by_rank=rows, interpret=True, **kwargs)
  ref = neighbor_map_from_occupancy_reference(c, n, occ, rows_by_rank=rows, **kwargs)
  np.testing.assert_array_equal(masks, _expected_masks(np.asarray(got)))
  kept = coords.copy()
  kept[:num][~inside] = (-1, 0, 0, -1)  # keyed as padding, as build_neighbor_map hands them over
  expect = _numpy_map(kept, num, shape, offsets)
  expect[:num][~inside] = -1
  np.testing.assert_array_equal(np.asarray(got), expect)
  np.testing.assert_array_equal(np.asarray(ref), expect)
  return expect


@pytest.mark.parametrize("shape,batch,num,capacity,kernel_size,dilation,pad,strays", [
    ((7, 6, 9), 2, 150, 170, (3, 3, 3), (1, 1, 1), "garbage", 0),
    ((12, 10, 5), 3, 260, 300, (3, 3, 3), (2, 1, 1), "copies", 5),
    ((9, 9, 9), 1, 90, 90, (5, 1, 3), (1, 1, 1), "neg1", 3),  # anisotropic kernel, no padding rows
    ((4, 33, 2), 2, 60, 64, (1, 3, 1), (1, 3, 1), "garbage", 0),  # a word boundary inside a y-column
])
def test_rows_in_any_order_match_numpy(shape, batch, num, capacity, kernel_size, dilation, pad, strays):
  rng = np.random.default_rng(num * 7 + capacity)
  coords = _unordered_rows(rng, shape, batch, num, capacity, pad, strays)
  expect = _check_rows_occupancy(coords, num, shape, batch, _offsets(kernel_size, dilation))
  assert (expect >= 0).sum() > num - strays  # real neighbours besides the centres


def test_rows_just_outside_the_grid_are_padding():
  # A nearly full grid with valid rows one site past each edge (-1 and the extent on the batch and on each axis):
  # such a row's own key aliases an in-grid site (or lies outside the words), and its shifted sites reach occupied
  # in-grid sites. It marks and ranks nothing, gets no neighbours (kernel and XLA form) and is nobody's neighbour.
  # So do padding rows at free in-grid sites.
  rng = np.random.default_rng(16)
  shape, batch, num = (4, 5, 6), 2, 220
  coords = _unordered_rows(rng, shape, batch, num, num + 4, "garbage")
  for j, (axis, past) in enumerate(itertools.product(range(4), (False, True))):
    coords[j, axis] = ((batch,) + shape)[axis] if past else -1
  # Padding rows at free in-grid sites: marked, they would add bits (and ranks) of their own.
  free = np.setdiff1d(np.arange(batch * int(np.prod(shape))), np.ravel_multi_index(tuple(coords[8:num].T),
                                                                                     (batch,) + shape))
  coords[num:] = np.stack(np.unravel_index(free[:4], (batch,) + shape), axis=1)
  expect = _check_rows_occupancy(coords, num, shape, batch, _offsets((3, 3, 3)))
  assert (expect[:8] == -1).all() and (expect[8:num] >= 0).sum() > 10 * num


def test_plan_from_the_kernels_masks_equals_the_plan_from_the_map():
  # The masked plan sorting by the query kernel's row masks is the plan built from the map alone (V 27, and V 125,
  # where only the first MASK_BITS offsets key the sort), with padding rows; and a nearly full grid, whose rows'
  # masks often differ in one bit only (offset 0's: every bit of the key orders rows).
  rng = np.random.default_rng(14)
  for kernel_size, block_m, num in (((3, 3, 3), 16, 300), ((5, 5, 5), 32, 300), ((3, 3, 3), 16, 950)):
    coords = _unordered_rows(rng, (9, 8, 7), 2, num, num + 30, "garbage")
    c, n = jnp.asarray(coords), jnp.int32(num)
    occ, rows = rows_occupancy(c, n, spatial_shape=(9, 8, 7), batch_size=2, interpret=True)
    nbr, masks = neighbor_map_and_masks(c, n, occ, spatial_shape=(9, 8, 7), batch_size=2,
                                        offsets=_offsets(kernel_size), rows_by_rank=rows, interpret=True)
    with_masks = masked_plan(nbr, n, block_m, row_masks=masks, interpret=True).comparable()
    from_map = masked_plan(nbr, n, block_m, interpret=True).comparable()
    for a, b in zip(with_masks, from_map):
      np.testing.assert_array_equal(a, b)
    assert int(jnp.sum(from_map.block_counts)) < from_map.block_counts.shape[0] * nbr.shape[1]  # blocks skip offsets
  with pytest.raises(ValueError, match="row_masks must have shape"):
    masked_plan(nbr, n, 16, row_masks=masks[:-1], interpret=True)


@settings(max_examples=15, deadline=None)  # every example's shapes compile the kernels anew
@given(data=st.data())
def test_rows_in_any_order_property(data):
  # Any grid, batch, density, offsets, row order, padding, rows outside the grid or the batch, and empty tensors:
  # the occupancy, the rank-to-row table and the map are numpy's exactly.
  draw = data.draw
  shape, batch, offsets = _draw_grid(draw)
  num = draw(st.integers(0, min(batch * int(np.prod(shape)), 120)))
  capacity = max(1, num + draw(st.integers(0, 6)))
  rng = np.random.default_rng(draw(st.integers(0, 2**31)))
  coords = _unordered_rows(rng, shape, batch, num, capacity, draw(st.sampled_from(["neg1", "garbage", "copies"])),
                           draw(st.integers(0, 3)))
  _check_rows_occupancy(coords, num, shape, batch, offsets)


def test_rows_fit_rule():
  # At most BYTES_PER_OFFSET bytes of words and prefix counts (a quarter of a byte per site) per row and offset,
  # and int32 keys: a 512^3 sphere shell (1M rows) and a 1M-site LiDAR batch of four 41 x 1600 x 1408 grids fit a
  # 3^3 map; 110k rows on one such grid fit too (SECOND's small input has 125k), 100k do not; nor does a 2**31-site
  # grid.
  sites_per_row = 4 * occupancy_neighbors.BYTES_PER_OFFSET * 27
  assert occupancy_neighbors.rows_fit(1_026_536, 27, (512,) * 3, 1)
  assert occupancy_neighbors.rows_fit(1_000_000, 27, (41, 1600, 1408), 4)
  assert occupancy_neighbors.rows_fit(110_000, 27, (41, 1600, 1408), 1)
  assert not occupancy_neighbors.rows_fit(100_000, 27, (41, 1600, 1408), 1)
  assert occupancy_neighbors.rows_fit(1000, 27, (60,) * 3, 1) == (60**3 <= sites_per_row * 1000)
  assert not occupancy_neighbors.rows_fit(2**26, 27, (2048, 1024, 1024), 1)
  assert occupancy_neighbors.rows_fit(1024, 1, (32,) * 3, 1) and not occupancy_neighbors.rows_fit(1023, 1, (32,) * 3, 1)
  with pytest.raises(ValueError, match="rows_by_rank must have shape"):
    neighbor_map_from_occupancy(jnp.zeros((8, 4), jnp.int32), 0, occupancy_sites.Occupancy(
        jnp.zeros((2,), jnp.int32), jnp.zeros((2,), jnp.int32), jnp.int32(0)), spatial_shape=(4, 4, 4), batch_size=1,
        offsets=((0, 0, 0),), rows_by_rank=jnp.zeros((7,), jnp.int32), interpret=True)


def _pallas_kernel_names(fn, *args):
  """The names of the Pallas kernels in fn's jaxpr (interpret mode keeps them as pallas_call equations)."""
  text = str(jax.make_jaxpr(fn)(*args))
  return {name for name in ("occupancy_mark_bits", "occupancy_rank_rows", "occupancy_query", "hash_build",
                            "hash_query")
          if name in text}


def test_first_level_map_picks_the_occupancy_where_the_grid_is_dense_enough():
  # A shuffled tensor on a 16^3 grid (the occupancy: no hash table) and the same rows on a 16 x 16 x 65536 grid
  # (too sparse: the hash table): both maps equal the XLA map, under jit, with padding rows.
  rng = np.random.default_rng(11)
  for shape, path in (((16, 16, 16), "occupancy_rank_rows"), ((16, 16, 2**16), "hash_query")):
    coords = _unordered_rows(rng, (16, 16, 16), 2, 700, 720, "garbage")[:700]
    x = jsparse.SparseTensor.from_coords(coords, np.ones((700, 2), np.float32), shape, 2, capacity=720)
    build = lambda impl: (lambda t: neighbors.build_neighbor_map(  # noqa: E731
        t, (3, 3, 3), (1, 1, 1), jsparse.dispatch.resolve(impl)).nbr)
    names = _pallas_kernel_names(build("pallas"), x)
    assert path in names and ({"hash_query", "occupancy_rank_rows"} - {path}).isdisjoint(names), names
    np.testing.assert_array_equal(jax.jit(build("pallas"))(x), jax.jit(build("xla"))(x))


@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-5), (jnp.float16, 2e-2)])
def test_first_level_convolution_matches_dense(dtype, tol):
  # submconv3d on shuffled rows through the rows' occupancy (Pallas, interpret) against lax.conv_general_dilated
  # on todense(): values and the input and weight gradients, float32 and float16.
  from jax import lax

  rng = np.random.default_rng(12)
  shape, batch, num = (9, 8, 7), 2, 300
  coords = _unordered_rows(rng, shape, batch, num, num, "neg1")
  feats = jnp.asarray(rng.standard_normal((num, 4)), dtype)
  x = jsparse.SparseTensor.from_coords(coords, feats, shape, batch, capacity=num + 12)
  assert occupancy_neighbors.rows_fit(x.capacity, 27, shape, batch)
  weight = jnp.asarray(rng.standard_normal((3, 3, 3, 4, 5)) * 0.2, dtype)
  cot = jnp.asarray(rng.standard_normal((x.capacity, 5)), jnp.float32)
  sites = tuple(np.asarray(x.coords[:num]).T)

  def sparse_loss(f, w):
    y = jsparse.submconv3d(x.replace(feats=f), w, implementation="pallas")
    return jnp.sum(y.feats[:num].astype(jnp.float32) * cot[:num]), y.feats[:num]

  def dense_loss(f, w):
    d = x.replace(feats=f).todense().astype(jnp.float32)
    y = lax.conv_general_dilated(d, w.astype(jnp.float32), (1, 1, 1), "SAME",
                                 dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), precision="highest")
    return jnp.sum(y[sites] * cot[:num]), y[sites]

  (_, got), g_got = jax.jit(jax.value_and_grad(sparse_loss, argnums=(0, 1), has_aux=True))(x.feats, weight)
  (_, want), g_want = jax.value_and_grad(dense_loss, argnums=(0, 1), has_aux=True)(x.feats, weight)
  scale = float(jnp.max(jnp.abs(want)))
  np.testing.assert_allclose(np.asarray(got, np.float32), want, atol=tol * scale, rtol=tol)
  for a, b in zip(g_got, g_want):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    np.testing.assert_allclose(a, b, atol=tol * float(np.max(np.abs(b))), rtol=tol)


def test_rows_occupancy_triton_lowering():
  from triton_lowering import lower_for_cuda

  def first_level(c, n):
    occ, rows = rows_occupancy(c, n, spatial_shape=(8, 12, 8), batch_size=2)
    return neighbor_map_from_occupancy(c, n, occ, spatial_shape=(8, 12, 8), batch_size=2, offsets=_offsets((3, 3, 3)),
                                       rows_by_rank=rows)

  text = lower_for_cuda(first_level, jnp.zeros((1000, 4), jnp.int32), jnp.int32(0))
  assert text.count("__gpu$xla.gpu.triton") == 5
  assert all(name in text for name in ("occupancy_mark_bits", "occupancy_chunk_counts", "occupancy_prefix",
                                       "occupancy_rank_rows", "occupancy_query"))


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu, reason="needs a CUDA GPU")
@pytest.mark.parametrize("res", [64, 512])
def test_gpu_first_level_map_of_a_shuffled_shell_matches_xla(res):
  # A sphere shell (1M sites at RES 512, two items) in random order with spare rows: the map through the rows'
  # occupancy (atomic_or marks on the GPU) equals the XLA map, the rule picked the occupancy, and the forward plan
  # built from the kernel's row masks is the plan of the map.
  from benchmarks.workloads import sphere_shell_coords

  pts = sphere_shell_coords(res, 2)
  pts = pts[np.random.default_rng(13).permutation(len(pts))]
  x = jsparse.SparseTensor.from_coords(pts, np.zeros((len(pts), 1), np.float32), (res,) * 3, 2,
                                       capacity=len(pts) + 100)
  assert occupancy_neighbors.rows_fit(x.capacity, 27, x.spatial_shape, 2)
  block_m = 128

  def maps(t):
    cache = neighbors.build_neighbor_map(t, (3, 3, 3), (1, 1, 1), jsparse.dispatch.resolve("pallas"), (block_m,))
    want = neighbors.build_neighbor_map(t, (3, 3, 3), (1, 1, 1), jsparse.dispatch.resolve("xla")).nbr
    return cache.nbr, cache.plans[block_m].comparable(), want

  assert "occupancy_rank_rows" in jax.jit(maps).lower(x).as_text()
  got, plan, want = jax.jit(maps)(x)
  mism = np.argwhere(np.asarray(got) != np.asarray(want))
  assert mism.size == 0, f"{len(mism)} mismatches, first {mism[:5].tolist()}"
  # The plan sorted by the query kernel's row masks is the plan of the map itself.
  for a, b in zip(plan, masked_plan(got, x.num, block_m).comparable()):
    np.testing.assert_array_equal(a, b)
