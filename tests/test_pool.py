"""Window and global pooling (jsparse/pool.py): values and gradients against dense reduce_window references,
half precision, ties, both gradient routes, and no scatter in the backward pass."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from jax import lax

import jsparse
from jsparse import pool
from jsparse.neighbors import as_triple
from jsparse.sparse_conv import pair_map
from reference import random_sparse, rel_err


def _at(dense, t):
  valid = t.valid_mask()
  c = jnp.where(valid[:, None], t.coords, 0)
  return jnp.where(valid[:, None], dense[c[:, 0], c[:, 1], c[:, 2], c[:, 3]], 0)


def _dense_pool(x, feats, ks, st_, pad, reduce):
  """reduce_window over the dense tensor (inactive sites -inf for max, not counted for mean), float32."""
  ks3, st3, pad3 = (as_triple(v, "") for v in (ks, st_, pad))
  window = dict(window_dimensions=(1,) + ks3 + (1,), window_strides=(1,) + st3 + (1,),
                padding=((0, 0),) + tuple((p, p) for p in pad3) + ((0, 0),))
  active = x.replace(feats=jnp.ones((x.capacity, 1), jnp.float32)).todense() > 0  # padding rows are dropped
  d = x.replace(feats=feats.astype(jnp.float32)).todense()
  if reduce == "max":
    return lax.reduce_window(jnp.where(active, d, -jnp.inf), -jnp.inf, lax.max, **window)
  s = lax.reduce_window(d, 0.0, lax.add, **window)
  n = lax.reduce_window(active.astype(jnp.float32), 0.0, lax.add, **window)
  return s / jnp.maximum(n, 1)


POOLS = {"max": jsparse.sparse_max_pool3d, "mean": jsparse.sparse_avg_pool3d}
GEOMETRIES = [(2, 2, 0), (3, 2, 1), ((2, 3, 1), (2, 3, 1), 0), ((3, 1, 2), (1, 1, 2), (1, 0, 0))]


CASES = [(g, jnp.float32) for g in GEOMETRIES] + [(g, d) for g in GEOMETRIES[:2] for d in (jnp.float16, jnp.bfloat16)]


@pytest.mark.parametrize("geom,dtype", CASES, ids=[f"{g}-{jnp.dtype(d).name}" for g, d in CASES])
def test_window_pool_values_and_grads_match_dense(geom, dtype):
  ks, st_, pad = geom
  rng = np.random.default_rng(hash((str(geom), str(dtype))) % 2**32)
  x32 = random_sparse(rng, (7, 6, 5), 4, batch_size=2, density=0.35, pad=3)
  x = x32.replace(feats=x32.feats.astype(dtype))
  tol = {jnp.float32: 1e-6, jnp.float16: 2e-3, jnp.bfloat16: 1e-2}[dtype]
  for reduce, fn in POOLS.items():
    y = fn(x, ks, st_, pad)
    assert y.dtype == dtype
    want = _at(_dense_pool(x, x.feats, ks, st_, pad, reduce), y)
    assert rel_err(y.feats, want) < tol
    assert np.all(np.asarray(y.feats[int(y.num):]) == 0)
    cot = jnp.asarray(rng.standard_normal(y.feats.shape), jnp.float32)

    def sparse_loss(f):
      return jnp.sum(fn(x.replace(feats=f), ks, st_, pad, out_capacity=y.capacity).feats * cot)

    def dense_loss(f):
      return jnp.sum(_at(_dense_pool(x, f, ks, st_, pad, reduce), y) * cot)

    g = jax.jit(jax.grad(sparse_loss))(x.feats)
    g_ref = jax.jit(jax.grad(dense_loss))(x.feats.astype(jnp.float32))
    assert g.dtype == dtype
    assert rel_err(g, g_ref) < tol, reduce
    assert np.all(np.asarray(g[int(x.num):]) == 0)  # padding rows get no gradient


def test_max_pool_ties_send_each_gradient_to_one_input():
  """After a ReLU most windows tie at 0: each (output, channel) gradient lands on exactly one input, the first
  in offset order, so the gradients sum to the cotangents' sum and nothing is split."""
  rng = np.random.default_rng(3)
  x = random_sparse(rng, (8, 8, 6), 3, batch_size=2, density=0.5, pad=2)
  x = x.replace(feats=jnp.maximum(x.feats, 0))  # ties at zero
  for ks, st_ in ((2, 2), (3, 2)):
    y = jsparse.sparse_max_pool3d(x, ks, st_)
    cot = jnp.asarray(rng.integers(1, 5, y.feats.shape), jnp.float32)
    cot = jnp.where(y.valid_mask()[:, None], cot, 0)
    # Jitted: eagerly, every primitive of the forward and backward passes compiled as its own program.
    g = jax.jit(jax.grad(lambda f: jnp.sum(jsparse.sparse_max_pool3d(x.replace(feats=f), ks, st_,
                                                                     out_capacity=y.capacity).feats * cot)))(x.feats)
    np.testing.assert_allclose(float(jnp.sum(g)), float(jnp.sum(cot)))
    # Every nonzero gradient entry is a sum of whole cotangents (integers): nothing was divided among ties.
    np.testing.assert_array_equal(np.asarray(g), np.round(np.asarray(g)))
    # The winner's value is the window's max.
    pm = pair_map(x, ks, st_)
    nbr = np.asarray(pm.nbr)
    f = np.asarray(x.feats)
    gi = np.asarray(g)
    for i in range(int(pm.out_num)):
      rows = nbr[i][nbr[i] >= 0]
      for c in range(3):
        first = rows[np.argmax(f[rows, c])]
        assert f[first, c] == f[rows, c].max()
        if ks == st_:  # disjoint windows: the gradient of (i, c) sits exactly on the first winner
          assert gi[first, c] == cot[i, c]


def test_max_pool_gradient_of_an_all_minus_inf_window_reaches_its_first_input():
  """A window whose inputs are all -inf ties them with the -inf of its absent offsets: the gradient still goes to
  the first input in offset order (it went to an absent offset, i.e. nowhere), on both gradient routes."""
  # Window (0, 0, 0) of a 2x2x2 pool holds inputs at offsets 3 and 7 only (offset 0 is absent).
  coords = np.array([[0, 0, 1, 1], [0, 1, 1, 1], [0, 2, 2, 2]], np.int32)
  feats = np.array([[-np.inf, 1.0], [-np.inf, 2.0], [-np.inf, 5.0]], np.float32)
  x = jsparse.SparseTensor.from_coords(coords, feats, (4, 4, 4), 1, capacity=5)
  for ks, st_ in ((2, 2), (2, 1)):  # disjoint and overlapping windows
    y = jsparse.sparse_max_pool3d(x, ks, st_)
    assert np.all(np.asarray(y.feats[:int(y.num), 0]) == -np.inf)
    cot = jnp.where(y.valid_mask()[:, None], 1.0, 0.0) * jnp.ones_like(y.feats)
    g = jax.jit(jax.grad(lambda f: jnp.sum(jsparse.sparse_max_pool3d(x.replace(feats=f), ks, st_,
                                                                     out_capacity=y.capacity).feats * cot)))(x.feats)
    # Every output's channel-0 gradient lands on one input: none is lost.
    np.testing.assert_array_equal(float(jnp.sum(g[:, 0])), float(jnp.sum(cot[:, 0])))
    if ks == st_:
      np.testing.assert_array_equal(np.asarray(g[:, 0]), [1, 0, 1, 0, 0])  # the first input of each window


def test_max_pool_propagates_nan_to_its_window_only():
  """A NaN input makes its window's max NaN in that channel, as a dense reduce_window max does, and leaves every
  other window and channel as without it. (XLA's CPU max reduction dropped the NaN for 128 windows of 8.)"""
  coords = np.array([[0, i // 16, i // 4 % 4, i % 4] for i in range(128)] +
                    [[1, i // 16, i // 4 % 4, i % 4] for i in range(128)], np.int32)
  feats = np.random.default_rng(0).standard_normal((256, 4)).astype(np.float32)
  clean = jsparse.SparseTensor.from_coords(coords, feats, (8, 4, 4), 2)
  dirty_feats = feats.copy()
  dirty_feats[0, 0] = np.nan  # site (0, 0, 0, 0): window 0 of item 0, channel 0
  dirty = clean.replace(feats=jnp.asarray(dirty_feats))
  eager = functools.partial(jsparse.sparse_max_pool3d, kernel_size=2, stride=2, out_capacity=128)
  for fn in (eager, jax.jit(eager)):
    want = np.array(fn(clean).feats)
    y = fn(dirty)
    got = np.asarray(y.feats)
    first = int(np.flatnonzero((np.asarray(y.coords) == [0, 0, 0, 0]).all(1))[0])
    assert np.isnan(got[first, 0])
    want[first, 0] = np.nan
    np.testing.assert_array_equal(got, want)


@settings(max_examples=4, deadline=None)  # each example compiles its own programs (its own map sizes)
@given(seed=st.integers(0, 2**31 - 1), reduce=st.sampled_from(["max", "mean"]), ks=st.integers(1, 3))
def test_disjoint_and_overlapping_gradient_routes_agree(seed, reduce, ks):
  """The one-gather route (disjoint windows) and the V-gather route give the same gradient where both apply."""
  rng = np.random.default_rng(seed)
  x = random_sparse(rng, (6, 5, 6), 3, batch_size=2, density=0.4, pad=2)
  pm = pair_map(x, ks, ks)
  window = pool._window_max if reduce == "max" else pool._window_mean
  cot = jnp.asarray(rng.standard_normal((pm.out_capacity, 3)), jnp.float32)
  # Jitted: eagerly, every primitive of the forward and backward passes compiled as its own program.
  grads = [jax.jit(jax.grad(lambda f: jnp.sum(window(f, pm.nbr, pm.inv, disjoint) * cot)))(x.feats)
           for disjoint in (True, False)]
  np.testing.assert_allclose(np.asarray(grads[0]), np.asarray(grads[1]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("reduce", ["max", "mean"])
def test_pool_backward_has_no_scatter(reduce):
  """The backward is gathers only (a scatter-add there serialises on half-precision atomics on a GPU)."""
  rng = np.random.default_rng(0)
  x = random_sparse(rng, (6, 6, 6), 4, density=0.4, pad=2)
  x = x.replace(feats=x.feats.astype(jnp.float16))
  y = POOLS[reduce](x, 2)
  loss = lambda f: jnp.sum(POOLS[reduce](x.replace(feats=f), 2, out_capacity=y.capacity).feats)  # noqa: E731
  text = jax.jit(jax.grad(loss)).lower(x.feats).as_text()
  # The site search scatters int32 maps (not a gradient); no floating-point scatter may appear.
  for line in text.splitlines():
    if "scatter" in line:
      assert "f16" not in line and "f32" not in line, line


def test_pool_empty_and_all_padding():
  x = jsparse.SparseTensor.from_coords(np.zeros((0, 4), np.int32), np.zeros((0, 2), np.float32), (4, 4, 4), 1,
                                       capacity=5)
  for fn in POOLS.values():
    y = fn(x, 2, out_capacity=3)
    assert int(y.num) == 0 and y.feats.shape == (3, 2)
    np.testing.assert_array_equal(np.asarray(y.feats), 0)
    g = jax.jit(jax.grad(lambda f: jnp.sum(fn(x.replace(feats=f), 2, out_capacity=3).feats)))(x.feats)
    np.testing.assert_array_equal(np.asarray(g), 0)


def test_pool_with_no_output_rows_under_jit():
  """out_capacity 0 with sites present (an overflow, flagged): no rows out, zero gradients, no gather crash."""
  x = random_sparse(np.random.default_rng(7), (4, 4, 4), 2, density=0.5, pad=2)
  for fn in POOLS.values():
    def loss(f):
      y, overflow = fn(x.replace(feats=f), 2, out_capacity=0, with_overflow=True)
      return jnp.sum(y.feats), overflow
    (value, overflow), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(x.feats)
    assert bool(overflow) and float(value) == 0
    np.testing.assert_array_equal(np.asarray(g), 0)


def test_global_max_gradient_splits_evenly_among_tied_maxima():
  """global_pool "max": the gradient of an item's maximum splits evenly among its tied rows (as jnp.max's does),
  per item and per channel; padding rows (garbage above the maximum) get none."""
  coords = np.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 2, 0, 0], [1, 0, 0, 0], [1, 1, 0, 0]], np.int32)
  feats = np.array([[3, 1], [3, 2], [1, 2], [5, 0], [4, 0]], np.float32)
  x = jsparse.SparseTensor.from_coords(coords, feats, (4, 4, 4), 2, capacity=7)
  x = x.replace(feats=x.feats.at[5:].set(9.0))
  g = jax.grad(lambda f: jnp.sum(jsparse.global_pool(x.replace(feats=f), "max")))(x.feats)
  want = np.array([[0.5, 0], [0.5, 0.5], [0, 0.5], [1, 0.5], [0, 0.5], [0, 0], [0, 0]], np.float32)
  np.testing.assert_array_equal(np.asarray(g), want)


def test_global_max_gradient_of_a_minus_inf_maximum_reaches_its_rows_whole():
  """An item whose maximum is -inf passes its whole cotangent to its rows at the max, as jnp.max does: autodiff of
  the scatter-max counted the -inf it starts from as one more tie (a single row got half, two tied rows a third)."""
  coords = np.array([[0, 0, 0, 0], [0, 1, 0, 0], [1, 0, 0, 0]], np.int32)
  feats = np.array([[-np.inf, 1], [-np.inf, 2], [-np.inf, -np.inf]], np.float32)
  x = jsparse.SparseTensor.from_coords(coords, feats, (4, 4, 4), 2, capacity=5)
  g = jax.grad(lambda f: jnp.sum(jsparse.global_pool(x.replace(feats=f), "max")))(x.feats)
  want = np.array([[0.5, 0], [0.5, 1], [1, 1], [0, 0], [0, 0]], np.float32)
  np.testing.assert_array_equal(np.asarray(g), want)
  for item in range(2):
    np.testing.assert_array_equal(np.asarray(g)[:3][coords[:, 0] == item],
                                  jax.grad(lambda f: jnp.sum(jnp.max(f, axis=0)))(feats[coords[:, 0] == item]))


def test_avg_pool_accumulates_half_precision_in_float32():
  """fp16 window sums accumulate in float32 (module docstring): windows mixing 2048 with small integers, where an
  fp16 sum drops the small terms (2048 + 1 rounds back to 2048). Against the float32 dense reference, each mean
  within half an fp16 ulp. Two items, a non-cubic grid, partial windows, padding rows, padding 1."""
  rng = np.random.default_rng(11)
  x = random_sparse(rng, (6, 4, 8), 3, batch_size=2, density=0.7, pad=6)
  n = int(x.num)
  f = np.where(rng.random((n, 3)) < 0.25, 2048.0, rng.integers(1, 4, (n, 3)))
  feats = jnp.asarray(np.concatenate([f, np.zeros((x.capacity - n, 3))]), jnp.float16)
  x = x.replace(feats=feats)
  for ks, st_, pad in ((2, 2, 0), (3, 2, 1)):
    y = jsparse.sparse_avg_pool3d(x, ks, st_, pad)
    want = np.asarray(_at(_dense_pool(x, feats, ks, st_, pad, "mean"), y), np.float64)
    got = np.asarray(y.feats, np.float64)
    assert y.dtype == jnp.float16
    ulp = np.maximum(np.spacing(np.abs(want).astype(np.float16)), np.spacing(np.abs(got).astype(np.float16)))
    assert np.all(np.abs(got - want) <= 0.5 * ulp.astype(np.float64)), np.max(np.abs(got - want) / ulp)
