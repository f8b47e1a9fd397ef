"""Points <-> voxels under one convention: voxelize's point -> row index, devoxelize, and grid_sample in world
units finding every point's own voxel (issue 17 item 5)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jsparse
from jsparse.sampling import gather_sites, grid_sample
from jsparse.voxelize import devoxelize, voxel_centres, voxelize, voxelize_jit

VOXEL, ORIGIN = 0.37, (-3.1, -2.9, -3.05)


def _cloud(seed=0, n=3000, batch_size=2):
  rng = np.random.default_rng(seed)
  pts = rng.uniform(-2.9, 2.9, (n, 3)).astype(np.float32)
  return pts, rng.normal(size=(n, 4)).astype(np.float32), rng.integers(0, batch_size, n)


def _own_voxel(pts, batch):
  """(batch, i, j, k) of every point: floor((p - origin) / voxel_size) in float64."""
  idx = np.floor((pts.astype(np.float64) - np.asarray(ORIGIN)) / VOXEL).astype(np.int64)
  return np.concatenate([batch[:, None], idx], axis=1)


@pytest.mark.parametrize("dedup", ["numpy", "xla"])
def test_voxelize_point_rows_name_each_points_voxel(dedup):
  pts, feats, batch = _cloud()
  x, rows = voxelize(pts, feats, voxel_size=VOXEL, origin=ORIGIN, batch=batch, return_index=True, dedup=dedup)
  rows = np.asarray(rows)
  assert rows.shape == (len(pts),) and rows.dtype == np.int32 and rows.min() >= 0 and rows.max() < int(x.num)
  np.testing.assert_array_equal(np.asarray(x.coords)[rows], _own_voxel(pts, batch))
  # The mean of a voxel's points, read back at the points, is the mean over the points sharing its row.
  back = np.asarray(devoxelize(x, rows))
  for r in np.unique(rows)[:50]:
    np.testing.assert_allclose(back[rows == r], np.broadcast_to(feats[rows == r].mean(0), back[rows == r].shape),
                               rtol=1e-5, atol=1e-6)


def test_voxelize_jit_point_rows_and_overflow():
  pts, feats, batch = _cloud(1, n=800)
  x, rows = voxelize(pts, feats, voxel_size=VOXEL, origin=ORIGIN, spatial_shape=(17, 17, 17), batch=batch,
                     batch_size=2, return_index=True)
  run = jax.jit(lambda p, cap: voxelize_jit(p, feats, voxel_size=VOXEL, origin=ORIGIN, spatial_shape=(17, 17, 17),
                                            capacity=cap, batch=batch, batch_size=2, return_index=True),
                static_argnums=1)
  y, overflow, rows_jit = run(pts, x.capacity)
  assert not bool(overflow)
  np.testing.assert_array_equal(np.asarray(rows_jit), np.asarray(rows))
  small = int(x.num) - 5
  y, overflow, rows_small = run(pts, small)
  rows_small = np.asarray(rows_small)
  assert bool(overflow)
  # Points of the dropped voxels (the largest keys) have no row; the others keep theirs.
  np.testing.assert_array_equal(rows_small, np.where(np.asarray(rows) < small, rows, -1))
  assert np.all(np.asarray(devoxelize(y, rows_small))[rows_small < 0] == 0)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_grid_sample_nearest_finds_every_points_own_voxel(dtype):
  pts, feats, batch = _cloud(2)
  x, rows = voxelize(pts, feats.astype(dtype), voxel_size=VOXEL, origin=ORIGIN, batch=batch, return_index=True)
  got = grid_sample(x, pts, "nearest", batch=batch, voxel_size=VOXEL, origin=ORIGIN)
  np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)),
                                np.asarray(devoxelize(x, rows).astype(jnp.float32)))
  assert got.dtype == dtype
  # Voxel centres map back to their own voxels, by voxelize and by grid_sample.
  centres, _ = voxel_centres(x, voxel_size=VOXEL, origin=ORIGIN)
  n = int(x.num)
  c = np.asarray(centres[:n])
  item = np.asarray(x.coords[:n, 0])
  again, again_rows = voxelize(c, voxel_size=VOXEL, origin=ORIGIN, spatial_shape=x.spatial_shape, batch=item,
                               batch_size=x.batch_size, return_index=True)
  np.testing.assert_array_equal(np.asarray(again.coords[:n]), np.asarray(x.coords[:n]))
  np.testing.assert_array_equal(np.asarray(again_rows), np.arange(n))
  at_centres = grid_sample(x, c, "nearest", batch=item, voxel_size=VOXEL, origin=ORIGIN)
  np.testing.assert_array_equal(np.asarray(at_centres.astype(jnp.float32)),
                                np.asarray(x.feats[:n].astype(jnp.float32)))
  # Trilinear sampling at a voxel centre reads that voxel alone.
  tri = grid_sample(x, c, batch=item, voxel_size=VOXEL, origin=ORIGIN)
  np.testing.assert_allclose(np.asarray(tri.astype(jnp.float32)), np.asarray(x.feats[:n].astype(jnp.float32)),
                             rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16])
def test_devoxelize_gradient_sums_each_voxels_points(dtype):
  pts, feats, batch = _cloud(3, n=1500)
  x, rows = voxelize(pts, feats.astype(dtype), voxel_size=VOXEL, origin=ORIGIN, batch=batch, return_index=True)
  rows = np.array(rows)
  rows[::7] = -1  # points without a voxel read zeros and send no gradient
  cot = np.random.default_rng(4).normal(size=(len(pts), 4)).astype(np.float32)
  out, vjp = jax.vjp(lambda f: devoxelize(x.replace(feats=f), rows), x.feats)
  (g,) = vjp(jnp.asarray(cot, dtype))
  expected_out = np.where((rows >= 0)[:, None], np.asarray(x.feats.astype(jnp.float32))[np.maximum(rows, 0)], 0)
  np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)), expected_out)
  expected = np.zeros((x.capacity, 4), np.float64)
  np.add.at(expected, rows[rows >= 0], np.asarray(jnp.asarray(cot, dtype).astype(jnp.float32))[rows >= 0])
  assert g.dtype == dtype
  tol = 1e-5 if dtype == jnp.float32 else 2e-3
  np.testing.assert_allclose(np.asarray(g.astype(jnp.float32)), expected, rtol=tol, atol=tol)
  # Under jit too, and a non-finite cotangent stays in its own voxel.
  cot_bad = cot.copy()
  cot_bad[np.flatnonzero(rows >= 0)[0]] = np.inf
  g_bad = jax.jit(lambda f, c: jax.vjp(lambda f: devoxelize(x.replace(feats=f), rows), f)[1](c)[0])(
      x.feats, jnp.asarray(cot_bad, dtype))
  bad_row = rows[np.flatnonzero(rows >= 0)[0]]
  finite = np.isfinite(np.asarray(g_bad.astype(jnp.float32)))
  assert not finite[bad_row].all() and finite[np.arange(x.capacity) != bad_row].all()


def test_grid_sample_trilinear_gradient_matches_autodiff_gather():
  pts, feats, batch = _cloud(5, n=600)
  x = voxelize(pts, feats, voxel_size=VOXEL, origin=ORIGIN, batch=batch)
  sample = lambda f: grid_sample(x.replace(feats=f), pts, batch=batch, voxel_size=VOXEL, origin=ORIGIN)
  cot = jnp.asarray(np.random.default_rng(6).normal(size=(len(pts), 4)).astype(np.float32))
  g = jax.jit(lambda f, c: jax.vjp(sample, f)[1](c)[0])(x.feats, cot)  # jitted: one program, not one per primitive
  # The same blend written with a plain gather (whose autodiff gradient is a scatter-add) as the reference.
  u = (pts - np.asarray(ORIGIN, np.float32)) / np.float32(VOXEL) - 0.5
  base = np.floor(u).astype(np.int32)
  from jsparse.sampling import lookup_rows
  corners = np.array(list(np.ndindex(2, 2, 2)))  # [8, 3]
  sites = base[:, None] + corners[None]
  query = np.concatenate([np.broadcast_to(batch[:, None, None], (len(pts), 8, 1)), sites], -1)
  r = np.asarray(lookup_rows(x, query)).reshape(-1)
  w = np.prod(np.where(corners[None] > 0, (u - base)[:, None], 1 - (u - base)[:, None]), axis=-1).reshape(-1)
  ref_g = np.zeros((x.capacity, 4))
  np.add.at(ref_g, r[r >= 0], (w[:, None] * np.repeat(np.asarray(cot), 8, axis=0))[r >= 0])
  np.testing.assert_allclose(np.asarray(g), ref_g, rtol=1e-4, atol=1e-5)


def test_bad_arguments():
  pts, feats, batch = _cloud(n=50)
  x, rows = voxelize(pts, feats, voxel_size=VOXEL, origin=ORIGIN, batch=batch, return_index=True)
  with pytest.raises(ValueError, match="point_rows"):
    devoxelize(x, np.asarray(rows, np.float32))
  with pytest.raises(ValueError, match="point_rows"):
    devoxelize(x, np.full(3, x.capacity))
  with pytest.raises(TypeError, match="SparseTensor"):
    devoxelize(x.feats, rows)
  with pytest.raises(ValueError, match="voxel_size"):
    grid_sample(x, pts, voxel_size=(1.0, 2.0))
  with pytest.raises(ValueError, match="rows"):
    gather_sites(x.feats, np.zeros((3, 2), np.int32))


@pytest.mark.parametrize("mode", ["trilinear", "nearest"])
def test_grid_sample_batch_outside_the_items_raises(mode):
  # A batch id past the tensor's items (an off-by-one, or -1) found no voxel and sampled zeros everywhere: a silent
  # wrong answer. Outside jit it is a ValueError naming batch; under jit such points sample zeros, and inside
  # error_checks() checkify names the first of them.
  pts, feats, batch = _cloud(n=200, batch_size=2)
  x = voxelize(pts, feats, voxel_size=VOXEL, origin=ORIGIN, batch=batch)
  for bad in (2, -1):
    wrong = batch.copy()
    wrong[7] = bad
    with pytest.raises(ValueError, match=r"batch must be in \[0, batch_size=2\).* point 7"):
      grid_sample(x, pts, mode, batch=wrong, voxel_size=VOXEL, origin=ORIGIN)
    # A constant batch under the caller's jit is concrete: it raises there too.
    with pytest.raises(ValueError, match=r"batch must be in \[0, batch_size=2\).* point 7"):
      jax.jit(lambda p: grid_sample(x, p, mode, batch=wrong, voxel_size=VOXEL, origin=ORIGIN))(pts)
  got = jax.jit(lambda b: grid_sample(x, pts, mode, batch=b, voxel_size=VOXEL, origin=ORIGIN))(jnp.asarray(wrong))
  want = np.asarray(grid_sample(x, pts, mode, batch=batch, voxel_size=VOXEL, origin=ORIGIN))
  assert np.all(np.asarray(got)[7] == 0)
  assert np.allclose(np.delete(np.asarray(got), 7, axis=0), np.delete(want, 7, axis=0))
  assert np.any(want[7] != 0)  # the point's own voxel is active: zeros there were wrong
  sample = jax.jit(checkify.checkify(lambda b: grid_sample(x, pts, mode, batch=b, voxel_size=VOXEL,
                                                           origin=ORIGIN)))
  with jsparse.error_checks():
    err, got_checked = sample(jnp.asarray(wrong))
    assert err.get() is not None and "batch must be in [0, batch_size=2), got -1 for point 7" in err.get()
    np.testing.assert_array_equal(np.asarray(got_checked), np.asarray(got))
    err, _ = sample(jnp.asarray(batch))
    assert err.get() is None


def test_devoxelize_rows_past_the_capacity_under_jit():
  # Outside jit such rows raise; under jit the gather clamped them onto the last row, a valid voxel when
  # num == capacity, so points got another voxel's features silently.
  import jsparse
  from jax.experimental import checkify

  x = voxelize(np.array([[0.5, 0.5, 0.5], [1.5, 0.5, 0.5]]), np.array([[1.0], [2.0]], np.float32), voxel_size=1.0,
               capacity="exact")
  rows = jnp.array([0, 1, 2, 5])
  np.testing.assert_array_equal(np.asarray(jax.jit(devoxelize)(x, rows))[:, 0], [1.0, 2.0, 0.0, 0.0])
  with jsparse.error_checks():
    err, _ = jax.jit(checkify.checkify(devoxelize))(x, rows)
  assert "2 point_rows" in err.get()
  g = jax.grad(lambda f: jnp.sum(jax.jit(devoxelize)(x.replace(feats=f), rows)))(x.feats)
  np.testing.assert_array_equal(np.asarray(g)[:, 0], [1.0, 1.0])


def test_devoxelize_refuses_rows_below_minus_one():
  # -2 (a Python-style index from the end, or a corrupted row) read zeros as if the point had no voxel, silently,
  # while rows past the capacity raise.
  x = voxelize(np.array([[0.5, 0.5, 0.5], [1.5, 0.5, 0.5]]), np.array([[1.0], [2.0]], np.float32), voxel_size=1.0,
               capacity="exact")
  np.testing.assert_array_equal(np.asarray(devoxelize(x, np.array([1, -1, 0])))[:, 0], [2.0, 0.0, 1.0])
  with pytest.raises(ValueError, match="point_rows has row -2"):
    devoxelize(x, np.array([0, -2]))
  # Under jit they read zeros, and checkify reports them inside error_checks().
  import jsparse
  from jax.experimental import checkify

  rows = jnp.array([0, -2, -5, -1])
  np.testing.assert_array_equal(np.asarray(jax.jit(devoxelize)(x, rows))[:, 0], [1.0, 0.0, 0.0, 0.0])
  with jsparse.error_checks():
    err, _ = jax.jit(checkify.checkify(devoxelize))(x, rows)
  assert "2 point_rows are < -1" in err.get()
  with jsparse.error_checks():
    err, _ = jax.jit(checkify.checkify(devoxelize))(x, jnp.array([0, -1]))
  assert err.get() is None


@pytest.mark.parametrize("mode", ["trilinear", "nearest"])
def test_grid_sample_with_no_points(mode):
  # Reshapes by -1 raised ZeroDivisionError at P = 0 (trilinear, and [B, 0, 3] points in either mode).
  pts, feats, batch = _cloud(n=50)
  x = voxelize(pts, feats, voxel_size=VOXEL, origin=ORIGIN, batch=batch, batch_size=2)
  assert grid_sample(x, np.zeros((0, 3), np.float32), mode).shape == (0, 4)
  assert grid_sample(x, np.zeros((2, 0, 3), np.float32), mode).shape == (2, 0, 4)
  assert jax.jit(lambda p: grid_sample(x, p, mode))(jnp.zeros((0, 3))).shape == (0, 4)
  g = jax.grad(lambda f: jnp.sum(grid_sample(x.replace(feats=f), jnp.zeros((0, 3)), mode)))(x.feats)
  assert np.all(np.asarray(g) == 0)


def test_complex_feats_are_refused_naming_feats():
  # They made a complex SparseTensor, which from_coords and every layer refuse (README: no complex features).
  pts, feats, batch = _cloud(n=50)
  with pytest.raises(TypeError, match="feats"):
    voxelize(pts, feats.astype(np.complex64), voxel_size=VOXEL, origin=ORIGIN)
  with pytest.raises(TypeError, match="feats"):
    voxelize_jit(pts, feats.astype(np.complex64), voxel_size=VOXEL, origin=ORIGIN, spatial_shape=(17, 17, 17),
                 capacity=64)
  x = voxelize(pts, np.arange(50), voxel_size=VOXEL, origin=ORIGIN, reduce="sum")  # integers still become float32
  assert x.dtype == np.float32


def test_lookup_rows_checks_query_and_ok():
  from jsparse.sampling import lookup_rows
  pts, feats, batch = _cloud(n=50)
  x = voxelize(pts, feats, voxel_size=VOXEL, origin=ORIGIN)
  q = np.asarray(x.coords[:2])
  with pytest.raises(ValueError, match="query"):  # a reshape's TypeError, naming nothing
    lookup_rows(x, q[:, 1:])
  with pytest.raises(ValueError, match="ok"):  # and-ed bitwise: 2 & True is 0, so the hit was lost
    lookup_rows(x, q, np.array([2, 2]))
  with pytest.raises(ValueError, match="ok"):
    lookup_rows(x, q, np.ones(3, bool))
  np.testing.assert_array_equal(np.asarray(lookup_rows(x, q, np.array([True, False]))), [0, -1])


@pytest.mark.parametrize("ndim", [2, 1])
def test_voxel_centres_of_2d_and_1d_tensors_are_the_points_grid_sample_takes(ndim):
  from jsparse import SparseTensor
  shape = (5, 6, 7)[3 - ndim:]
  coords = np.array([[0, *range(1, ndim + 1)], [1, *range(2, ndim + 2)]], np.int32)
  feats = np.array([[1.0], [2.0]], np.float32)
  x = SparseTensor.from_coords(coords, feats, shape, batch_size=2)
  vs, org = (0.5, 0.25)[:ndim], (-1.0, 2.0)[:ndim]
  centres, valid = voxel_centres(x, voxel_size=vs, origin=org)  # [cap, 3] before, and 2 values refused
  assert centres.shape == (x.capacity, ndim)
  np.testing.assert_allclose(np.asarray(centres[:2]), np.asarray(org) + (coords[:, 1:] + 0.5) * np.asarray(vs))
  back = grid_sample(x, centres[:2], "nearest", batch=coords[:, 0], voxel_size=vs, origin=org)
  np.testing.assert_array_equal(np.asarray(back), feats)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_points_on_a_1024_grid_find_their_own_voxels(dtype):
  """Points of a generative model in [-1, 1) on a 1024^3 grid (voxel_size 2/1024), held in half precision: u ~ 1000
  was computed in the points' dtype, whose spacing there is 8 (bfloat16) or 0.5 (float16) voxels, so most points
  sampled (grid_sample) or were put in (voxelize_jit) other voxels than their exact values name. Compared with
  float64 arithmetic on the same (exactly representable) point values."""
  rng = np.random.default_rng(0)
  size, vs, org = 1024, 2.0 / 1024, -1.0
  pts = jnp.asarray(rng.uniform(-1, 0.99, (64, 3)), dtype)
  exact = np.asarray(pts.astype(jnp.float32), np.float64)
  kw = dict(voxel_size=vs, origin=org, spatial_shape=(size,) * 3, capacity=128)
  ref, ref_rows = voxelize(exact, np.arange(64, dtype=np.float32), return_index=True, **kw)
  x, overflow, rows = jax.jit(lambda p: voxelize_jit(p, jnp.arange(64, dtype=jnp.float32), return_index=True,
                                                     **kw))(pts)
  assert not bool(overflow) and int(x.num) == int(ref.num)
  np.testing.assert_array_equal(np.asarray(x.coords), np.asarray(ref.coords))
  np.testing.assert_array_equal(np.asarray(rows), np.asarray(ref_rows))
  got = grid_sample(ref, pts, "nearest", voxel_size=vs, origin=org)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(devoxelize(ref, ref_rows)))
  # The gradient with respect to the points comes back in their dtype.
  g = jax.grad(lambda p: jnp.sum(grid_sample(ref, p, voxel_size=vs, origin=org)))(pts)
  assert g.dtype == dtype and g.shape == pts.shape
