"""Regressions from an adversarial review of the non-convolution API (normalisation, sampling, voxelize, nnx):
each test failed before its fix. Small inputs, numpy / dense references."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import jsparse
import jsparse.nnx as snnx
from jsparse.sampling import grid_sample
from jsparse.voxelize import voxel_centres, voxelize, voxelize_jit


def _grid_tensor(channels=2):
  coords = np.argwhere(np.ones((2, 2, 2, 2), bool))  # every site of two 2x2x2 items
  feats = np.arange(len(coords) * channels, dtype=np.float32).reshape(-1, channels) ** 1.5
  return jsparse.SparseTensor.from_coords(coords, feats, (2, 2, 2), capacity=len(coords) + 3)


# ---- nnx.view switches SparseBatchNorm as it switches nnx.BatchNorm ------------------------------------------


def test_nnx_view_puts_sparse_batch_norm_in_eval_mode():
  # SparseBatchNorm had no set_view: nnx.view(model, use_running_average=True) switched the flax layers beside
  # it and left it training on batch statistics (moving its running averages), or raised "Unused keys" alone.
  class Model(nnx.Module):
    def __init__(self, rngs):
      self.bn = snnx.SparseBatchNorm(2, rngs=rngs)
      self.head = nnx.BatchNorm(2, rngs=rngs)

    def __call__(self, x):
      return self.head(self.bn(x).feats)

  x = _grid_tensor()
  model = Model(nnx.Rngs(0))
  model.bn.mean[...] = jnp.asarray([1.0, -2.0])
  model.bn.var[...] = jnp.asarray([4.0, 0.25])
  model.bn.scale[...] = jnp.asarray([0.5, 2.0])
  view = nnx.view(model, use_running_average=True)
  assert view.bn.use_running_average and view.head.use_running_average
  out = view.bn(x)
  f = np.asarray(x.feats, np.float64)
  want = (f - [1.0, -2.0]) / np.sqrt(np.array([4.0, 0.25]) + 1e-5) * [0.5, 2.0] * np.asarray(x.valid_mask())[:, None]
  np.testing.assert_allclose(np.asarray(out.feats), want, rtol=1e-5, atol=1e-5)
  view(x)
  np.testing.assert_array_equal(np.asarray(model.bn.mean[...]), [1.0, -2.0])  # eval reads, never moves them
  np.testing.assert_array_equal(np.asarray(model.bn.var[...]), [4.0, 0.25])
  alone = nnx.view(snnx.SparseBatchNorm(2, rngs=nnx.Rngs(0)), use_running_average=True)  # raised ValueError
  assert alone.use_running_average
  assert not nnx.view(alone, use_running_average=False).use_running_average


# ---- voxel_size / origin are checked wherever points meet voxels -------------------------------------------


def test_voxelize_jit_rejects_a_non_positive_voxel_size():
  # voxelize raises for voxel_size <= 0 but voxelize_jit took it: -1 mirrored these points onto voxels
  # (2, 2, 2) and (0, 1, 3) of the grid without a flag, 0 dropped them all.
  pts = np.array([[-2.5, -2.5, -2.5], [-0.5, -1.5, -3.5]], np.float32)
  kw = dict(origin=0.0, spatial_shape=(4, 4, 4), capacity=8)
  for bad in (-1.0, 0.0, np.nan, (1.0, -1.0, 1.0)):
    with pytest.raises(ValueError, match="voxel_size"):
      voxelize_jit(pts, voxel_size=bad, **kw)
    with pytest.raises(ValueError, match="voxel_size"):
      jax.jit(lambda p, bad=bad: voxelize_jit(p, voxel_size=bad, **kw)[0].feats)(pts)  # a constant under jit
  with pytest.raises(ValueError, match="voxel_size"):  # 1e-46 is 0 in float32, where float16 points are quantised
    voxelize_jit(pts.astype(np.float16), voxel_size=1e-46, **kw)
  for bad in (np.inf, None, (0.0, 0.0)):
    with pytest.raises(ValueError, match="origin"):
      voxelize_jit(pts, voxel_size=1.0, **{**kw, "origin": bad})
  with pytest.raises(ValueError, match="voxel_size"):  # was a broadcasting error naming no argument
    voxelize_jit(pts, voxel_size=(1.0, 2.0), **kw)
  # Traced sizes are not checked and still quantise as voxelize does.
  good = pts + 4.0
  x, _ = jax.jit(lambda p, vs: voxelize_jit(p, voxel_size=vs, **kw))(good, jnp.float32(1.0))
  ref = voxelize(good, voxel_size=1.0, origin=0.0, spatial_shape=(4, 4, 4), capacity=8)
  np.testing.assert_array_equal(np.asarray(x.coords), np.asarray(ref.coords))


def test_grid_sample_and_voxel_centres_reject_a_bad_voxel_size():
  x = _grid_tensor()
  pts = np.array([[-0.5, -0.5, -0.5]], np.float32)
  # A voxel_size of -1 read voxel (0, 0, 0) for a point outside the grid.
  for mode in ("nearest", "trilinear"):
    with pytest.raises(ValueError, match="voxel_size"):
      grid_sample(x, pts, mode, voxel_size=-1.0)
  with pytest.raises(ValueError, match="origin"):
    grid_sample(x, pts, origin=np.nan)
  with pytest.raises(ValueError, match="voxel_size"):
    voxel_centres(x, voxel_size=(1.0, 2.0))
  with pytest.raises(ValueError, match="voxel_size"):
    voxel_centres(x, voxel_size=0.0)
  np.testing.assert_array_equal(np.asarray(grid_sample(x, pts, "nearest", voxel_size=1.0)), [[0.0, 0.0]])


def test_voxelize_inferred_grid_too_large_names_voxel_size():
  # With spatial_shape inferred, an infinite extent raised OverflowError from int(), and a huge finite one was
  # reported as points outside the grid it had just inferred.
  for pts, vs in ((np.array([[0.0, 0, 0], [1e300, 0, 0]]), 1e-10), (np.array([[0.0, 0, 0], [1e20, 0, 0]]), 1.0)):
    with np.errstate(over="ignore"), pytest.raises(ValueError, match=r"voxel_size.*2\*\*21"):
      voxelize(pts, voxel_size=vs)


def test_voxelize_jit_half_precision_points_keep_the_last_voxel():
  # The grid extents were compared in the points' dtype: in float16 an extent of 2049 rounds to 2048, so a point
  # of voxel 2048 (inside the grid) was dropped without a flag, where voxelize keeps it.
  pts = np.array([[2048.0, 0.5, 0.5], [10.0, 0.5, 0.5]], np.float16)
  kw = dict(voxel_size=1.0, origin=0.0, spatial_shape=(2049, 1, 1))
  x, overflow = voxelize_jit(pts, capacity=4, **kw)
  ref = voxelize(pts, capacity=4, **kw)
  assert int(x.num) == int(ref.num) == 2 and not bool(overflow)
  np.testing.assert_array_equal(np.asarray(x.coords), np.asarray(ref.coords))


def test_bad_batch_size_and_activation_are_named():
  """voxelize(batch_size=0) says batch_size must be >= 1 (it blamed batch id 0), a float batch_size is refused as
  voxelize_jit's is, and norm.activation with a non-callable names fn (it failed with "'int' object is not
  callable")."""
  pts = np.zeros((2, 3), np.float32)
  with pytest.raises(ValueError, match="batch_size"):
    voxelize(pts, voxel_size=1.0, batch_size=0)
  with pytest.raises(TypeError, match="batch_size"):
    voxelize(pts, voxel_size=1.0, batch_size=2.0)
  x = jsparse.SparseTensor.from_coords(np.zeros((1, 4), np.int32), np.ones((1, 2), np.float32), (2, 2, 2))
  with pytest.raises(TypeError, match="fn must be a callable"):
    jsparse.norm.activation(x, 3)


@pytest.mark.parametrize("op", ["layer_norm", "group_norm", "batch_norm", "activation_silu", "layer_norm_gelu",
                                "batch_norm_running", "batch_norm_running_silu", "batch_norm_axis_name"])
def test_non_finite_padding_rows_leave_values_and_gradients_finite(op):
  """A directly built tensor may hold anything in its padding rows (the API promises they are ignored): NaN and
  inf there must reach neither the valid rows' values nor any gradient (features, scale, bias). layer_norm and a
  smooth activation gave NaN scale / bias gradients and NaN padding-row gradients (0 * NaN in their backward)."""
  from jsparse import norm

  rng = np.random.default_rng(3)
  cap, num, c = 12, 7, 4
  coords = np.zeros((cap, 4), np.int32)
  coords[:num, 1] = np.arange(num)
  feats = rng.standard_normal((cap, c)).astype(np.float32)
  feats[num:] = [np.nan, np.inf, -np.inf, 1e38]
  x = jsparse.SparseTensor(jnp.asarray(coords), jnp.asarray(feats), jnp.asarray(num, jnp.int32), (8, 1, 1), 1)
  clean = x.replace(feats=jnp.where(x.valid_mask()[:, None], x.feats, 0))
  scale0, bias0 = jnp.asarray(rng.standard_normal(c), jnp.float32), jnp.asarray(rng.standard_normal(c), jnp.float32)

  mean0, var0 = jnp.asarray(rng.standard_normal(c), jnp.float32), jnp.asarray(rng.random(c) + 0.5, jnp.float32)

  def apply(t, scale, bias):
    if op == "batch_norm_running":  # frozen statistics (use_running_average)
      return norm.batch_norm(t, scale, bias, mean=mean0, var=var0)
    if op == "batch_norm_running_silu":
      return norm.batch_norm(t, scale, bias, mean=mean0, var=var0, activation=jax.nn.silu)
    if op == "batch_norm_axis_name":  # data-parallel statistics, one device here (vmap of one item)
      one = jax.tree.map(lambda a: a[None], t)
      out = jax.vmap(lambda u: norm.batch_norm(u, scale, bias, axis_name="d"), axis_name="d")(one)
      return jax.tree.map(lambda a: a[0], out)
    if op == "layer_norm":
      return norm.layer_norm(t, scale, bias)
    if op == "group_norm":
      return norm.group_norm(t, 2, scale, bias)
    if op == "batch_norm":
      return norm.batch_norm(t, scale, bias)
    if op == "layer_norm_gelu":
      return norm.activation(norm.layer_norm(t), jax.nn.gelu)
    return norm.activation(t, jax.nn.silu)

  def loss(f, scale, bias, base):
    y = apply(base.replace(feats=f), scale, bias)
    return jnp.sum(y.feats * jnp.arange(1, c + 1, dtype=jnp.float32)), y.feats

  (value, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(x.feats, scale0, bias0, x)
  (value_c, y_c), grads_c = jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(clean.feats, scale0, bias0,
                                                                                     clean)
  assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(y)))
  np.testing.assert_allclose(np.asarray(y), np.asarray(y_c), rtol=1e-6, atol=1e-6)
  for g, g_c in zip(grads, grads_c):
    assert np.all(np.isfinite(np.asarray(g))), op
    np.testing.assert_allclose(np.asarray(g), np.asarray(g_c), rtol=1e-5, atol=1e-6)
  assert np.all(np.asarray(grads[0])[num:] == 0)


def test_from_coords_names_a_huge_unsigned_coordinate_as_given():
  """uint64 coordinates at or above 2**63 were reported as wrapped negative values ("negative coordinate ...
  -9223372036854775808"); the error now quotes the value the caller passed. Below 2**63 the grid check speaks."""
  coords = np.array([[0, 1, 2, 3], [0, 2**63 + 5, 0, 0]], np.uint64)
  with pytest.raises(ValueError, match=r"coordinate \[0, 9223372036854775813, 0, 0\] in row 1 is outside every grid"):
    jsparse.SparseTensor.from_coords(coords, np.zeros((2, 1), np.float32), (8, 8, 8))
  coords[1, 1] = 2**40
  with pytest.raises(ValueError, match=r"coordinate \[0, 1099511627776, 0, 0\] in row 1 is outside"):
    jsparse.SparseTensor.from_coords(coords, np.zeros((2, 1), np.float32), (8, 8, 8))
  y = jsparse.SparseTensor.from_coords(np.array([[0, 1, 2, 3]], np.uint64), np.ones((1, 1), np.float32), (8, 8, 8))
  assert np.asarray(y.coords)[0].tolist() == [0, 1, 2, 3]


def test_batch_ids_past_int32_are_refused():
  """Batch ids are int32 coordinates: a batch id of 2**31 was stored as -2**31, and 2**40 with batch_size=2**40+1
  became batch 0 (the grid check allows 2**62 sites), silently. Both now raise a ValueError."""
  f = np.zeros((1, 1), np.float32)
  with pytest.raises(ValueError, match="batch_size must be below 2\\*\\*31"):
    jsparse.SparseTensor.from_coords(np.array([[2**31, 0, 0, 0]], np.int64), f, (1, 1, 1))
  with pytest.raises(ValueError, match="batch_size must be below 2\\*\\*31"):
    jsparse.SparseTensor.from_coords(np.array([[2**40, 0, 0, 0]], np.int64), f, (1, 1, 1), batch_size=2**40 + 1)
  y = jsparse.SparseTensor.from_coords(np.array([[2**31 - 2, 0, 0, 0]], np.int64), f, (1, 1, 1))
  assert int(np.asarray(y.coords)[0, 0]) == 2**31 - 2 and y.batch_size == 2**31 - 1
