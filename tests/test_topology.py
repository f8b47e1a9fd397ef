"""Topology ops (issue 17 item 4): select, union / add / multiply, broadcast_per_item, child_labels, dropout,
against dense references (values and gradients, float32 and a half type), under jit with overflow flags."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify
from reference import random_sparse

import jsparse
import jsparse.nn as snn

HALF = jnp.bfloat16


def _pair(seed=0, shape=(5, 6, 4), channels=3, dtype=np.float32, batch_size=2):
  rng = np.random.default_rng(seed)
  a = random_sparse(rng, shape, channels, batch_size=batch_size, density=0.35, pad=3)
  b = random_sparse(rng, shape, channels, batch_size=batch_size, density=0.35, pad=6)
  return a.replace(feats=a.feats.astype(dtype)), b.replace(feats=b.feats.astype(dtype))


def _sites(x):
  n = int(x.num)
  return {tuple(c) for c in np.asarray(x.coords[:n]).tolist()}


def _at(dense, x):
  """dense [B, X, Y, Z, C] read at x's rows (zeros at padding rows)."""
  c = jnp.maximum(x.coords, 0)
  return jnp.where(x.valid_mask()[:, None], dense[c[:, 0], c[:, 1], c[:, 2], c[:, 3]], 0)


def _check_padding(x):
  n = int(x.num)
  assert np.all(np.asarray(x.coords[n:]) == -1) and np.all(np.asarray(x.feats[n:]) == 0)


def _tol(dtype):
  return {"rtol": 2e-2, "atol": 2e-2} if dtype == HALF else {"rtol": 1e-6, "atol": 1e-6}


# ---- select --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, HALF])
def test_select_values_and_gradient(dtype):
  x, _ = _pair(1, dtype=dtype)
  rng = np.random.default_rng(2)
  mask = jnp.asarray(rng.random(x.capacity) < 0.5).at[-1].set(True)  # a padding row asked for: never kept
  y = jsparse.select(x, mask)
  keep = np.asarray(mask & x.valid_mask())
  assert y.capacity == x.capacity and int(y.num) == keep.sum() and y.dtype == x.dtype
  np.testing.assert_array_equal(np.asarray(y.coords[: int(y.num)]), np.asarray(x.coords)[keep])  # order kept
  np.testing.assert_array_equal(np.asarray(y.todense()), np.asarray(x.todense()) * np.asarray(
      jsparse.select(x.replace(feats=jnp.ones_like(x.feats)), mask).todense()))
  _check_padding(y)
  cot = jnp.asarray(rng.normal(size=(y.capacity, x.num_channels)), dtype)
  (g,) = jax.vjp(lambda f: jsparse.select(x.replace(feats=f), mask).feats, x.feats)[1](cot)
  # Reference: the gradient of a dense mask, read at x's rows.
  dense_cot = y.replace(feats=cot * y.valid_mask()[:, None].astype(dtype)).todense()
  np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(_at(dense_cot, x), np.float32))
  assert np.all(np.asarray(g)[~keep] == 0)


def test_select_capacity_and_overflow_under_jit():
  x, _ = _pair(3)
  mask = jnp.arange(x.capacity) % 2 == 0
  count = int(jnp.sum(mask & x.valid_mask()))
  exact = jsparse.select(x, mask, capacity="exact")
  assert exact.capacity == count and int(exact.num) == count
  run = jax.jit(lambda x, m, cap: jsparse.select(x, m, capacity=cap, with_overflow=True), static_argnums=2)
  y, flag = run(x, mask, count - 2)
  assert bool(flag) and bool(jsparse.overflowed(y)) and int(y.num) == count - 2
  np.testing.assert_array_equal(np.asarray(y.coords), np.asarray(exact.coords[: count - 2]))
  y, flag = run(x, mask, count)
  assert not bool(flag) and not bool(jsparse.overflowed(y))
  with jsparse.error_checks():
    err, _ = jax.jit(checkify.checkify(lambda x: jsparse.select(x, mask, capacity=count - 1)))(x)
  assert "select" in err.get() and str(count) in err.get()
  with pytest.raises(ValueError, match="select"):
    jsparse.select(x, mask, capacity=count - 1)
  # A flagged input stays flagged.
  assert bool(jsparse.overflowed(jsparse.select(x.replace(overflow=jnp.array(True)), mask)))
  with pytest.raises(ValueError, match="mask"):
    jsparse.select(x, mask[:-1])
  with pytest.raises(ValueError, match="mask"):
    jsparse.select(x, mask.astype(jnp.int32))
  with pytest.raises(TypeError, match="SparseTensor"):
    jsparse.select(x.feats, mask)


# ---- union, add, multiply ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, HALF])
@pytest.mark.parametrize("op, dense_op", [(jsparse.add, jnp.add), (jsparse.multiply, jnp.multiply)])
def test_add_multiply_match_dense(op, dense_op, dtype):
  a, b = _pair(4, dtype=dtype)
  y = op(a, b)
  assert _sites(y) == _sites(a) | _sites(b) and y.dtype == a.dtype
  keys = np.asarray(y.linear_keys()[: int(y.num)])
  assert np.all(np.diff(keys) > 0)  # sorted by key
  da, db = a.todense(), b.todense()
  np.testing.assert_allclose(np.asarray(y.feats, np.float32), np.asarray(_at(dense_op(da, db), y), np.float32),
                             **_tol(dtype))
  _check_padding(y)
  # Gradients: the dense op's, read at each input's sites.
  cot = jnp.asarray(np.random.default_rng(5).normal(size=y.feats.shape), dtype)
  ga, gb = jax.vjp(lambda fa, fb: op(a.replace(feats=fa), b.replace(feats=fb)).feats, a.feats, b.feats)[1](cot)
  dense_cot = y.replace(feats=cot * y.valid_mask()[:, None].astype(dtype)).todense()
  ra, rb = jax.vjp(dense_op, da, db)[1](dense_cot)
  np.testing.assert_allclose(np.asarray(ga, np.float32), np.asarray(_at(ra, a), np.float32), **_tol(dtype))
  np.testing.assert_allclose(np.asarray(gb, np.float32), np.asarray(_at(rb, b), np.float32), **_tol(dtype))


def test_union_places_both_on_the_same_sites():
  a, b = _pair(6)
  b = b.replace(feats=jnp.concatenate([b.feats, b.feats[:, :1]], axis=1))  # channels may differ
  ua, ub = jsparse.union(a, b)
  assert ua.coords is ub.coords and ua.num_channels == 3 and ub.num_channels == 4
  np.testing.assert_array_equal(np.asarray(ua.todense()), np.asarray(a.todense()))
  np.testing.assert_array_equal(np.asarray(ub.todense()), np.asarray(b.todense()))
  both = jsparse.concat(ua, ub)
  assert both.num_channels == 7
  # A tensor's union with itself is itself (on sorted rows).
  same, _ = jsparse.union(a, a, capacity=a.capacity)
  np.testing.assert_array_equal(np.asarray(same.todense()), np.asarray(a.todense()))
  assert int(same.num) == int(a.num)


def test_union_overflow_under_jit():
  a, b = _pair(7)
  count = len(_sites(a) | _sites(b))
  run = jax.jit(lambda a, b, cap: jsparse.add(a, b, capacity=cap, with_overflow=True), static_argnums=2)
  y, flag = run(a, b, count)
  assert not bool(flag) and int(y.num) == count and not bool(jsparse.overflowed(y))
  y, flag = run(a, b, count - 3)
  assert bool(flag) and bool(jsparse.overflowed(y)) and int(y.num) == count - 3
  full = jsparse.add(a, b, capacity="exact")
  np.testing.assert_array_equal(np.asarray(y.coords), np.asarray(full.coords[: count - 3]))  # smallest keys kept
  np.testing.assert_array_equal(np.asarray(y.feats), np.asarray(full.feats[: count - 3]))
  with jsparse.error_checks():
    err, _ = jax.jit(checkify.checkify(lambda a, b: jsparse.multiply(a, b, capacity=count - 1)))(a, b)
  assert "multiply" in err.get() and str(count) in err.get()
  with pytest.raises(ValueError, match="union"):
    jsparse.union(a, b, capacity=count - 1)
  with pytest.raises(TypeError, match="capacity"):
    jax.jit(lambda a, b: jsparse.add(a, b))(a, b)
  flagged = jsparse.add(a.replace(overflow=jnp.array(True)), b)
  assert bool(jsparse.overflowed(flagged))


def test_union_bad_arguments():
  a, b = _pair(8)
  other, _ = _pair(8, shape=(5, 6, 5))
  with pytest.raises(ValueError, match="one grid"):
    jsparse.union(a, other)
  with pytest.raises(ValueError, match="channels"):
    jsparse.add(a, b.replace(feats=b.feats[:, :2]))
  with pytest.raises(ValueError, match="dtype"):
    jsparse.multiply(a, b.replace(feats=b.feats.astype(jnp.float16)))
  with pytest.raises(TypeError, match="b must be"):
    jsparse.add(a, b.feats)


def test_union_on_a_wide_grid():
  shape = (2048, 2048, 1024)  # 2**32 sites: two-word keys
  a = jsparse.SparseTensor.from_coords(np.array([[0, 2000, 5, 1000], [0, 1, 2, 3]]), np.array([[1.0], [2.0]]),
                                       shape, capacity=3)
  b = jsparse.SparseTensor.from_coords(np.array([[0, 1, 2, 3], [0, 2047, 2047, 1023]]), np.array([[10.0], [20.0]]),
                                       shape, capacity=2)
  assert a.key_width == 2
  y = jsparse.add(a, b, capacity=4)
  assert int(y.num) == 3
  np.testing.assert_array_equal(np.asarray(y.coords[:3]), [[0, 1, 2, 3], [0, 2000, 5, 1000], [0, 2047, 2047, 1023]])
  np.testing.assert_array_equal(np.asarray(y.feats[:, 0]), [12.0, 1.0, 20.0, 0.0])


# ---- broadcast_per_item, child_labels ------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, HALF])
def test_broadcast_per_item(dtype):
  x, _ = _pair(9, batch_size=3)
  values = jnp.asarray(np.random.default_rng(9).normal(size=(3, 5)), dtype)
  y = jax.jit(jsparse.broadcast_per_item)(x, values)
  item = np.asarray(x.coords[:, 0])
  expected = np.where(np.asarray(x.valid_mask())[:, None], np.asarray(values, np.float32)[np.maximum(item, 0)], 0)
  assert y.dtype == dtype and y.num_channels == 5
  np.testing.assert_array_equal(np.asarray(y.feats, np.float32), expected)
  np.testing.assert_array_equal(np.asarray(y.coords), np.asarray(x.coords))
  cot = jnp.asarray(np.random.default_rng(10).normal(size=y.feats.shape), dtype)
  (g,) = jax.vjp(lambda v: jsparse.broadcast_per_item(x, v).feats, values)[1](cot)
  ref = np.zeros((3, 5))
  valid = np.asarray(x.valid_mask())
  np.add.at(ref, item[valid], np.asarray(cot, np.float32)[valid])
  np.testing.assert_allclose(np.asarray(g, np.float32), ref, **_tol(dtype))
  with pytest.raises(ValueError, match="batch_size=3"):
    jsparse.broadcast_per_item(x, values[:2])
  with pytest.raises(TypeError, match="floating"):
    jsparse.broadcast_per_item(x, jnp.ones((3, 2), jnp.int32))


@pytest.mark.parametrize("shape, stride", [((6, 4, 8), 2), ((7, 5, 6), 2), ((6, 6, 3), (3, 2, 1))])
def test_child_labels_match_dense(shape, stride):
  fine, _ = _pair(11, shape=shape)
  st = (stride,) * 3 if isinstance(stride, int) else stride
  coarse = jsparse.nn.SparseConv3d(2, kernel_size=st, strides=st, padding="SAME")
  coarse = coarse.apply(coarse.init(jax.random.key(0), fine), fine)
  labels = jax.jit(jsparse.child_labels, static_argnums=2)(coarse, fine, stride)
  t = int(np.prod(st))
  assert labels.shape == (coarse.capacity, t) and labels.dtype == jnp.bool_
  occupied = np.asarray(fine.replace(feats=jnp.ones_like(fine.feats)).todense()[..., 0] > 0)
  expected = np.zeros((coarse.capacity, t), bool)
  for row in range(int(coarse.num)):
    b, *c = np.asarray(coarse.coords[row]).tolist()
    for child, off in enumerate(np.ndindex(*st)):
      p = np.asarray(c) * st + off
      if np.all(p < shape):
        expected[row, child] = occupied[b, p[0], p[1], p[2]]
  np.testing.assert_array_equal(np.asarray(labels), expected)
  assert expected[: int(coarse.num)].any(axis=1).all()  # every coarse site has a child (it came from fine)
  # The labels as the transposed convolution's mask spawn exactly fine's sites.
  w = jnp.ones(st + (coarse.num_channels, 1))
  spawned = jsparse.sparse_conv_transpose3d(coarse, w, stride=st, mask=labels)
  assert _sites(spawned) == _sites(fine)
  with pytest.raises(ValueError, match="grid"):
    jsparse.child_labels(fine, fine, stride)
  # A coarse grid rounded down (padding 0 on an odd extent): children past fine's grid are not asked about.
  pooled = jsparse.sparse_max_pool3d(fine, st)
  itself = np.asarray(jsparse.child_labels(fine, fine, 1))  # stride 1: every site is its own single child
  assert itself[: int(fine.num)].all() and not itself[int(fine.num):].any()
  down = jsparse.child_labels(pooled, fine, stride)
  assert np.asarray(down).sum() == sum(1 for c in _sites(fine) if all(
      v < (n // s) * s for v, n, s in zip(c[1:], shape, st)))


def test_child_labels_of_windows_that_miss_children_raise():
  """A "SAME" down-sampling by 3 of a 7-wide grid pads one cell before it: coarse site c is made by fine sites
  3c - 1 .. 3c + 1, while its labels name 3c .. 3c + 2. The labels were returned without a word, and as the
  transposed convolution's mask they did not spawn fine's sites. That now raises (jitted too); windows that hold
  their site's children (kernel 3, stride 2, padding 1; kernel = stride) still label every fine site."""
  fine = jsparse.SparseTensor.from_coords(np.array([[0, 2, 2, 2], [0, 6, 0, 5]]), np.ones((2, 3), np.float32),
                                          (7, 7, 7))
  down = jsparse.nn.SparseConv3d(1, kernel_size=3, strides=3, padding="SAME", out_capacity=8, implementation="xla")
  variables = down.init(jax.random.key(0), fine)
  coarse = down.apply(variables, fine)
  assert coarse.spatial_shape == (3, 3, 3)
  labels = jsparse.child_labels(coarse.replace(coords=coarse.coords), fine, 3)  # without its map: not checked
  spawned = jsparse.sparse_conv_transpose3d(coarse, jnp.ones((3, 3, 3, 1, 1)), stride=3, mask=labels)
  assert _sites(spawned) != _sites(fine)  # what the labels of such a coarse tensor would have made
  with pytest.raises(ValueError, match="child_labels: coarse was made from fine .* padding=\\(1, 1, 1\\)"):
    jsparse.child_labels(coarse, fine, 3)
  with pytest.raises(ValueError, match="child_labels: coarse was made from fine"):
    jax.jit(lambda f: jsparse.child_labels(down.apply(variables, f), f, 3))(fine)
  fine, _ = _pair(5, shape=(7, 7, 7), batch_size=1)
  for kernel, padding in ((3, 1), (2, 0)):
    coarse = jsparse.sparse_conv3d(fine, jnp.ones((kernel,) * 3 + (fine.num_channels, 1)), stride=2, padding=padding,
                                   implementation="xla")
    labels = jsparse.child_labels(coarse, fine, 2)
    spawned = jsparse.sparse_conv_transpose3d(coarse, jnp.ones((2, 2, 2, 1, 1)), stride=2, mask=labels)
    assert _sites(spawned) == {c for c in _sites(fine) if all(v < 2 * n for v, n in zip(c[1:], coarse.spatial_shape))}


# ---- dropout -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, HALF])
def test_dropout(dtype):
  x, _ = _pair(12, shape=(8, 8, 8), channels=16, dtype=dtype)
  assert jsparse.dropout(x, 0.3, deterministic=True) is x
  y = jax.jit(lambda x, k: jsparse.dropout(x, 0.3, rng=k))(x, jax.random.key(1))
  f, g = np.asarray(x.feats, np.float32), np.asarray(y.feats, np.float32)
  valid = np.asarray(x.valid_mask())
  kept = g[valid] != 0
  assert abs(kept.mean() - 0.7) < 0.03 and y.dtype == dtype
  np.testing.assert_array_equal(np.asarray(y.coords), np.asarray(x.coords))
  np.testing.assert_allclose(g[valid][kept], f[valid][kept] / 0.7, **_tol(dtype))
  assert np.all(g[~valid] == 0)
  # Gradient: the same mask and scale.
  (grad,) = jax.vjp(lambda f: jsparse.dropout(x.replace(feats=f), 0.3, rng=jax.random.key(1)).feats, x.feats)[1](
      jnp.ones_like(x.feats))
  np.testing.assert_allclose(np.asarray(grad, np.float32), np.where(g != 0, 1 / 0.7, 0), **_tol(dtype))
  assert np.all(np.asarray(jsparse.dropout(x, 1.0, rng=jax.random.key(0)).feats) == 0)
  with pytest.raises(ValueError, match="rng"):
    jsparse.dropout(x, 0.5)
  with pytest.raises(ValueError, match="rate"):
    jsparse.dropout(x, 1.5, rng=jax.random.key(0))


def test_sparse_dropout_module():
  x, _ = _pair(13, channels=8)
  module = snn.SparseDropout(0.5)
  assert module.apply({}, x, deterministic=True) is x
  a = module.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(0)})
  b = jsparse.dropout(x, 0.5, rng=jax.random.key(0))
  c = module.apply({}, x, deterministic=False, rngs={"dropout": jax.random.key(1)})
  # Flax folds the module path into the stream: the same key gives one mask, another key another.
  assert a.feats.shape == b.feats.shape and not np.array_equal(np.asarray(a.feats), np.asarray(c.feats))
  dense_mask = nn.Dropout(0.5).apply({}, jnp.ones_like(x.feats), deterministic=False,
                                     rngs={"dropout": jax.random.key(0)})
  np.testing.assert_array_equal(np.asarray(a.feats != 0), np.asarray(dense_mask != 0) & np.asarray(x.feats != 0))
  with pytest.raises(Exception, match="deterministic"):
    module.apply({}, x)


def test_empty_tensors():
  empty = jsparse.SparseTensor.from_coords(np.zeros((0, 4), np.int32), np.zeros((0, 2), np.float32), (4, 4, 4),
                                           capacity="exact")
  padded = jsparse.SparseTensor.from_coords(np.zeros((0, 4), np.int32), np.zeros((0, 2), np.float32), (4, 4, 4),
                                            capacity=3)
  one = jsparse.SparseTensor.from_coords(np.array([[0, 1, 2, 3]]), np.full((1, 2), 5.0, np.float32), (4, 4, 4),
                                         capacity=2)
  assert jsparse.select(empty, jnp.zeros((0,), bool)).capacity == 0
  assert int(jsparse.select(padded, jnp.ones((3,), bool)).num) == 0
  y = jsparse.add(empty, one, capacity=2)
  np.testing.assert_array_equal(np.asarray(y.todense()), np.asarray(one.todense()))
  assert int(jsparse.multiply(padded, padded, capacity=4).num) == 0
  g = jax.grad(lambda f: jsparse.add(one.replace(feats=f), empty, capacity=2).feats.sum())(one.feats)
  np.testing.assert_array_equal(np.asarray(g), [[1.0, 1.0], [0.0, 0.0]])
  assert jsparse.broadcast_per_item(empty, jnp.ones((1, 3))).feats.shape == (0, 3)
  assert jsparse.child_labels(jsparse.sparse_max_pool3d(empty, 2, out_capacity=0), empty).shape == (0, 8)


def test_dropout_takes_numpy_rates():
  # np.float32(0.5) is a number in [0, 1], but the isinstance(rate, (int, float)) check refused it with
  # "rate must be a number in [0, 1]".
  x, _ = _pair(14, channels=8)
  for rate in (np.float32(0.5), np.float16(0.5), np.int64(0)):
    y = jsparse.dropout(x, rate, rng=jax.random.key(0))
    expected = x if float(rate) == 0 else jsparse.dropout(x, 0.5, rng=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(y.feats), np.asarray(expected.feats))
  for rate in (np.float32(1.5), np.nan, np.bool_(True), True, "0.5"):
    with pytest.raises(ValueError, match="rate"):
      jsparse.dropout(x, rate, rng=jax.random.key(0))
  from jsparse import nnx as snnx
  from flax import nnx
  module = snnx.SparseDropout(np.float32(0.5), rngs=nnx.Rngs(dropout=0))
  assert module.rate == 0.5 and isinstance(module.rate, float)
  with pytest.raises(ValueError, match="rate"):
    snnx.SparseDropout(np.float32(2.0), rngs=nnx.Rngs(dropout=0))


def test_rows_outside_the_grid_alias_no_site():
  """A row outside the grid (only a tensor built without from_coords' checks holds one) has the linear key of
  another site: (0, 0, 0, 5) on a 4^3 grid is (0, 0, 1, 1)'s. add merged it into that site and child_labels
  labelled that site's parent. Eagerly union / add / multiply and child_labels raise ValueError (under jit
  inside error_checks() checkify reports it, as for the maps: test_reliability); under jit the row is dropped
  (the dense reference of the in-grid rows) and its gradient is zero."""
  a = jsparse.SparseTensor(jnp.array([[0, 0, 0, 5], [0, 2, 2, 2]], jnp.int32), jnp.array([[1.0], [3.0]]),
                           jnp.array(2), (4, 4, 4), 1)
  b = jsparse.SparseTensor.from_coords(np.array([[0, 0, 1, 1]]), np.array([[5.0]], np.float32), (4, 4, 4))
  with pytest.raises(ValueError, match="add: a has 1 valid rows whose coordinates lie outside the grid"):
    jsparse.add(a, b)  # union and multiply run the same checks
  inside = jsparse.SparseTensor.from_coords(np.array([[0, 2, 2, 2]]), np.array([[3.0]], np.float32), (4, 4, 4))
  expected = np.asarray(inside.todense() + b.todense())

  def dense_and_grad(feats):  # one program: values and the gradient of their sum
    out, pullback = jax.vjp(lambda f: jsparse.add(a.replace(feats=f), b, capacity=4).todense(), feats)
    return out, pullback(jnp.ones_like(out))[0]

  out, grad = jax.jit(dense_and_grad)(a.feats)
  np.testing.assert_array_equal(np.asarray(out), expected)
  np.testing.assert_array_equal(np.asarray(grad), [[0.0], [1.0]])

  coarse = jsparse.SparseTensor.from_coords(np.array([[0, 0, 0, 0]]), np.ones((1, 1), np.float32), (2, 2, 2))
  with pytest.raises(ValueError, match="1 valid rows whose coordinates lie outside the grid"):
    jsparse.child_labels(coarse, a)
  labels = jax.jit(jsparse.child_labels)(coarse, a)
  np.testing.assert_array_equal(np.asarray(labels[0]), np.zeros(8, bool))  # (0, 0, 1, 1) is not a site of a


def test_union_reports_rows_that_repeat_a_site():
  """A repeated site (a directly built tensor) put one of its rows on the union and dropped the other's values,
  while the gradient reached both: union / add report it, ValueError eagerly and checkify under jit inside
  error_checks()."""
  a = jsparse.SparseTensor(jnp.array([[0, 1, 1, 1], [0, 1, 1, 1], [0, 2, 2, 2]], jnp.int32),
                           jnp.array([[1.0], [2.0], [3.0]]), jnp.array(3), (4, 4, 4), 1)
  b = jsparse.SparseTensor.from_coords(np.array([[0, 3, 3, 3]]), np.array([[5.0]], np.float32), (4, 4, 4))
  with pytest.raises(ValueError, match="union: a has 1 valid rows that repeat an earlier row's coordinates"):
    jsparse.union(a, b)
  with pytest.raises(ValueError, match="add: b has 1 valid rows that repeat an earlier row's coordinates"):
    jsparse.add(b, a)
  checked = jax.jit(checkify.checkify(lambda a, b: jsparse.add(a, b, capacity=4).feats))
  with jsparse.error_checks():
    err, _ = checked(a, b)
    assert "repeat an earlier row's coordinates" in str(err.get())
    err, feats = checked(a.replace(coords=a.coords.at[1].set(jnp.array([0, 1, 2, 1], jnp.int32))), b)
  assert err.get() is None  # distinct sites pass
  np.testing.assert_array_equal(np.asarray(feats), [[1.0], [2.0], [3.0], [5.0]])


def test_dropout_names_a_traced_rate_and_takes_a_concrete_jax_scalar():
  # A rate traced by jit was refused with "rate must be a number in [0, 1], got JitTracer(...)", which reads as
  # if 0.5 were out of range; a concrete jnp.float32(0.5) was refused the same way.
  x, _ = _pair(15, channels=8)
  with pytest.raises(TypeError, match="rate must be a static number.*traced"):
    jax.jit(lambda r: jsparse.dropout(x, r, rng=jax.random.key(0)).feats)(0.5)
  y = jsparse.dropout(x, jnp.float32(0.5), rng=jax.random.key(0))
  np.testing.assert_array_equal(np.asarray(y.feats), np.asarray(jsparse.dropout(x, 0.5, rng=jax.random.key(0)).feats))
  with pytest.raises(ValueError, match="rate"):
    jsparse.dropout(x, jnp.asarray(True), rng=jax.random.key(0))
