"""Tests for pallas_kernels/occupancy_neighbors.py (submanifold maps of sites ranked in an occupancy map).

CPU: the interpret-mode kernel and its XLA form against a numpy dictionary of the sites (hypothesis over grids,
offsets, batches, padding rows and occupied sites that are not rows), the rule that picks it in
`build_neighbor_map` (the output of a strided convolution or pool, and nothing else), whole convolutions
through it against the XLA path (values and gradients), and Triton lowering. GPU (``-m gpu``): the kernel on
the output of a strided convolution of a 1M-site sphere shell against the XLA map.
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
from pallas_kernels.occupancy_neighbors import (neighbor_map_from_occupancy,
                                                neighbor_map_from_occupancy_reference)

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


def _both(coords, num, occ, shape, batch, offsets):
  kwargs = dict(spatial_shape=shape, batch_size=batch, offsets=offsets)
  got = neighbor_map_from_occupancy(jnp.asarray(coords), jnp.int32(num), occ, interpret=True, **kwargs)
  ref = _reference(jnp.asarray(coords), jnp.int32(num), occ, **kwargs)
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


@settings(max_examples=15, deadline=None)  # every example's shapes compile the kernel anew
@given(data=st.data())
def test_map_property(data):
  # Any grid (a 32-site word spanning several rows, or one row spanning several words), batch, density, offsets
  # (negative, repeated, past the grid), rows beyond num, and a traced num: the dictionary map exactly.
  draw = data.draw
  shape = tuple(draw(st.integers(1, 12)) for _ in range(3))
  batch = draw(st.integers(1, 3))
  sites = batch * int(np.prod(shape))
  occupied = draw(st.integers(0, min(sites, 120)))
  num = draw(st.integers(0, occupied))
  capacity = num + draw(st.integers(0, 6))
  offsets = tuple(tuple(o) for o in draw(st.lists(st.lists(st.integers(-4, 4), min_size=3, max_size=3),
                                                  min_size=1, max_size=12)))
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
