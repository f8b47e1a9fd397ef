"""Gradients of gradients through the Pallas convolutions (interpret mode), against XLA and the dense convolution.

The check is a gradient penalty, d/d(x, w, b) of ||d loss / d x||^2 with a nonlinear loss, which runs every
pass's VJP: the forward's, the input gradient's and the weight gradient's.
"""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from reference import dense_submconv_at_sites, random_sparse, rel_err


def _penalty_grads(conv, feats, w, b):
  """d/d(feats, w, b) of sum((d/d feats sum(tanh(conv(feats, w, b))))^2)."""
  def loss(feats, w, b):
    return jnp.sum(jnp.tanh(conv(feats, w, b)))

  def penalty(feats, w, b):
    return jnp.sum(jax.grad(loss)(feats, w, b) ** 2)

  return jax.grad(penalty, argnums=(0, 1, 2))(feats, w, b)


def _inputs(seed, kernel_size, cin, cout, spatial_shape=(4, 4, 4)):
  rng = np.random.default_rng(seed)
  x = random_sparse(rng, spatial_shape, cin, batch_size=2, density=0.3, pad=3)
  w = jnp.asarray(rng.standard_normal(tuple(kernel_size) + (cin, cout)), jnp.float32) * 0.3
  b = jnp.asarray(rng.standard_normal(cout), jnp.float32)
  return x, w, b


@functools.cache
def _subm_inputs():
  return _inputs(0, (3, 3, 3), 3, 4)


@functools.partial(jax.jit, static_argnames=("implementation", "algorithm", "weight_layout"))
def _submconv_penalty_grads(feats, w, b, implementation, algorithm, weight_layout):
  """_penalty_grads of submconv3d on _subm_inputs()'s sites, w given DHWIO and passed in weight_layout. One
  jitted program per (implementation, algorithm, layout); the XLA path ignores the algorithm, so the test passes
  it "auto" there and the cases of one layout share that program."""
  x, _, _ = _subm_inputs()
  to_layout = (lambda w: jnp.moveaxis(w, -1, 0)) if weight_layout == "ODHWI" else (lambda w: w)

  def conv(feats, w, b):
    return jsparse.submconv3d(x.replace(feats=feats), to_layout(w), b, implementation=implementation,
                              precision="highest", algorithm=algorithm, weight_layout=weight_layout).feats
  return _penalty_grads(conv, feats, w, b)


@jax.jit
def _dense_penalty_grads(feats, w, b):
  x, _, _ = _subm_inputs()
  return _penalty_grads(lambda feats, w, b: dense_submconv_at_sites(x, feats, w, b), feats, w, b)


@pytest.mark.parametrize("algorithm", ["auto", "implicit", "masked_splitk", "explicit"])
@pytest.mark.parametrize("weight_layout", ["DHWIO", "ODHWI"])
def test_submconv_gradient_penalty_matches_xla_and_dense(algorithm, weight_layout):
  x, w, b = _subm_inputs()
  pallas = _submconv_penalty_grads(x.feats, w, b, "pallas", algorithm, weight_layout)
  xla = _submconv_penalty_grads(x.feats, w, b, "xla", "auto", weight_layout)
  dense = _dense_penalty_grads(x.feats, w, b)  # the same in every case: compiled once
  for name, p, r, d in zip(("feats", "weight", "bias"), pallas, xla, dense):
    assert rel_err(p, d) < 1e-5, name
    assert rel_err(p, r) < 1e-5, name
    assert float(jnp.linalg.norm(d)) > 0, name  # the check is not vacuous
  # The penalty's input gradient stays zero at padding rows.
  np.testing.assert_array_equal(np.asarray(pallas[0][int(x.num):]), 0)


def test_submconv_hessian_vector_product_in_the_weight():
  """Reverse over reverse in the weight alone (the weight gradient's VJP feeding the forward's)."""
  x, w, _ = _inputs(1, (3, 3, 3), 2, 3)
  direction = jnp.asarray(np.random.default_rng(2).standard_normal(w.shape), jnp.float32)

  def hvp(implementation):
    def loss(w):
      y = jsparse.submconv3d(x, w, implementation=implementation, precision="highest").feats
      return jnp.sum(jnp.sin(y))
    return jax.jit(jax.grad(lambda w: jnp.vdot(jax.grad(loss)(w), direction)))(w)

  assert rel_err(hvp("pallas"), hvp("xla")) < 1e-5


@pytest.mark.parametrize("op", ["sparse_conv3d", "sparse_inverse_conv3d", "sparse_conv_transpose3d"])
def test_strided_and_transposed_gradient_penalty_matches_xla(op):
  x, w, b = _inputs(3, (2, 2, 2), 3, 4)
  w_back = jnp.asarray(np.random.default_rng(4).standard_normal((2, 2, 2, 4, 3)), jnp.float32) * 0.3

  def sparse(implementation):
    kw = dict(implementation=implementation, precision="highest")

    def conv(feats, w, b):
      xx = x.replace(feats=feats)
      if op == "sparse_conv_transpose3d":
        return jsparse.sparse_conv_transpose3d(xx, w, b, stride=2, **kw).feats
      y = jsparse.sparse_conv3d(xx, w, b, stride=2, **kw)
      if op == "sparse_conv3d":
        return y.feats
      return jsparse.sparse_inverse_conv3d(y, w_back, like=xx, stride=2, **kw).feats
    return conv

  pallas = _penalty_grads(sparse("pallas"), x.feats, w, b)
  xla = _penalty_grads(sparse("xla"), x.feats, w, b)
  for name, p, r in zip(("feats", "weight", "bias"), pallas, xla):
    assert rel_err(p, r) < 1e-5, name
    assert float(jnp.linalg.norm(r)) > 0, name


def _valid_rows(x):
  return np.flatnonzero(np.arange(x.capacity) < int(x.num))  # numpy: the references index with it under jit


def _valid_rows_per_item(x):
  items = np.asarray(x.coords)[_valid_rows(x), 0]
  return [_valid_rows(x)[items == b] for b in range(x.batch_size)]


def _pool_reference(x, feats, reduce):
  """A 3-wide, stride-2, padding-1 window pool of the dense tensor (inactive sites: -inf for max, left out of
  the mean), at every output position."""
  dense = x.replace(feats=feats).todense()
  active = (jnp.zeros(dense.shape[:-1] + (1,)).at[tuple(np.asarray(x.coords)[_valid_rows(x)].T)].set(1.0))
  window = dict(window_dimensions=(1, 3, 3, 3, 1), window_strides=(1, 2, 2, 2, 1),
                padding=((0, 0),) + ((1, 1),) * 3 + ((0, 0),))
  if reduce == "max":
    return jax.lax.reduce_window(jnp.where(active > 0, dense, -jnp.inf), -jnp.inf, jax.lax.max, **window)
  total = jax.lax.reduce_window(dense, 0.0, jax.lax.add, **window)
  return total / jnp.maximum(jax.lax.reduce_window(active, 0.0, jax.lax.add, **window), 1.0)


def _no_inf(y):
  return jnp.where(jnp.isfinite(y), y, 0.0)


# name -> (sparse op on (x, feats), plain-JAX reference on (x, feats)); each is summed after a nonlinearity.
_FEATURE_OPS = {
    "batch_norm": (lambda x, f: jsparse.norm.batch_norm(x.replace(feats=f), activation=jnp.tanh).feats,
                   lambda x, f: jnp.tanh(jax.nn.standardize(f[_valid_rows(x)], axis=0, epsilon=1e-5))),
    "group_norm": (lambda x, f: jsparse.norm.group_norm(x.replace(feats=f), 3).feats,
                   lambda x, f: jnp.concatenate([jax.nn.standardize(f[rows].reshape(len(rows), 3, -1), axis=(0, 2),
                                                                    epsilon=1e-6).reshape(len(rows), -1)
                                                 for rows in _valid_rows_per_item(x)])),
    "global_pool_mean": (lambda x, f: jsparse.global_pool(x.replace(feats=f), "mean"),
                         lambda x, f: jnp.stack([jnp.mean(f[rows], 0) for rows in _valid_rows_per_item(x)])),
    "global_pool_max": (lambda x, f: jsparse.global_pool(x.replace(feats=f), "max"),
                        lambda x, f: jnp.stack([jnp.max(f[rows], 0) for rows in _valid_rows_per_item(x)])),
    "max_pool": (lambda x, f: jsparse.sparse_max_pool3d(x.replace(feats=f), 3, 2, 1, out_capacity=64).feats,
                 lambda x, f: _no_inf(_pool_reference(x, f, "max"))),
    "avg_pool": (lambda x, f: jsparse.sparse_avg_pool3d(x.replace(feats=f), 3, 2, 1, out_capacity=64).feats,
                 lambda x, f: _pool_reference(x, f, "mean")),
}


@pytest.mark.parametrize("name", list(_FEATURE_OPS))
def test_norms_and_pools_gradient_penalty_matches_plain_jax(name):
  """Reverse over reverse (README, Things to know: second derivatives are taken in reverse mode) through the ops
  with custom gradients besides the convolutions, against plain autodiff of their textbook formulas."""
  x, _, _ = _inputs(3, (1, 1, 1), 6, 1, spatial_shape=(5, 5, 5))
  op, reference = _FEATURE_OPS[name]

  def penalty(f, fn):
    inner = jax.grad(lambda g: jnp.sum(jnp.sin(fn(x, g)) ** 2))
    return jnp.sum(jnp.cos(inner(f)))

  got = jax.jit(jax.grad(lambda f: penalty(f, op)))(x.feats)
  want = jax.jit(jax.grad(lambda f: penalty(f, reference)))(x.feats)
  assert rel_err(got, want) < 1e-4
  assert np.all(np.asarray(got[int(x.num):]) == 0)
