"""Topology and per-item ops against an independent numpy reference (sets of (batch, site) -> feature rows, compared
by coordinates, not row order) on random tensors built directly with garbage in their padding rows: select, union,
add, multiply, concat, broadcast_per_item, global_pool, dropout, in 3D and 2D, float32 and half types, eagerly, under
jit and vmap, with gradients."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jsparse

_DTYPES = {"float32": jnp.float32, "float16": jnp.float16, "bfloat16": jnp.bfloat16}


def _tensor(rng, shape, batch_size, channels, dtype, *, num=None, pad=None, density=None, sites=None):
  """A directly built SparseTensor: distinct in-grid sites in shuffled rows, then padding rows holding garbage
  coordinates (in and outside the grid) and garbage features (NaN, inf, large values); shape is 3 extents, or 2 for
  a 2D tensor. sites: the (batch, x, y, z) sites to use instead of random ones."""
  ndim = len(shape)
  lifted = (1,) * (3 - ndim) + tuple(shape)
  if sites is None:
    density = rng.uniform(0, 1) if density is None else density
    every = np.argwhere(np.ones((batch_size,) + lifted, bool)).astype(np.int32)
    sites = every[rng.random(len(every)) < density]
  sites = np.asarray(sites, np.int32).reshape(-1, 4)
  sites = sites[rng.permutation(len(sites))][: len(sites) if num is None else num]
  n = len(sites)
  pad = int(rng.integers(0, 4)) if pad is None else pad
  garbage = rng.integers(-3, 9, (pad, 4)).astype(np.int32)
  coords = np.concatenate([sites, garbage])
  feats = rng.standard_normal((n + pad, channels)).astype(np.float32)
  feats[n:] = rng.choice(np.array([np.nan, np.inf, -np.inf, 1e4], np.float32), (pad, channels))
  return jsparse.SparseTensor(jnp.asarray(coords), jnp.asarray(feats).astype(dtype), jnp.asarray(n, jnp.int32),
                              lifted, batch_size, spatial_ndim=ndim)


def _rows(x, feats=None):
  """{(batch, x, y, z): float64 feature row} over x's valid rows."""
  n = int(x.num)
  feats = np.asarray((x.feats if feats is None else feats).astype(jnp.float32), np.float64)
  return {tuple(c): feats[i] for i, c in enumerate(np.asarray(x.coords[:n]).tolist())}


def _check_out(out, want: dict, tol, dtype=None, padding_coords=True):
  """out's valid rows are exactly `want` (by site), distinct; padding rows have zero features and, unless the op
  keeps its input's coordinates (padding_coords=False), coords -1."""
  n = int(out.num)
  got = _rows(out)
  assert len(got) == n, "repeated sites in the output"
  assert got.keys() == want.keys()
  for site, row in want.items():
    np.testing.assert_allclose(got[site], row, err_msg=str(site), **tol)
  assert not padding_coords or np.all(np.asarray(out.coords[n:]) == -1)
  assert np.all(np.asarray(out.feats[n:].astype(jnp.float32)) == 0)
  if dtype is not None:
    assert out.dtype == dtype


def _tol(dtype):
  return {"rtol": 1e-6, "atol": 1e-6} if dtype == jnp.float32 else {"rtol": 1e-2, "atol": 1e-2}


def _rounded(value, dtype):
  """A float64 value rounded to dtype, as the op's result in dtype is."""
  return np.asarray(jnp.asarray(value, jnp.float32).astype(dtype).astype(jnp.float32), np.float64)


_shapes = st.sampled_from([(3, 2, 4), (1, 5, 3), (2, 1, 1), (4, 3), (1, 6)])
_dtypes = st.sampled_from(sorted(_DTYPES))


def _relation(rng, a_sites, how):
  """b's sites for a's: disjoint, identical, nested (a subset), or random."""
  if how == "identical":
    return a_sites
  if how == "nested":
    return a_sites[rng.random(len(a_sites)) < 0.5]
  return None


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=_shapes, batch_size=st.integers(1, 3), dtype=_dtypes,
       how=st.sampled_from(["random", "identical", "nested", "disjoint"]))
def test_union_add_multiply_match_numpy(seed, shape, batch_size, dtype, how):
  rng = np.random.default_rng(seed)
  dtype = _DTYPES[dtype]
  a = _tensor(rng, shape, batch_size, 2, dtype)
  a_sites = np.asarray(a.coords[: int(a.num)])
  if how == "disjoint":  # b on the sites a lacks
    lifted = a.spatial_shape
    every = np.argwhere(np.ones((batch_size,) + lifted, bool)).astype(np.int32)
    taken = {tuple(s) for s in a_sites.tolist()}
    free = np.array([s for s in every.tolist() if tuple(s) not in taken], np.int32).reshape(-1, 4)
    b = _tensor(rng, shape, batch_size, 2, dtype, sites=free[rng.random(len(free)) < 0.5])
  else:
    b = _tensor(rng, shape, batch_size, 2, dtype, sites=_relation(rng, a_sites, how))
  ra, rb = _rows(a), _rows(b)
  zero = np.zeros(2)
  sites = ra.keys() | rb.keys()
  tol = _tol(dtype)
  ua, ub = jsparse.union(a, b, capacity="exact")
  assert ua.capacity == len(sites)
  _check_out(ua, {s: ra.get(s, zero) for s in sites}, tol, dtype)
  _check_out(ub, {s: rb.get(s, zero) for s in sites}, tol, dtype)
  assert ua.spatial_ndim == a.spatial_ndim and not bool(ua.overflow)
  keys = np.asarray(ua.linear_keys()[: int(ua.num)])
  assert np.all(np.diff(keys) > 0)  # sorted by key, as documented
  both = jsparse.concat(ua, ub)
  _check_out(both, {s: np.concatenate([ra.get(s, zero), rb.get(s, zero)]) for s in sites}, tol, dtype)
  for op, fn in ((jsparse.add, np.add), (jsparse.multiply, np.multiply)):
    want = {s: _rounded(fn(ra.get(s, zero), rb.get(s, zero)), dtype) for s in sites}
    _check_out(op(a, b), want, tol, dtype)
    if op is jsparse.add:  # under jit with a capacity that leaves room: the same sites
      _check_out(jax.jit(lambda a, b: op(a, b, capacity=len(sites) + 3))(a, b), want, tol, dtype)


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=_shapes, batch_size=st.integers(1, 3), short=st.integers(1, 4))
def test_union_too_small_a_capacity_is_flagged_and_keeps_the_first_sites(seed, shape, batch_size, short):
  """capacity below the union's sites: ValueError eagerly; under jit the output is the first `capacity` sites by key
  (a prefix of the exact result, values included) with the overflow flag set, never a silent truncation."""
  rng = np.random.default_rng(seed)
  a = _tensor(rng, shape, batch_size, 2, jnp.float32, density=0.6)
  b = _tensor(rng, shape, batch_size, 2, jnp.float32, density=0.6)
  exact = jsparse.add(a, b, capacity="exact")
  count = int(exact.num)
  cap = max(count - short, 0)
  if cap == count:
    return
  with pytest.raises(ValueError, match="add: .*union sites do not fit in capacity"):
    jsparse.add(a, b, capacity=cap)
  out, flag = jax.jit(lambda a, b: jsparse.add(a, b, capacity=cap, with_overflow=True))(a, b)
  assert bool(flag) and bool(jsparse.overflowed(out)) and int(out.num) == cap
  np.testing.assert_array_equal(np.asarray(out.coords), np.asarray(exact.coords[:cap]))
  np.testing.assert_array_equal(np.asarray(out.feats), np.asarray(exact.feats[:cap]))


@settings(max_examples=8, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=_shapes, batch_size=st.integers(1, 3), dtype=_dtypes,
       capacity=st.sampled_from([None, "exact", "int"]))
def test_select_matches_numpy(seed, shape, batch_size, dtype, capacity):
  rng = np.random.default_rng(seed)
  dtype = _DTYPES[dtype]
  x = _tensor(rng, shape, batch_size, 3, dtype)
  mask = rng.random(x.capacity) < 0.5
  n = int(x.num)
  kept = np.flatnonzero(mask[:n])
  cap = len(kept) + 2 if capacity == "int" else capacity
  y = jsparse.select(x, jnp.asarray(mask), capacity=cap)
  rows = _rows(x)
  coords = np.asarray(x.coords[:n])
  _check_out(y, {tuple(coords[i]): rows[tuple(coords[i])] for i in kept}, {"rtol": 0, "atol": 0}, dtype)
  np.testing.assert_array_equal(np.asarray(y.coords[: len(kept)]), coords[kept])  # x's row order


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=_shapes, batch_size=st.integers(1, 4), dtype=_dtypes)
def test_global_pool_and_broadcast_match_numpy(seed, shape, batch_size, dtype):
  """global_pool over the valid rows only (padding rows hold NaN and inf), items without rows giving zeros for every
  reduce; sums in float32 (float16 values whose sum passes float16's range still give a finite mean)."""
  rng = np.random.default_rng(seed)
  dtype = _DTYPES[dtype]
  x = _tensor(rng, shape, batch_size, 3, dtype)
  if dtype != jnp.bfloat16:  # values whose float16 running sum overflows: the sum must accumulate in float32
    x = x.replace(feats=jnp.where(x.valid_mask()[:, None], x.feats * 3000 + 3000, x.feats).astype(dtype))
  n = int(x.num)
  items = np.asarray(x.coords[:n, 0])
  feats = np.asarray(x.feats[:n].astype(jnp.float32), np.float64)
  counts = np.bincount(items, minlength=batch_size)
  sums = np.zeros((batch_size, 3))
  np.add.at(sums, items, feats)
  maxima = np.zeros((batch_size, 3))
  for b in range(batch_size):
    if counts[b]:
      maxima[b] = feats[items == b].max(axis=0)
  want = {"sum": sums, "mean": sums / np.maximum(counts, 1)[:, None], "max": maxima}
  for reduce, expected in want.items():
    got = jsparse.global_pool(x, reduce)
    assert got.shape == (batch_size, 3) and got.dtype == dtype
    rel = 1e-5 if dtype == jnp.float32 else 1e-2
    expected = _rounded(expected, dtype)
    if reduce == "sum" and dtype == jnp.float16:
      expected = np.where(np.abs(expected) > 65504, np.copysign(np.inf, expected), expected)
    np.testing.assert_allclose(np.asarray(got.astype(jnp.float32)), expected, rtol=rel, atol=rel, err_msg=reduce)
    np.testing.assert_array_equal(np.asarray(jax.jit(jsparse.global_pool, static_argnums=1)(x, reduce)),
                                  np.asarray(got))
  values = jnp.asarray(rng.standard_normal((batch_size, 4)), dtype)
  y = jsparse.broadcast_per_item(x, values)
  table = np.asarray(values.astype(jnp.float32), np.float64)
  _check_out(y, {s: table[s[0]] for s in _rows(x)}, {"rtol": 0, "atol": 0}, dtype, padding_coords=False)


@settings(max_examples=3, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), batch_size=st.integers(1, 3))
def test_union_add_gradients_match_dense(seed, batch_size):
  """Gradients of add / multiply / union with respect to both operands' features: the dense ops' (through todense of
  the masked features), so zero at padding rows, which hold garbage."""
  rng = np.random.default_rng(seed)
  a = _tensor(rng, (3, 2, 4), batch_size, 2, jnp.float32)
  b = _tensor(rng, (3, 2, 4), batch_size, 2, jnp.float32)

  def dense(x, f):
    return x.replace(feats=jnp.where(x.valid_mask()[:, None], f, 0)).todense()

  both = lambda a, b, capacity: jsparse.concat(*jsparse.union(a, b, capacity=capacity))
  cases = ((jsparse.add, jnp.add, 2), (jsparse.multiply, jnp.multiply, 2),
           (both, lambda x, y: jnp.concatenate([x, y], -1), 4))
  for op, fn, channels in cases:
    probe = jnp.asarray(rng.standard_normal((batch_size, 3, 2, 4, channels)), jnp.float32)
    cap = a.capacity + b.capacity
    loss = lambda fa, fb: jnp.sum(op(a.replace(feats=fa), b.replace(feats=fb), capacity=cap).todense() * probe)
    ga, gb = jax.jit(jax.grad(loss, argnums=(0, 1)))(a.feats, b.feats)
    ref = lambda fa, fb: jnp.sum(fn(dense(a, fa), dense(b, fb)) * probe)
    ra, rb = jax.grad(ref, argnums=(0, 1))(a.feats, b.feats)
    np.testing.assert_allclose(np.asarray(ga), np.asarray(ra), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(gb), np.asarray(rb), rtol=1e-6, atol=1e-6)
    assert np.all(np.isfinite(np.asarray(ga))) and np.all(np.isfinite(np.asarray(gb)))


def test_ops_under_vmap_match_each_element():
  """add, select, global_pool and broadcast_per_item under jax.vmap over tensors of one capacity with different nums
  (0, full, in between) equal the op on each element."""
  rng = np.random.default_rng(7)
  shape, cap = (3, 2, 4), 20
  pairs = []
  for num in (0, 6, cap - 2):
    a = _tensor(rng, shape, 2, 2, jnp.float32, density=1.0, num=num, pad=cap - num)
    b = _tensor(rng, shape, 2, 2, jnp.float32, density=1.0, num=min(num + 2, cap), pad=cap - min(num + 2, cap))
    pairs.append((a, b))
  stack = lambda xs: jax.tree.map(lambda *leaves: jnp.stack(leaves), *xs)
  sa, sb = stack([p[0] for p in pairs]), stack([p[1] for p in pairs])
  masks = jnp.asarray(rng.random((3, cap)) < 0.5)
  values = jnp.asarray(rng.standard_normal((3, 2, 5)), jnp.float32)

  def each(a, b, m, v):
    return (jsparse.add(a, b, capacity=2 * cap), jsparse.select(a, m), jsparse.global_pool(b, "max"),
            jsparse.broadcast_per_item(a, v))

  outs = jax.vmap(each)(sa, sb, masks, values)
  for i, (a, b) in enumerate(pairs):
    want = each(a, b, masks[i], values[i])
    for got, w in zip(outs, want):
      if isinstance(w, jsparse.SparseTensor):
        g = jax.tree.map(lambda leaf: leaf[i], got)
        assert int(g.num) == int(w.num)
        for field in ("coords", "feats", "overflow"):
          np.testing.assert_array_equal(np.asarray(getattr(g, field)), np.asarray(getattr(w, field)))
      else:
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(w))


@pytest.mark.parametrize("dtype", sorted(_DTYPES))
def test_dropout_entries_are_zero_or_scaled_and_padding_zero(dtype):
  """Each valid entry is 0 or x / (1 - rate) (in x's dtype); padding rows (holding garbage) become zero; one key gives
  one mask under jit and eagerly; rate 1 zeroes everything without a key, also under jit."""
  dtype = _DTYPES[dtype]
  rng = np.random.default_rng(3)
  x = _tensor(rng, (4, 4, 4), 2, 6, dtype, density=0.5, pad=5)
  n = int(x.num)
  y = jsparse.dropout(x, 0.25, rng=jax.random.key(1))
  z = jax.jit(lambda x, k: jsparse.dropout(x, 0.25, rng=k))(x, jax.random.key(1))
  np.testing.assert_array_equal(np.asarray(y.feats.astype(jnp.float32)), np.asarray(z.feats.astype(jnp.float32)))
  got = np.asarray(y.feats.astype(jnp.float32))
  scaled = np.asarray((x.feats / 0.75).astype(dtype).astype(jnp.float32))
  assert np.all((got[:n] == 0) | (got[:n] == scaled[:n]))
  assert 0.1 < np.mean(got[:n] == 0) < 0.45
  assert np.all(got[n:] == 0) and y.dtype == dtype
  for out in (jsparse.dropout(x, 1.0), jax.jit(lambda x: jsparse.dropout(x, 1.0))(x)):
    assert np.all(np.asarray(out.feats.astype(jnp.float32)) == 0)
  with pytest.raises(ValueError, match="rng"):
    jax.jit(lambda x: jsparse.dropout(x, 0.5))(x)


def test_dropout_takes_a_zero_dimensional_numpy_rate():
  # np.asarray(0.5) (a 0-d array, as np.mean or an array-valued config gives) was refused with "rate must be a number
  # in [0, 1], got array(0.5)", which reads as if 0.5 were out of range, while jnp.asarray(0.5) passed.
  x = _tensor(np.random.default_rng(4), (4, 4, 4), 1, 8, jnp.float32, density=0.5)
  want = jsparse.dropout(x, 0.5, rng=jax.random.key(0))
  for rate in (np.asarray(0.5), np.asarray(0.5, np.float16)):
    y = jsparse.dropout(x, rate, rng=jax.random.key(0))
    np.testing.assert_array_equal(np.asarray(y.feats), np.asarray(want.feats))
  assert jsparse.topology.check_rate(np.asarray(0)) == 0.0
  for rate in (np.asarray(1.5), np.asarray(True), np.asarray([0.5]), np.asarray("0.5")):
    with pytest.raises(ValueError, match="rate must be a number in"):
      jsparse.dropout(x, rate, rng=jax.random.key(0))


@settings(max_examples=5, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), shape=st.sampled_from([(5, 4, 3), (4, 6), (3, 3, 3)]),
       stride=st.sampled_from([1, 2, 3]), batch_size=st.integers(1, 3), up=st.booleans())
def test_child_labels_match_numpy(seed, shape, stride, batch_size, up):
  """child_labels of a coarse tensor built from fine's coordinates // stride (both with garbage padding rows), on the
  grid rounded up or down, in 3D and 2D: label t of coarse site c is whether c * stride + t is a site of fine."""
  rng = np.random.default_rng(seed)
  fine = _tensor(rng, shape, batch_size, 1, jnp.float32)
  ndim = len(shape)
  lifted = fine.spatial_shape
  st3 = (1,) * (3 - ndim) + (stride,) * ndim
  coarse_shape = tuple(-(-n // s) if up else n // s for n, s in zip(lifted, st3))
  if min(coarse_shape) == 0:
    return
  parents = np.asarray(fine.coords[: int(fine.num)]).copy()
  parents[:, 1:] //= np.asarray(st3)
  parents = np.unique(parents[np.all(parents[:, 1:] < np.asarray(coarse_shape), axis=1)], axis=0)
  coarse = _tensor(rng, coarse_shape[3 - ndim:], batch_size, 1, jnp.float32, sites=parents)
  labels = np.asarray(jax.jit(jsparse.child_labels, static_argnums=2)(coarse, fine, stride))
  t = stride**ndim
  assert labels.shape == (coarse.capacity, t)
  sites = set(_rows(fine))
  for row in range(coarse.capacity):
    for child, off in enumerate(np.ndindex(*st3)):
      c = np.asarray(coarse.coords[row])
      want = row < int(coarse.num) and (int(c[0]), *(c[1:] * np.asarray(st3) + off).tolist()) in sites
      assert labels[row, child] == want, (row, child)
