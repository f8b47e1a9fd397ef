"""Layers under lax.scan, flax's nn.scan and lax.cond (values against the unrolled loop), and nn.tabulate.

The rule these rely on (SparseTensor's docstring, README): build the maps before the loop with
`jsparse.with_maps`, so that a convolution in the body reuses them and the carry keeps its pytree structure.
"""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
import jsparse.nn as snn
from reference import random_sparse, rel_err

CHANNELS = 4
LAYERS = 3


def _stacked_weights(seed, layers=LAYERS, channels=CHANNELS):
  rng = np.random.default_rng(seed)
  w = rng.standard_normal((layers, 3, 3, 3, channels, channels)).astype(np.float32) / np.sqrt(27 * channels)
  b = rng.standard_normal((layers, channels)).astype(np.float32) * 0.1
  return jnp.asarray(w), jnp.asarray(b)


def _layer(x, w, b, implementation):
  return jsparse.norm.activation(jsparse.submconv3d(x, w, b, implementation=implementation, precision="highest"),
                                 jnp.tanh)


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_lax_scan_over_stacked_submconv_weights(implementation):
  x = random_sparse(np.random.default_rng(0), (5, 5, 5), CHANNELS, batch_size=2, density=0.3, pad=4)
  ws, bs = _stacked_weights(1)

  def scanned(x, ws, bs):
    def body(h, wb):
      return _layer(h, *wb, implementation), None
    return jax.lax.scan(body, jsparse.with_maps(x, 3, implementation=implementation), (ws, bs))[0]

  def unrolled(x, ws, bs):
    for i in range(LAYERS):
      x = _layer(x, ws[i], bs[i], implementation)
    return x

  y_scan = jax.jit(scanned)(x, ws, bs)
  y_loop = unrolled(x, ws, bs)
  assert rel_err(y_scan.feats, y_loop.feats) < 1e-6
  assert list(y_scan.caches) == [jsparse.neighbors.cache_key(3, 1, implementation)]
  loss = lambda f: lambda ws, bs: jnp.sum(f(x, ws, bs).feats ** 2)
  for g_scan, g_loop in zip(jax.grad(loss(scanned), (0, 1))(ws, bs), jax.grad(loss(unrolled), (0, 1))(ws, bs)):
    assert rel_err(g_scan, g_loop) < 1e-5


class _Block(nn.Module):
  features: int

  @nn.compact
  def __call__(self, x, _):
    return jsparse.norm.activation(snn.SubMConv3d(self.features, implementation="xla")(x), jnp.tanh), None


class _ScannedStack(nn.Module):
  @nn.compact
  def __call__(self, x):
    stack = nn.scan(_Block, variable_axes={"params": 0}, split_rngs={"params": True}, length=LAYERS)
    return stack(CHANNELS, name="blocks")(jsparse.with_maps(x, 3, implementation="xla"), None)[0]


def test_flax_nn_scan_over_a_submconv_block():
  x = random_sparse(np.random.default_rng(2), (5, 5, 5), CHANNELS, density=0.3, pad=3)
  params = _ScannedStack().init(jax.random.key(0), x)["params"]
  kernels = params["blocks"]["SubMConv3d_0"]["kernel"]
  assert kernels.shape == (LAYERS, 3, 3, 3, CHANNELS, CHANNELS)
  y = jax.jit(_ScannedStack().apply)({"params": params}, x)
  h = x
  for i in range(LAYERS):
    h, _ = _Block(CHANNELS).apply({"params": jax.tree.map(lambda p: p[i], params["blocks"])}, h, None)
  assert rel_err(y.feats, h.feats) < 1e-6


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_lax_cond_between_a_layer_and_identity(implementation):
  x = random_sparse(np.random.default_rng(3), (5, 5, 5), CHANNELS, density=0.3, pad=3)
  ws, bs = _stacked_weights(4, layers=1)
  w, b = ws[0], bs[0]

  @jax.jit
  def maybe_layer(x, w, b, apply):
    x = jsparse.with_maps(x, 3, implementation=implementation)
    return jax.lax.cond(apply, lambda h: _layer(h, w, b, implementation), lambda h: h, x)

  assert rel_err(maybe_layer(x, w, b, True).feats, _layer(x, w, b, implementation).feats) < 1e-6
  assert rel_err(maybe_layer(x, w, b, False).feats, x.feats) == 0
  grad = jax.grad(lambda w: jnp.sum(maybe_layer(x, w, b, True).feats))(w)
  assert rel_err(grad, jax.grad(lambda w: jnp.sum(_layer(x, w, b, implementation).feats))(w)) < 1e-5


class _SmallNet(nn.Module):
  @nn.compact
  def __call__(self, x):
    h = snn.SubMConv3d(8, implementation="xla")(x)
    h = jsparse.norm.activation(snn.SparseBatchNorm()(h, use_running_average=True), nn.relu)
    h = snn.SubMConv3d(8, implementation="xla")(h)
    d = snn.SparseConv3d(16, kernel_size=2, strides=2, out_capacity=h.capacity, implementation="xla")(h)
    return snn.SubMConv3d(4, implementation="xla")(d)


def test_tabulate_shows_tensors_without_their_maps():
  x = random_sparse(np.random.default_rng(5), (6, 6, 6), 3, density=0.3, pad=4)
  table = nn.tabulate(_SmallNet(), jax.random.key(0), console_kwargs=dict(width=160))(x)
  assert "nbr" not in table and "caches" not in table
  assert "coords" in table and "feats" in table and "spatial_shape" in table
  assert len(table.splitlines()) < 80  # 6 rows of a few lines each (it was 320 with the maps)
  # The maps are still carried: the network's output has its map for the next layer.
  y = _SmallNet().apply(_SmallNet().init(jax.random.key(0), x), x)
  assert any(key.startswith("subm/") for key in y.caches) and any(key.startswith("pairs/") for key in y.caches)


def test_with_maps_builds_each_map_once_and_keeps_the_others():
  x = random_sparse(np.random.default_rng(6), (5, 5, 5), 2, density=0.3, pad=2)
  x3 = jsparse.with_maps(x, 3, implementation="xla")
  both = jsparse.with_maps(x3, 3, 1, implementation="xla")
  key3, key1 = (jsparse.neighbors.cache_key(k, 1, "xla") for k in (3, 1))
  assert set(both.caches) == {key3, key1} and both.caches[key3] is x3.caches[key3]
  assert jsparse.with_maps(x, kernel_size=(3, 3, 1), dilation=2, implementation="xla").caches.keys() == {
      jsparse.neighbors.cache_key((3, 3, 1), 2, "xla")}
  # SparseTensor's pytree still carries the maps (under jit they are arrays like the rest).
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(both)[0]]
  assert paths[:4] == [".coords", ".feats", ".num", ".overflow"] and all(p.startswith(".caches[") for p in paths[4:])
  assert both.replace(feats=both.feats * 2).caches.keys() == both.caches.keys()


def _same_capacity(seed, count, capacity, shape=(6, 6, 6)):
  """`count` random tensors of one capacity (different site counts), as jax.vmap needs them stacked."""
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(count):
    x = random_sparse(rng, shape, CHANNELS, batch_size=2, density=0.15, pad=0)
    n = int(x.num)
    out.append(jsparse.SparseTensor.from_coords(np.asarray(x.coords[:n]), np.asarray(x.feats[:n]), shape, 2,
                                                capacity=capacity))
  return out


def _vmap_step(x, w, wd, wu, implementation):
  """A small U-shaped step: submanifold, strided convolution with an int out_capacity, batch norm, inverse
  convolution, global pool."""
  h = jsparse.submconv3d(x, w, implementation=implementation, precision="highest")
  d = jsparse.norm.batch_norm(jsparse.sparse_conv3d(h, wd, stride=2, out_capacity=64, precision="highest",
                                                    implementation=implementation))
  u = jsparse.sparse_inverse_conv3d(d, wu, like=h, stride=2, implementation=implementation, precision="highest")
  return h.feats, u.feats, jsparse.global_pool(u, "max")


def _vmap_loss(x, w, wd, wu, implementation):
  return sum(jnp.sum(jnp.sin(o)) for o in _vmap_step(x, w, wd, wu, implementation))


# The per-tensor references: the XLA step, jitted once for both cases of test_vmap_over_stacked_tensors (one
# program each for the three equal-capacity tensors, not one per eager primitive).
_step_one = jax.jit(functools.partial(_vmap_step, implementation="xla"))
_grad_one = jax.jit(jax.grad(functools.partial(_vmap_loss, implementation="xla"), argnums=1))


@pytest.mark.parametrize("implementation", ["xla", "pallas"])
def test_vmap_over_stacked_tensors(implementation):
  """jax.vmap over equal-capacity tensors stacked leaf by leaf (README, Things to know): a small U-shaped step
  (submanifold, strided convolution with an int out_capacity, batch norm, inverse convolution, global pool)
  and its gradient equal the XLA step run on each tensor (for the Pallas kernels too: they match the XLA path
  unbatched elsewhere, and the references then compile once for both cases); the submanifold layer equals the
  dense convolution; an out_capacity too small sets each element's overflow flag, as under jit, without raising
  (an eager vmap on the XLA path; the Pallas path's flags under a jitted vmap, its interpret-mode kernels
  compiling once rather than primitive by primitive)."""
  from reference import dense_submconv_at_sites

  tensors = _same_capacity(3, 3, 96)
  assert len({int(t.num) for t in tensors}) > 1
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *tensors)
  rng = np.random.default_rng(4)
  w = jnp.asarray(rng.standard_normal((3, 3, 3, CHANNELS, 5)) * 0.2, jnp.float32)
  wd = jnp.asarray(rng.standard_normal((2, 2, 2, 5, 6)) * 0.2, jnp.float32)
  wu = jnp.asarray(rng.standard_normal((2, 2, 2, 6, 5)) * 0.2, jnp.float32)

  # Jitted (vmap's ops run as under jit either way): one compilation per program instead of one per eager
  # primitive.
  step = functools.partial(_vmap_step, implementation=implementation)
  got = jax.jit(jax.vmap(step, in_axes=(0, None, None, None)))(stacked, w, wd, wu)
  for i, x in enumerate(tensors):
    want = _step_one(x, w, wd, wu)
    for g, r in zip(got, want):
      assert rel_err(g[i], r) < 1e-5
    assert rel_err(got[0][i], dense_submconv_at_sites(x, x.feats, w)) < 1e-5
  loss = functools.partial(_vmap_loss, implementation=implementation)
  grads = jax.jit(jax.vmap(jax.grad(loss, argnums=1), in_axes=(0, None, None, None)))(stacked, w, wd, wu)
  for i, x in enumerate(tensors):
    assert rel_err(grads[i], _grad_one(x, w, wd, wu)) < 1e-5

  small = lambda x: jsparse.overflowed(jsparse.sparse_conv3d(x, wd[..., :CHANNELS, :], stride=2,  # noqa: E731
                                                             out_capacity=3, implementation=implementation))
  flags = jax.vmap(small) if implementation == "xla" else jax.jit(jax.vmap(small))
  np.testing.assert_array_equal(flags(stacked), [True, True, True])


def test_a_stack_outside_vmap_is_named():
  # Ops given a stack for jax.vmap outside it read the stack's axis as the rows: todense and submconv3d raised
  # JAX's "Incompatible shapes for broadcasting", batch norm returned wrong rows, capacity was the stack's length.
  tensors = _same_capacity(3, 3, 96)
  stacked = jax.tree.map(lambda *a: jnp.stack(a), *tensors)
  assert stacked.capacity == 96
  w = jnp.zeros((3, 3, 3, CHANNELS, 2), jnp.float32)
  with pytest.raises(ValueError, match=r"x is a stack of SparseTensors \(leading axes \(3,\).*inside jax.vmap"):
    jsparse.submconv3d(stacked, w, implementation="xla")
  with pytest.raises(ValueError, match="x is a stack of SparseTensors"):
    stacked.todense()
  # A shard_map block keeps the device's axis of 1: batch norm normalised it as [1, capacity, C] silently wrong.
  with pytest.raises(ValueError, match=r"leading axes \(1,\).*a\[0\] drops the device's axis"):
    jsparse.norm.batch_norm(jax.tree.map(lambda a: a[None], tensors[0]))
  np.testing.assert_array_equal(jsparse.overflowed(stacked), [False, False, False])  # one flag per element
  assert jax.vmap(lambda x: x.todense())(stacked).shape == (3,) + tensors[0].dense_shape
