"""Strided, inverse and transposed sparse convolutions, pooling and concat against dense computations."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import jsparse
from jsparse import dispatch
from jsparse.neighbors import as_triple
from jsparse.pool import global_pool, sparse_avg_pool3d, sparse_max_pool3d
from jsparse.sparse_conv import (
    concat, pair_map, sparse_conv3d, sparse_conv_transpose3d, sparse_inverse_conv3d, strided_map)
from reference import random_sparse, rel_err

DN = ("NDHWC", "DHWIO", "NDHWC")
HI = lax.Precision.HIGHEST

# (spatial_shape, batch, kernel_size, stride, padding, dilation, cin, cout, bias)
CASES = [
    ((7, 5, 6), 2, (3, 3, 3), 2, 1, 1, 3, 4, True),
    ((8, 6, 5), 2, (2, 2, 2), 2, 0, 1, 4, 3, False),
    ((9, 7, 6), 3, (3, 2, 1), (2, 1, 2), (1, 0, 0), 1, 2, 5, True),
    ((7, 8, 5), 2, (3, 3, 3), 1, 0, (1, 2, 1), 3, 3, True),
    ((6, 5, 7), 2, (1, 1, 1), 2, 0, 1, 3, 2, True),
    ((5, 6, 4), 2, (3, 1, 2), 3, 2, 2, 2, 3, False),
    # Stride, padding and dilation that read differently backwards (the cases above are palindromes in both).
    ((8, 7, 6), 2, (3, 2, 3), (1, 2, 3), (1, 0, 2), (2, 1, 1), 3, 2, True),
]


def _w(rng, shape):
  return jnp.asarray(rng.standard_normal(shape).astype(np.float32) / np.sqrt(np.prod(shape[:-1])))


def _dense_conv(dense, w, stride, padding, dilation):
  return lax.conv_general_dilated(dense, w, as_triple(stride, "s"), [(p, p) for p in as_triple(padding, "p")],
                                  rhs_dilation=as_triple(dilation, "d"), dimension_numbers=DN, precision=HI)


def _at(dense, t: jsparse.SparseTensor):
  """dense [B, X, Y, Z, C] read at t's valid sites, zeros at padding rows."""
  valid = t.valid_mask()
  c = jnp.where(valid[:, None], t.coords, 0)
  return jnp.where(valid[:, None], dense[c[:, 0], c[:, 1], c[:, 2], c[:, 3]], 0)


def _values_and_grads(fn, args, cot):
  """fn's output and the gradients of sum(output * cot) w.r.t. every arg, from one jitted program: one compilation
  is cheaper on the CPU than dispatching every primitive eagerly, and than compiling the values apart."""
  def loss(*a):
    y = fn(*a)
    return jnp.sum((y.feats if isinstance(y, jsparse.SparseTensor) else y) * cot), y

  (_, y), grads = jax.jit(jax.value_and_grad(loss, tuple(range(len(args))), has_aux=True))(*args)
  return y, grads


def _check_grads(sparse_fn, dense_fn, args, cot, tol=1e-5):
  """Gradients of sparse_fn against dense_fn; returns both sides' values (from the same programs)."""
  ys, gs = _values_and_grads(sparse_fn, args, cot)
  yd, gd = _values_and_grads(dense_fn, args, cot)
  for a, r in zip(gs, gd):
    assert rel_err(a, r) < tol
  return ys, yd


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_sparse_conv3d_matches_dense(case):
  shape, batch, ks, st, pad, dil, cin, cout, use_bias = case
  rng = np.random.default_rng(abs(hash(case)) % 2**32)
  x = random_sparse(rng, shape, cin, batch_size=batch, density=0.25, pad=5)
  w = _w(rng, ks + (cin, cout))
  b = _w(rng, (1, cout))[0] if use_bias else None
  y = sparse_conv3d(x, w, b, stride=st, padding=pad, dilation=dil, out_capacity="exact", precision="highest")
  # Output sites: exactly the positions whose window holds an active input, sorted by key, no duplicates.
  # The dense references run jitted: one compilation each instead of one per eager primitive.
  hits = jax.jit(lambda x: _dense_conv((x.todense() != 0).any(-1, keepdims=True).astype(jnp.float32),
                                       jnp.ones(ks + (1, 1)), st, pad, dil)[..., 0] > 0)(x)
  n = int(y.num)
  assert y.spatial_shape == hits.shape[1:] and n == int(hits.sum()) and y.capacity == n
  c = np.asarray(y.coords[:n])
  assert np.all(np.asarray(hits)[c[:, 0], c[:, 1], c[:, 2], c[:, 3]])
  keys = np.asarray(y.linear_keys()[:n])
  assert np.all(np.diff(keys) > 0)
  # Values and gradients, under jit at a larger static capacity (one program for both): padding rows are zero
  # and -1, the valid rows those of the exact output.
  bb = jnp.zeros(cout) if b is None else b
  sparse_fn = lambda f, w, bb: sparse_conv3d(x.replace(feats=f), w, bb, stride=st, padding=pad, dilation=dil,
                                             out_capacity=n + 7, precision="highest")
  cot = jnp.asarray(rng.standard_normal((n + 7, cout)).astype(np.float32))
  y2, grads = _values_and_grads(sparse_fn, (x.feats, w, bb), cot)
  assert int(y2.num) == n and np.array_equal(np.asarray(y2.coords[:n]), c)
  assert np.all(np.asarray(y2.feats[n:]) == 0) and np.all(np.asarray(y2.coords[n:]) == -1)
  assert rel_err(y2.feats[:n], y.feats) < 1e-6
  dense_fn = lambda f, w, bb: _at(_dense_conv(x.replace(feats=f).todense(), w, st, pad, dil) + bb, y2)
  want, ref = _values_and_grads(dense_fn, (x.feats, w, bb), cot)
  assert rel_err(y.feats, want[:n]) < 1e-5
  for a, r in zip(grads, ref):
    assert rel_err(a, r) < 1e-5


# A unit-stride, padded convolution whose output has more sites than its input: the inverse's input gradient
# (over the forward map, one row per site of y) must run over all of y's rows, not like's count of them.
MORE_OUTPUTS = ((6, 5, 7), 2, (3, 1, 3), 1, 1, 1, 3, 2, True)
INVERSE_CASES = CASES[:4] + [MORE_OUTPUTS]


@pytest.mark.parametrize("case", INVERSE_CASES, ids=[str(i) for i in range(len(INVERSE_CASES))])
def test_inverse_conv_matches_dense_transpose(case):
  shape, batch, ks, st, pad, dil, cin, cout, use_bias = case
  rng = np.random.default_rng(1 + abs(hash(case)) % 2**32)
  x = random_sparse(rng, shape, cin, batch_size=batch, density=0.25, pad=5)
  y = sparse_conv3d(x, _w(rng, ks + (cin, cout)), stride=st, padding=pad, dilation=dil)
  if case == MORE_OUTPUTS:
    assert int(y.num) > int(x.num)
  y = y.replace(feats=jnp.where(y.valid_mask()[:, None], rng.standard_normal(y.feats.shape).astype(np.float32), 0))
  c2 = 3
  w = _w(rng, ks + (cout, c2))
  b = _w(rng, (1, c2))[0]

  def dense_fn(fy, w, b):
    # The gradient of the dense convolution with the kernel's channel axes swapped.
    zeros = jnp.zeros(x.todense().shape[:-1] + (c2,))
    _, vjp = jax.vjp(lambda d: _dense_conv(d, jnp.swapaxes(w, 3, 4), st, pad, dil), zeros)
    return _at(vjp(y.replace(feats=fy).todense())[0] + b, x)

  def sparse_fn(fy, w, b, yy=y):
    return sparse_inverse_conv3d(yy.replace(feats=fy), w, b, like=x, stride=st, padding=pad, dilation=dil,
                                 precision="highest").feats

  cot = jnp.asarray(rng.standard_normal((x.capacity, c2)).astype(np.float32))
  out, want = _check_grads(sparse_fn, dense_fn, (y.feats, w, b), cot)
  assert rel_err(out, want) < 1e-5
  # Without the cached map (recomputed by search), and with y's rows shuffled, the result is the same (one jitted
  # program for both: neither tensor carries a cache).
  no_cache = jax.jit(sparse_fn)
  assert rel_err(no_cache(y.feats, w, b, y.replace(caches={})), out) < 1e-6
  perm = jnp.asarray(np.concatenate([rng.permutation(int(y.num)), np.arange(int(y.num), y.capacity)]))
  shuffled = jsparse.SparseTensor(y.coords[perm], y.feats[perm], y.num, y.spatial_shape, y.batch_size)
  assert rel_err(no_cache(shuffled.feats, w, b, shuffled), out) < 1e-6


def test_inverse_conv_finds_the_map_through_submconv_layers(monkeypatch):
  rng = np.random.default_rng(3)
  x = random_sparse(rng, (8, 7, 6), 2, batch_size=2, density=0.3)
  y = sparse_conv3d(x, _w(rng, (2, 2, 2, 2, 4)), stride=2)
  y = jsparse.submconv3d(y, _w(rng, (3, 3, 3, 4, 4)))
  import jsparse.sparse_conv as sc
  monkeypatch.setattr(sc, "sorted_site_keys", lambda *_: pytest.fail("the cached map was not used"))
  z = sparse_inverse_conv3d(y, _w(rng, (2, 2, 2, 4, 3)), like=x, stride=2)
  assert z.capacity == x.capacity and z.caches.keys() == x.caches.keys()
  with pytest.raises(ValueError, match="output grid"):
    sparse_inverse_conv3d(y, _w(rng, (3, 3, 3, 4, 3)), like=x, stride=1)


@pytest.mark.parametrize("stride", [2, (2, 1, 3)], ids=str)
def test_conv_transpose_matches_dense(stride):
  rng = np.random.default_rng(4)
  st = as_triple(stride, "s")
  x = random_sparse(rng, (4, 5, 3), 3, batch_size=2, density=0.3, pad=4)
  w, b = _w(rng, st + (3, 4)), _w(rng, (1, 4))[0]
  t = int(np.prod(st))
  mask = jnp.asarray(rng.random((x.capacity, t)) < 0.6)
  for m in (None, mask):
    y = sparse_conv_transpose3d(x, w, b, stride=stride, mask=m, out_capacity="exact", precision="highest")
    keep = np.asarray(x.valid_mask())[:, None] & (np.ones((1, t), bool) if m is None else np.asarray(m))
    assert int(y.num) == keep.sum() == y.capacity
    assert y.spatial_shape == tuple(s * k for s, k in zip(x.spatial_shape, st))
    # Children: the kept offsets of each parent, all distinct.
    c = np.asarray(y.coords)
    assert len({tuple(r) for r in c.tolist()}) == len(c)
    pc = np.asarray(x.coords)
    assert np.all(c[:, 1:] // np.asarray(st) >= 0)

    def dense_fn(f, w, b):
      d = lax.conv_transpose(x.replace(feats=f).todense(), w[::-1, ::-1, ::-1], st, "VALID", dimension_numbers=DN,
                             precision=HI)
      return _at(d + b, y)

    def sparse_fn(f, w, b):
      return sparse_conv_transpose3d(x.replace(feats=f), w, b, stride=stride, mask=m, out_capacity=y.capacity,
                                     precision="highest").feats

    parents = {tuple(r) for r in pc[keep.any(1)].tolist()}
    assert {(r[0], *(np.asarray(r[1:]) // st)) for r in c.tolist()} == parents
    cot = jnp.asarray(rng.standard_normal((y.capacity, 4)).astype(np.float32))
    out, want = _check_grads(sparse_fn, dense_fn, (x.feats, w, b), cot)
    assert rel_err(y.feats, want) < 1e-5 and rel_err(out, y.feats) < 1e-6


@pytest.mark.parametrize("ks,st,pad,dil", [(2, 2, 0, 1), ((3, 2, 3), (2, 1, 2), (1, 0, 1), 1), (3, 1, 1, 2)])
def test_pools_match_dense(ks, st, pad, dil):
  rng = np.random.default_rng(5)
  x = random_sparse(rng, (7, 6, 5), 3, batch_size=2, density=0.3, pad=3)
  ks3, st3, pad3, dil3 = (as_triple(v, "") for v in (ks, st, pad, dil))
  window = dict(window_dimensions=(1,) + ks3 + (1,), window_strides=(1,) + st3 + (1,),
                padding=((0, 0),) + tuple((p, p) for p in pad3) + ((0, 0),), window_dilation=(1,) + dil3 + (1,))
  active = (x.todense() != 0).any(-1, keepdims=True)

  def dense_max(f):
    d = jnp.where(active, x.replace(feats=f).todense(), -jnp.inf)
    return lax.reduce_window(d, -jnp.inf, lax.max, **window)

  def dense_avg(f):
    s = lax.reduce_window(x.replace(feats=f).todense(), 0.0, lax.add, **window)
    n = lax.reduce_window(active.astype(jnp.float32), 0.0, lax.add, **window)
    return s / jnp.maximum(n, 1)

  for pool, dense in ((sparse_max_pool3d, dense_max), (sparse_avg_pool3d, dense_avg)):
    y = pool(x, ks, st, pad, dil)
    hits = lax.reduce_window(active.astype(jnp.float32), 0.0, lax.add, **window)[..., 0] > 0
    assert int(y.num) == int(hits.sum()) and y.capacity == jsparse.round_capacity(int(y.num))
    assert rel_err(y.feats, _at(dense(x.feats), y)) < 1e-6
    cot = jnp.asarray(rng.standard_normal(y.feats.shape).astype(np.float32))
    if dil == 1 or pool is sparse_avg_pool3d:  # (no reduce_window max gradient with window dilation)
      _check_grads(lambda f: pool(x.replace(feats=f), ks, st, pad, dil, out_capacity=y.capacity).feats,
                   lambda f: _at(dense(f), y),
                   (x.feats,), cot)
  # The pooled output carries the map: unpooling by an inverse convolution reuses it.
  y = sparse_max_pool3d(x, ks, st, pad, dil)
  z = sparse_inverse_conv3d(y, jnp.ones(ks3 + (3, 3)), like=x, stride=st, padding=pad, dilation=dil)
  assert z.feats.shape == x.feats.shape


def test_concat_writes_zeros_at_padding_rows():
  # Every op writes zeros at padding rows; concat copied its inputs' padding, so garbage there (a tensor built
  # by hand) reached a sum of the output as NaN, and a cotangent at padding rows flowed back to the inputs.
  rng = np.random.default_rng(61)
  x = random_sparse(rng, (5, 4, 6), 3, batch_size=2, density=0.3, pad=5)
  y = x.replace(feats=jnp.asarray(rng.standard_normal((x.capacity, 2)), jnp.float32))
  pad = np.arange(x.capacity) >= int(x.num)
  garbage = lambda t: t.replace(feats=jnp.where(pad[:, None], jnp.nan, t.feats))
  xg, yg = garbage(x), garbage(y)
  for run in (concat, jax.jit(concat)):
    out = np.asarray(run(xg, yg).feats)
    np.testing.assert_array_equal(out[pad], 0)
    np.testing.assert_array_equal(out[~pad], np.concatenate([x.feats, y.feats], axis=1)[~pad])
  loss = lambda fa, fb: jnp.sum(concat(xg.replace(feats=fa), yg.replace(feats=fb)).feats ** 2)
  ga, gb = (np.asarray(g) for g in jax.grad(loss, argnums=(0, 1))(xg.feats, yg.feats))
  np.testing.assert_array_equal(ga[pad], 0)
  np.testing.assert_array_equal(gb[pad], 0)
  np.testing.assert_allclose(ga[~pad], 2 * np.asarray(x.feats)[~pad], rtol=1e-6)
  np.testing.assert_allclose(gb[~pad], 2 * np.asarray(y.feats)[~pad], rtol=1e-6)


def test_global_pool_and_concat():
  rng = np.random.default_rng(6)
  x = random_sparse(rng, (5, 4, 6), 3, batch_size=3, density=0.3, pad=4)
  n = int(x.num)
  c, f = np.asarray(x.coords[:n]), np.asarray(x.feats[:n])
  for reduce, fn in (("sum", np.sum), ("mean", np.mean), ("max", np.max)):
    want = np.stack([fn(f[c[:, 0] == b], axis=0) for b in range(3)])
    np.testing.assert_allclose(global_pool(x, reduce), want, rtol=1e-5, atol=1e-6)
  with pytest.raises(ValueError, match="reduce"):
    global_pool(x, "min")
  # An empty batch item pools to zeros.
  lone = jsparse.SparseTensor.from_coords(np.array([[0, 1, 1, 1]]), np.ones((1, 2), np.float32), (4, 4, 4), 2, 3)
  np.testing.assert_array_equal(global_pool(lone, "max"), [[1, 1], [0, 0]])
  # concat
  y = jsparse.submconv3d(x, _w(rng, (3, 3, 3, 3, 2)))
  xy = concat(x, y)
  assert xy.num_channels == 5 and rel_err(xy.feats[:, 3:], y.feats) == 0 and xy.caches.keys() >= y.caches.keys()
  np.testing.assert_array_equal(jax.jit(concat)(x, y).feats, xy.feats)
  other = random_sparse(rng, (5, 4, 6), 2, batch_size=3, density=0.3, pad=4)
  with pytest.raises(ValueError, match="same coordinates"):
    concat(x, other)
  shuffled = x.replace(coords=x.coords[::-1])
  with pytest.raises(ValueError, match="coords"):
    concat(x, shuffled.replace(feats=shuffled.feats[:, :2]))


def test_overflow_flag_under_jit_and_error_outside():
  rng = np.random.default_rng(7)
  x = random_sparse(rng, (6, 6, 6), 2, batch_size=2, density=0.4)
  n = int(strided_map(x, 3, 2, 1)[1])
  small = jax.jit(lambda x: strided_map(x, 3, 2, 1, out_capacity=n - 1))(x)
  assert bool(small[3]) and int(small[1]) == n - 1
  exact = jax.jit(lambda x: strided_map(x, 3, 2, 1, out_capacity=n))(x)
  assert not bool(exact[3]) and int(exact[1]) == n
  w = _w(rng, (3, 3, 3, 2, 2))
  y, flag = jax.jit(lambda x: sparse_conv3d(x, w, stride=2, padding=1, out_capacity=n - 1, with_overflow=True))(x)
  assert bool(flag) and y.capacity == n - 1
  with pytest.raises(ValueError, match="out_capacity"):
    strided_map(x, 3, 2, 1, out_capacity=n - 1)
  with pytest.raises(ValueError, match="out_capacity"):
    sparse_conv3d(x, w, stride=2, padding=1, out_capacity=n - 1)
  with pytest.raises(ValueError, match="out_capacity"):
    sparse_conv_transpose3d(x, _w(rng, (2, 2, 2, 2, 2)), out_capacity=int(x.num) * 8 - 1)
  with pytest.raises(TypeError, match="out_capacity"):
    jax.jit(lambda x: sparse_conv3d(x, w, stride=2))(x)
  # strided_map's map agrees with a dictionary lookup.
  coords, num, nbr, _ = strided_map(x, (3, 2, 3), (2, 1, 2), (1, 0, 1), 1)
  table = {tuple(r): i for i, r in enumerate(np.asarray(x.coords[:int(x.num)]).tolist())}
  import itertools
  offs = list(itertools.product(range(3), range(2), range(3)))
  for i in range(int(num)):
    b, *o = np.asarray(coords[i]).tolist()
    for v, off in enumerate(offs):
      p = tuple(o[a] * (2, 1, 2)[a] - (1, 0, 1)[a] + off[a] for a in range(3))
      assert nbr[i, v] == table.get((b,) + p, -1)


def test_rows_outside_the_grid_are_reported_and_feed_nothing(monkeypatch):
  """A valid row whose batch index lies outside [0, batch_size), or a coordinate outside [0, extent): from_coords
  refuses it, but the constructor and replace(coords=...) do not look (nor can anything under jit). Every site
  search skips it (XLA sort, occupancy map, hash table: the same output), eagerly it raises ValueError, under jit
  checkify reports it. A row past an axis's extent used to feed the output sites it reached (both paths)."""
  from jax.experimental import checkify

  from pallas_kernels import occupancy_sites

  rng = np.random.default_rng(14)
  x = random_sparse(rng, (7, 6, 5), 3, batch_size=2, density=0.3, pad=4)
  num, coords = int(x.num), np.asarray(x.coords).copy()
  with pytest.raises(ValueError, match="outside batch_size=2"):
    jsparse.SparseTensor.from_coords(np.where(np.arange(num)[:, None] == 0, [2, 0, 0, 0], coords[:num]),
                                     np.asarray(x.feats[:num]), x.spatial_shape, 2)
  bad_rows = [0, 5, num - 1, 2, 3]
  coords[bad_rows[:3], 0] = [2, -1, 9]
  coords[2, 1], coords[3, 2] = 7, -1  # x past its extent 7, y below 0
  bad = x.replace(coords=jnp.asarray(coords))
  keep = np.setdiff1d(np.arange(num), bad_rows)
  good = jsparse.SparseTensor.from_coords(coords[keep], np.asarray(x.feats)[keep], x.spatial_shape, 2)
  w, wt = _w(rng, (3, 3, 3, 3, 4)), _w(rng, (3, 3, 3, 3, 2))
  conv = lambda t, impl, cap: sparse_conv3d(t, w, stride=2, padding=1, out_capacity=cap, implementation=impl,
                                            precision="highest")
  transposed = lambda t, impl, cap: sparse_conv_transpose3d(t, wt, stride=2, padding=1, out_capacity=cap,
                                                            implementation=impl, precision="highest")
  for op, dense in ((conv, lambda d: _dense_conv(d, w, 2, 1, 1)),
                    (transposed, lambda d: lax.conv_transpose(d, wt[::-1, ::-1, ::-1], (2, 2, 2), [(1, 1)] * 3,
                                                              dimension_numbers=DN, precision=HI))):
    ref = op(good, "xla", None)
    for impl in ("xla", "pallas"):
      with pytest.raises(ValueError, match=r"x has 5 valid rows whose coordinates lie outside the grid \(batch in "
                                           r"\[0, batch_size=2\), each axis in \[0, extent\) of \(7, 6, 5\)\)"):
        op(bad, impl, ref.capacity)
    # Under jit: no error, and the output of the tensor without those rows, on every site search.
    for impl, occupancy in (("xla", None), ("pallas", True), ("pallas", False)):
      monkeypatch.setattr(occupancy_sites, "fits", (lambda *a: False) if occupancy is False else occupancy_sites.fits)
      y = jax.jit(lambda t: op(t, impl, ref.capacity))(bad)
      monkeypatch.undo()
      np.testing.assert_array_equal(np.asarray(y.coords), np.asarray(ref.coords))
      assert int(y.num) == int(ref.num) and not bool(y.overflow)
      assert rel_err(y.feats, _at(dense(good.todense()), ref)) < 1e-5
  with jsparse.error_checks():
    err, _ = jax.jit(checkify.checkify(lambda t: conv(t, "pallas", 256).feats))(bad)
  assert "5 valid rows whose coordinates lie outside the grid" in err.get()


def test_bad_inputs():
  rng = np.random.default_rng(8)
  x = random_sparse(rng, (4, 5, 6), 2, batch_size=1, density=0.4)
  with pytest.raises(ValueError, match="empty output grid"):
    sparse_conv3d(x, _w(rng, (5, 3, 3, 2, 2)))
  with pytest.raises(ValueError, match="empty output grid"):
    sparse_max_pool3d(x, 3, 1, 0, dilation=2)
  with pytest.raises(ValueError, match="input channels"):
    sparse_conv3d(x, _w(rng, (3, 3, 3, 3, 2)), stride=2)
  with pytest.raises(ValueError, match="bias"):
    sparse_conv3d(x, _w(rng, (3, 3, 3, 2, 2)), jnp.zeros(3), stride=2)
  with pytest.raises(ValueError, match="stride"):
    sparse_conv3d(x, _w(rng, (3, 3, 3, 2, 2)), stride=0)
  with pytest.raises(ValueError, match="output_padding"):
    sparse_conv_transpose3d(x, _w(rng, (3, 3, 3, 2, 2)), stride=2, output_padding=2)
  with pytest.raises(ValueError, match="mask"):
    sparse_conv_transpose3d(x, _w(rng, (2, 2, 2, 2, 2)), mask=jnp.ones((x.capacity, 4), bool))
  y = sparse_conv3d(x, _w(rng, (3, 3, 3, 2, 3)), stride=2)
  with pytest.raises(ValueError, match="input channels"):
    sparse_inverse_conv3d(y, _w(rng, (3, 3, 3, 2, 2)), like=x, stride=2)


def test_pallas_interpret_matches_xla():
  # Capacities that are not multiples of the GEMM block (64) exercise the partial last block.
  rng = np.random.default_rng(9)
  x = random_sparse(rng, (5, 4, 6), 3, batch_size=2, density=0.3, pad=5)
  w, b = _w(rng, (3, 3, 3, 3, 4)), _w(rng, (1, 4))[0]
  wi = _w(rng, (3, 3, 3, 4, 2))
  wt = _w(rng, (2, 2, 2, 3, 2))

  def run(impl):
    def f(feats, w, b, wi, wt):
      xx = x.replace(feats=feats)
      y = sparse_conv3d(xx, w, b, stride=2, padding=1, out_capacity=x.capacity, implementation=impl,
                        precision="highest")
      z = sparse_inverse_conv3d(y, wi, like=xx, stride=2, padding=1, implementation=impl, precision="highest")
      u = sparse_conv_transpose3d(xx, wt, stride=2, out_capacity=x.capacity * 8, implementation=impl,
                                  precision="highest")
      return jnp.sum(y.feats ** 2) + jnp.sum(z.feats * jnp.arange(2.0)) + jnp.sum(jnp.sin(u.feats)), (y.feats, z.feats,
                                                                                                      u.feats)
    return jax.jit(jax.value_and_grad(f, argnums=(0, 1, 2, 3, 4), has_aux=True))(x.feats, w, b, wi, wt)

  (_, outs_p), grads_p = run("pallas")
  (_, outs_x), grads_x = run("xla")
  for a, r in zip(outs_p + grads_p, outs_x + grads_x):
    assert rel_err(a, r) < 1e-5


_PAIR_MAP_FIELDS = ("out_coords", "out_num", "nbr", "inv", "overflow")


def _assert_same_pair_maps(got, ref):
  for name in _PAIR_MAP_FIELDS:
    np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(ref, name)), err_msg=name)


# (spatial_shape, batch, kernel_size, stride, padding, dilation): CASES' geometries, the first (kernel 3, stride 2,
# padding 1) with a batch of one, as every other case has a batch of two or three.
SITE_CASES = [((6, 7, 5), 1, (3, 3, 3), 2, 1, 1)] + [c[:6] for c in CASES[1:]]


@pytest.mark.parametrize("case", SITE_CASES, ids=[str(i) for i in range(len(SITE_CASES))])
def test_pallas_output_sites_match_xla(case):
  # The Pallas site search (interpret mode here; these small grids take the occupancy map) gives the XLA path's
  # map exactly: rows, order, num, flag.
  shape, batch, ks, st, pad, dil = case
  rng = np.random.default_rng(abs(hash(case)) % 2**32)
  x = random_sparse(rng, shape, 1, batch_size=batch, density=0.2, pad=5)
  ref = pair_map(x, ks, st, pad, dil, implementation="xla")
  _assert_same_pair_maps(pair_map(x, ks, st, pad, dil, implementation="pallas"), ref)
  # Too few rows: the flag and the smallest-keyed sites (check=False: what jit gives), else an error.
  # (Under jit: tests/test_hash_table.py::test_compare_pair_maps_on_sphere_shell_interpret.)
  n = int(ref.out_num)
  small = n - 1 - n // 4
  got, ref = (pair_map(x, ks, st, pad, dil, small, check=False, implementation=impl) for impl in ("pallas", "xla"))
  assert bool(got.overflow) and int(got.out_num) == small
  _assert_same_pair_maps(got, ref)
  with pytest.raises(ValueError, match="out_capacity"):
    pair_map(x, ks, st, pad, dil, small, implementation="pallas")


def test_pallas_output_sites_in_pools():
  rng = np.random.default_rng(12)
  x = random_sparse(rng, (6, 5, 7), 2, batch_size=2, density=0.3, pad=3)
  for pool in (sparse_max_pool3d, sparse_avg_pool3d):
    got, ref = (pool(x, 2, implementation=impl) for impl in ("pallas", "xla"))
    np.testing.assert_array_equal(np.asarray(got.coords), np.asarray(ref.coords))
    np.testing.assert_array_equal(np.asarray(got.feats), np.asarray(ref.feats))


def test_new_pallas_paths_lower_to_triton():
  from triton_lowering import lower_for_cuda

  from jsparse.map_gemm import ConvMaps, ConvSpec, map_gemm

  spec_gpu = ConvSpec((3, 3, 3), (1, 1, 1), dispatch.Implementation("pallas", interpret=False))
  spec = jax.ShapeDtypeStruct
  m, r, v, cin, cout = 1000, 3000, 27, 32, 64
  for dtype in (jnp.float16, jnp.float32):
    def loss(feats, w, b, nbr, transposed):
      out = map_gemm(feats, w, b, ConvMaps(nbr, jnp.int32(900), transposed, jnp.int32(2900)), spec_gpu)
      return jnp.sum(out.astype(jnp.float32))

    # Rectangular maps (M != R rows): forward over nbr, input gradient over the transposed map.
    text = lower_for_cuda(jax.value_and_grad(loss, argnums=(0, 1, 2)), spec((r, cin), dtype),
                          spec((v, cin, cout), dtype), spec((cout,), dtype), spec((m, v), jnp.int32),
                          spec((r, v), jnp.int32))
    assert text.count("__gpu$xla.gpu.triton") >= 3
    assert all(name in text for name in ('"gather_gemm"', '"gather_gemm_t"', '"weight_grad"'))


def test_flax_modules():
  from jsparse.nn.sparse_conv_layers import (
      SparseAvgPool3d, SparseConv3d, SparseConvTranspose3d, SparseInverseConv3d, SparseMaxPool3d)
  import flax.linen as nn

  rng = np.random.default_rng(10)
  x = random_sparse(rng, (8, 6, 7), 3, batch_size=2, density=0.3)
  conv = SparseConv3d(5, kernel_size=3, strides=2, padding=1)
  params = conv.init(jax.random.key(0), x)
  assert params["params"]["kernel"].shape == (3, 3, 3, 3, 5) and params["params"]["bias"].shape == (5,)
  y = conv.apply(params, x)
  dense = nn.Conv(5, (3, 3, 3), strides=2, padding=[(1, 1)] * 3, precision=HI).apply(params, x.todense())
  assert rel_err(y.feats, _at(dense, y)) < 1e-5
  inv = SparseInverseConv3d(4, kernel_size=3, strides=2, padding=1)
  p2 = inv.init(jax.random.key(1), y, like=x)
  z = inv.apply(p2, y, like=x)
  assert p2["params"]["kernel"].shape == (3, 3, 3, 5, 4) and z.feats.shape == (x.capacity, 4)
  up = SparseConvTranspose3d(2, strides=2)
  p3 = up.init(jax.random.key(2), x)
  u = up.apply(p3, x, mask=jnp.ones((x.capacity, 8), bool))
  assert p3["params"]["kernel"].shape == (2, 2, 2, 3, 2) and int(u.num) == int(x.num) * 8
  assert SparseMaxPool3d(2).apply({}, x).spatial_shape == (4, 3, 3)
  assert SparseAvgPool3d(2, padding="VALID").apply({}, x).spatial_shape == (4, 3, 3)
  with pytest.raises(ValueError, match="padding"):
    SparseConv3d(5, 3, padding="FULL").init(jax.random.key(0), x)  # "SAME" is the default (tests/test_sequential.py)
  jitted = jax.jit(lambda p, x: SparseConv3d(5, 3, 2, 1, out_capacity=y.capacity).apply(p, x))(params, x)
  assert rel_err(jitted.feats, y.feats) < 1e-6


@pytest.mark.parametrize("dtype,tol", [(jnp.float16, 2e-3), (jnp.bfloat16, 2e-2)], ids=["f16", "bf16"])
def test_half_precision(dtype, tol):
  rng = np.random.default_rng(11)
  x = random_sparse(rng, (6, 7, 5), 4, batch_size=2, density=0.3)
  w = _w(rng, (3, 3, 3, 4, 5))
  y = sparse_conv3d(x, w, stride=2, padding=1, precision="highest")
  yh = sparse_conv3d(x.replace(feats=x.feats.astype(dtype)), w, stride=2, padding=1)
  assert yh.dtype == dtype and rel_err(yh.feats.astype(jnp.float32), y.feats) < tol


def test_jitted_down_up_chain_uses_the_carried_map():
  rng = np.random.default_rng(12)
  x = random_sparse(rng, (8, 6, 7), 3, batch_size=2, density=0.3)
  wd, ws, wu = _w(rng, (2, 2, 2, 3, 4)), _w(rng, (3, 3, 3, 4, 4)), _w(rng, (2, 2, 2, 4, 3))
  cap = jsparse.round_capacity(int(strided_map(x, 2, 2)[1]))

  def net(x, wd, ws, wu):
    y = sparse_conv3d(x, wd, stride=2, out_capacity=cap)
    y = jsparse.submconv3d(y, ws)
    z = sparse_inverse_conv3d(y, wu, like=x, stride=2)
    return concat(x, z).feats

  eager = net(x, wd, ws, wu)
  assert rel_err(jax.jit(net)(x, wd, ws, wu), eager) < 1e-5
  g = jax.jit(jax.grad(lambda *a: jnp.sum(net(*a) ** 2), argnums=(1, 2, 3)))(x, wd, ws, wu)
  assert all(np.isfinite(np.asarray(a)).all() for a in g)


def test_every_algorithm_reads_the_transposed_maps_unflipped():
  """The input gradient of strided, inverse and transposed convolutions runs over the transposed map as it is
  (t[j, v] = i iff nbr[i, v] = j, offset v with W_v^T): every algorithm's gradients equal JAX's autodiff of the
  XLA path, an anisotropic kernel and stride included (a reversed offset order would pair the wrong weights)."""
  rng = np.random.default_rng(13)
  x = random_sparse(rng, (7, 6, 5), 3, batch_size=2, density=0.35, pad=3)
  w, wi, wt = _w(rng, (3, 2, 1, 3, 4)), _w(rng, (3, 2, 1, 4, 2)), _w(rng, (2, 1, 3, 3, 2))
  cot = jnp.asarray(rng.standard_normal((x.capacity, 2)).astype(np.float32))

  def run(impl, algo):
    def f(feats, w, wi, wt):
      xx = x.replace(feats=feats)
      kw = dict(implementation=impl, precision="highest", algorithm=algo)
      y = sparse_conv3d(xx, w, stride=(2, 1, 2), padding=(1, 0, 0), out_capacity=x.capacity, **kw)
      z = sparse_inverse_conv3d(y, wi, like=xx, stride=(2, 1, 2), padding=(1, 0, 0), **kw)
      u = sparse_conv_transpose3d(xx, wt, stride=(1, 2, 1), out_capacity=x.capacity * 4, **kw)
      return jnp.sum(z.feats * cot) + jnp.sum(jnp.sin(u.feats))
    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3)))(x.feats, w, wi, wt)

  want = run("xla", "auto")  # compiled once for the three algorithms
  for algorithm in ("explicit", "masked", "implicit_splitk"):
    for a, r in zip(run("pallas", algorithm), want):
      assert rel_err(a, r) < 1e-5, algorithm


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
def test_input_classes_fix_the_transposed_map_masks(case):
  """Rows of one `input_classes` class feed the same offsets wherever all their proposals lie inside the output
  grid (the property that makes the class a good plan order), and every class's canonical offsets are the
  stride rule's: (position + padding - offset * dilation) divisible by the stride."""
  from jsparse.sparse_conv import geometry, input_classes

  shape, batch, ks, st, pad, dil = case[:6]
  rng = np.random.default_rng(21)
  x = random_sparse(rng, shape, 2, batch_size=batch, density=0.4, pad=6)
  pm = pair_map(x, ks, st, pad, dil, implementation="xla")
  geom = geometry(shape, ks, st, pad, dil)
  classes = np.asarray(input_classes(x.coords, geom))
  inv, num = np.asarray(pm.inv), int(x.num)
  coords = np.asarray(x.coords)[:num, 1:]
  offsets = geom.offsets()  # [V, 3]: a * dilation
  moved = coords[:, None, :] + np.asarray(geom.padding) - offsets[None]  # [rows, V, 3]
  divides = np.all(moved % np.asarray(geom.stride) == 0, axis=2)
  out = moved // np.asarray(geom.stride)
  inside = np.all((out >= 0) & (out < np.asarray(geom.out_shape)), axis=2)
  np.testing.assert_array_equal(inv[:num] >= 0, divides & inside)  # the rule the classes rest on
  interior = np.all(inside | ~divides, axis=1)
  for c in np.unique(classes[:num]):
    rows = np.nonzero((classes[:num] == c) & interior)[0]
    if len(rows):
      masks = inv[rows] >= 0
      assert np.all(masks == masks[0]), (c, len(rows))
  assert classes.dtype == np.uint8 and classes[:num].max() < np.prod(geom.stride)


def test_class_ordered_plans_match_the_reference_and_cover_every_pair():
  """masked_plan with row classes: the kernel builds the reference's plan (interpret mode), valid rows come
  first grouped by class in their original order, and every pair of the map is in its block's lists."""
  from jsparse.sparse_conv import geometry, input_classes
  from pallas_kernels.gemm_plan import masked_plan, masked_plan_reference

  rng = np.random.default_rng(5)
  x = random_sparse(rng, (12, 10, 9), 2, batch_size=2, density=0.5, pad=40)
  geom = geometry(x.spatial_shape, 3, 2, 1, 1)
  pm = pair_map(x, 3, 2, 1, 1, implementation="xla")
  t_map, classes = pm.inv, input_classes(x.coords, geom)
  for block in (16, 64):
    # Both jitted: one program each, rather than their ops compiled one by one.
    got = jax.jit(functools.partial(masked_plan, interpret=True), static_argnums=2)(t_map, x.num, block,
                                                                                   row_classes=classes)
    want = jax.jit(masked_plan_reference, static_argnums=2)(t_map, x.num, block, row_classes=classes)
    for a, b in zip(got.comparable(), want):
      np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    num, order = int(x.num), np.asarray(got.order)
    c = np.asarray(classes)[order[:num]]
    assert np.all(np.diff(c.astype(np.int32)) >= 0) and sorted(order[:num]) == list(range(num))
    for k in np.unique(c):  # stable: within a class, rows in their original order
      assert np.all(np.diff(order[:num][c == k]) > 0)
    tm = np.asarray(t_map)
    for b in range(got.block_counts.shape[0]):
      listed = set(np.asarray(got.block_offsets)[b, :int(got.block_counts[b])])
      rows = order[b * block:(b + 1) * block]
      rows = rows[rows < num]
      assert set(np.nonzero(np.any(tm[rows] >= 0, axis=0))[0]) <= listed


def test_masked_plan_rejects_row_classes_not_one_per_row():
  """row_classes must be [capacity], one class per map row: a length-1 array broadcast silently (every row one
  class) and a [capacity, 1] one failed inside the plan kernel with a mask-shape message."""
  from pallas_kernels.gemm_plan import masked_plan, masked_plan_reference

  nbr = jnp.asarray(np.random.default_rng(0).integers(-1, 5, (10, 4)), jnp.int32)
  for classes in (jnp.zeros((11,), jnp.uint8), jnp.zeros((1,), jnp.uint8), jnp.zeros((10, 1), jnp.uint8)):
    with pytest.raises(ValueError, match="row_classes"):
      masked_plan(nbr, jnp.int32(7), 4, row_classes=classes, interpret=True)
    with pytest.raises(ValueError, match="row_classes"):
      masked_plan_reference(nbr, jnp.int32(7), 4, row_classes=classes)
