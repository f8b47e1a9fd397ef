"""jsparse.nn (flax modules) and jsparse.norm against dense / flax references, on the CPU (XLA path)."""
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import ad_checkpoint, lax

import jsparse
import jsparse.conv
import jsparse.nn as snn
from jsparse import norm
from reference import random_sparse, rel_err

HIGHEST = lax.Precision.HIGHEST
# Parameter-init key. threefry's random kernels take seconds to compile per shape on the CPU; these tests only
# need some values, so they use the cheap rbg generator (test_submconv3d_dtypes keeps the default key).
KEY = jax.random.key(0, impl="unsafe_rbg")


def at_sites(x: jsparse.SparseTensor, dense):
  """dense [B, X, Y, Z, C] read at x's valid sites (zeros at padding rows)."""
  valid = x.valid_mask()
  c = jnp.where(valid[:, None], x.coords, 0)
  return jnp.where(valid[:, None], dense[c[:, 0], c[:, 1], c[:, 2], c[:, 3]], 0)


def perturb(tree, seed=1, scale=0.3):
  """Adds noise to every leaf (so zero-initialised biases are exercised too); numpy, so nothing compiles (an eager
  jnp add would compile one program per leaf shape)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda l: jnp.asarray(np.asarray(l) + np.asarray(scale * rng.standard_normal(l.shape), l.dtype),
                                            l.dtype), tree)


# ---- SubMConv3d vs nn.Conv on the dense tensor -----------------------------------------------------------

CONV_CASES = [
    # spatial, batch, cin, cout, kernel, dilation
    ((5, 6, 4), 1, 3, 5, 3, 1),
    ((7, 5, 6), 2, 4, 3, (3, 1, 5), 1),       # non-cubic grid, anisotropic kernel, batch > 1
    ((6, 7, 5), 3, 2, 4, 3, (2, 1, 2)),       # anisotropic dilation
    ((8, 6, 7), 2, 5, 2, (5, 3, 3), 2),
    ((4, 4, 4), 2, 3, 3, 1, 1),               # 1x1x1
]


@pytest.mark.parametrize("spatial,batch,cin,cout,kernel,dilation", CONV_CASES)
def test_submconv3d_module_matches_dense_conv(spatial, batch, cin, cout, kernel, dilation):
  rng = np.random.default_rng(hash((spatial, batch)) % 2**32)
  x = random_sparse(rng, spatial, cin, batch_size=batch, density=0.35, pad=9)
  sparse = snn.SubMConv3d(cout, kernel, kernel_dilation=dilation, precision="highest")
  dense = nn.Conv(cout, kernel if isinstance(kernel, tuple) else (kernel,) * 3, padding="SAME",
                  kernel_dilation=dilation, precision=HIGHEST)
  params = perturb(jax.jit(sparse.init)(KEY, x))
  # Same parameter names and layouts as nn.Conv: one tree drives both (shapes alone: nothing compiles).
  dense_shapes = jax.eval_shape(lambda: dense.init(KEY, x.todense()))
  assert jax.tree.map(jnp.shape, params) == jax.tree.map(lambda a: a.shape, dense_shapes)
  assert params["params"]["kernel"].shape == (*np.broadcast_to(kernel, 3), cin, cout)
  cot = jnp.asarray(rng.standard_normal((x.capacity, cout)), jnp.float32)

  def loss_sparse(params, feats):
    y = sparse.apply(params, x.replace(feats=feats))
    return jnp.sum(y.feats * cot), y.feats

  def loss_dense(params, feats):
    y = at_sites(x, dense.apply(params, x.replace(feats=feats).todense()))
    return jnp.sum(y * cot), y

  # jit: eager op-by-op dispatch on the CPU is several times slower than compiling these small graphs
  (_, ys), gs = jax.jit(jax.value_and_grad(loss_sparse, (0, 1), has_aux=True))(params, x.feats)
  (_, yd), gd = jax.jit(jax.value_and_grad(loss_dense, (0, 1), has_aux=True))(params, x.feats)
  assert rel_err(ys, yd) < 1e-5
  assert np.all(np.asarray(ys[int(x.num):]) == 0)
  for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(gd)):
    assert rel_err(a, b) < 1e-5
  assert np.all(np.asarray(gs[1][int(x.num):]) == 0)


def test_submconv3d_stack_matches_dense():
  """conv -> activation -> conv: the dense twin must re-sparsify between layers (mask to the active sites)."""
  rng = np.random.default_rng(3)
  x = random_sparse(rng, (6, 5, 7), 3, batch_size=2, density=0.3, pad=4)

  class Stack(nn.Module):
    dense: bool = False

    @nn.compact
    def __call__(self, x):
      if self.dense:
        active = x.replace(feats=jnp.ones((x.capacity, 1))).todense()
        h = nn.Conv(6, (3, 3, 3), padding="SAME", precision=HIGHEST, name="c1")(x.todense())
        h = jnp.tanh(h) * active + 0.5 * active
        return at_sites(x, nn.Conv(2, (3, 1, 3), padding="SAME", precision=HIGHEST, name="c2")(h))
      h = snn.SubMConv3d(6, precision="highest", name="c1")(x)
      h = norm.activation(h, lambda f: jnp.tanh(f) + 0.5)  # fn(0) != 0: padding must stay zero
      return snn.SubMConv3d(2, (3, 1, 3), precision="highest", name="c2")(h).feats

  params = perturb(jax.jit(Stack().init)(KEY, x))
  f = lambda p: jnp.sum(jnp.sin(Stack().apply(p, x)))
  fd = lambda p: jnp.sum(jnp.sin(Stack(dense=True).apply(p, x)))
  assert rel_err(jax.jit(Stack().apply)(params, x), jax.jit(Stack(dense=True).apply)(params, x)) < 1e-5
  for a, b in zip(jax.tree.leaves(jax.jit(jax.grad(f))(params)), jax.tree.leaves(jax.jit(jax.grad(fd))(params))):
    assert rel_err(a, b) < 1e-5


def test_submconv3d_dtypes():
  x = random_sparse(np.random.default_rng(0), (4, 4, 4), 3, pad=2)
  m = snn.SubMConv3d(4)
  params = m.init(jax.random.key(0), x)  # the default (threefry) key, as users will pass
  assert params["params"]["kernel"].dtype == jnp.float32
  xb = x.replace(feats=x.feats.astype(jnp.bfloat16))
  assert m.apply(params, xb).dtype == jnp.float32  # flax's promotion: bf16 feats x f32 params -> f32
  assert snn.SubMConv3d(4, dtype=jnp.bfloat16).apply(params, x).dtype == jnp.bfloat16


# ---- normalisations --------------------------------------------------------------------------------------


def _norm_input(seed=0, batch=3, channels=8, pad=11):
  rng = np.random.default_rng(seed)
  x = random_sparse(rng, (5, 4, 6), channels, batch_size=batch, density=0.3, pad=pad)
  # Non-zero means and unequal scales per channel, so a statistic that counted padding rows would be off.
  feats = x.feats * jnp.linspace(0.5, 3.0, channels) + jnp.linspace(-2.0, 4.0, channels)
  return x.replace(feats=jnp.where(x.valid_mask()[:, None], feats, 0))


def test_batch_norm_matches_numpy_and_flax_on_valid_rows():
  x = _norm_input()
  n = int(x.num)
  m = snn.SparseBatchNorm(momentum=0.9)
  variables = jax.jit(lambda x: m.init(KEY, x, use_running_average=False))(x)
  params = perturb(variables["params"])
  train = jax.jit(lambda v, x: m.apply(v, x, False, mutable=["batch_stats"]))  # one program for both steps
  y, upd = train({"params": params, "batch_stats": variables["batch_stats"]}, x)

  rows = np.asarray(x.feats[:n], np.float64)
  mean, var = rows.mean(0), rows.var(0)
  ref = (rows - mean) / np.sqrt(var + 1e-5) * np.asarray(params["scale"]) + np.asarray(params["bias"])
  assert rel_err(y.feats[:n], ref) < 1e-5
  assert np.all(np.asarray(y.feats[n:]) == 0)  # padding rows exactly zero despite the bias
  # Running averages: momentum * old + (1 - momentum) * batch statistic (old mean 0, old var 1).
  assert rel_err(upd["batch_stats"]["mean"], 0.1 * mean) < 1e-5
  assert rel_err(upd["batch_stats"]["var"], 0.9 + 0.1 * var) < 1e-5
  y2, upd2 = train({"params": params, **upd}, x)
  assert rel_err(upd2["batch_stats"]["mean"], 0.9 * 0.1 * mean + 0.1 * mean) < 1e-5

  # Inference uses the running averages.
  ye = jax.jit(lambda v, x: m.apply(v, x, use_running_average=True))({"params": params, **upd}, x)
  rm, rv = np.asarray(upd["batch_stats"]["mean"]), np.asarray(upd["batch_stats"]["var"])
  ref_e = (rows - rm) / np.sqrt(rv + 1e-5) * np.asarray(params["scale"]) + np.asarray(params["bias"])
  assert rel_err(ye.feats[:n], ref_e) < 1e-5 and np.all(np.asarray(ye.feats[n:]) == 0)

  # Gradients (input and params) equal flax's BatchNorm applied to the valid rows alone.
  cot = jnp.asarray(np.random.default_rng(1).standard_normal(x.feats.shape), jnp.float32)
  flax_bn = nn.BatchNorm(use_running_average=False, momentum=0.9, use_fast_variance=False)
  bn_vars = {"batch_stats": variables["batch_stats"]}
  fs = lambda p, f: jnp.sum(
      m.apply({"params": p, **bn_vars}, x.replace(feats=f), False, mutable=["batch_stats"])[0].feats * cot)
  fd = lambda p, f: jnp.sum(flax_bn.apply({"params": p, **bn_vars}, f[:n], mutable=["batch_stats"])[0] * cot[:n])
  gs, gd = jax.jit(jax.grad(fs, (0, 1)))(params, x.feats), jax.jit(jax.grad(fd, (0, 1)))(params, x.feats)
  for a, b in zip(jax.tree.leaves(gs), jax.tree.leaves(gd)):
    assert rel_err(a, b) < 1e-4
  assert np.all(np.asarray(gs[1][n:]) == 0)


def test_layer_norm_matches_flax_on_valid_rows():
  x = _norm_input(1)
  n = int(x.num)
  m = snn.SparseLayerNorm()
  params = perturb(jax.jit(m.init)(KEY, x))
  y = jax.jit(m.apply)(params, x)
  ref = jax.jit(nn.LayerNorm().apply)(params, x.feats[:n])
  rows = np.asarray(x.feats[:n], np.float64)
  ref_np = (rows - rows.mean(-1, keepdims=True)) / np.sqrt(rows.var(-1, keepdims=True) + 1e-6)
  ref_np = ref_np * np.asarray(params["params"]["scale"]) + np.asarray(params["params"]["bias"])
  assert rel_err(y.feats[:n], ref) < 1e-5 and rel_err(y.feats[:n], ref_np) < 1e-5
  assert np.all(np.asarray(y.feats[n:]) == 0)
  g = jax.jit(jax.grad(lambda f: jnp.sum(jnp.sin(m.apply(params, x.replace(feats=f)).feats))))(x.feats)
  gr = jax.jit(jax.grad(lambda f: jnp.sum(jnp.sin(nn.LayerNorm().apply(params, f[:n])))))(x.feats)
  assert rel_err(g, gr) < 1e-5


def test_norms_of_constant_features_are_zero():
  """A constant row (layer norm) or a constant group of an item (group norm) normalises to 0: XLA divides by a count
  as a product with its rounded reciprocal, so a mean left 1 ulp off gave +-0.7 (12345.678 over 5 channels) and
  +-0.06 (1000 over 194 rows of 4 channels) against sqrt(epsilon) = 1e-3."""
  sizes = (194, 196, 210)
  coords = np.concatenate([np.stack([np.full(k, b), np.arange(k) % 8, np.arange(k) // 8 % 8, np.arange(k) // 64], 1)
                           for b, k in enumerate(sizes)]).astype(np.int32)
  n = len(coords)
  for value, c, norm_fn in [(12345.678, 5, norm.layer_norm), (1000.0, 8, lambda x: norm.group_norm(x, 2))]:
    x = jsparse.SparseTensor.from_coords(coords, np.full((n, c), value, np.float32), (8, 8, 4), 3, capacity=n + 3)
    np.testing.assert_allclose(np.asarray(norm_fn(x).feats), 0.0, atol=1e-6)
  mean, var = norm.group_statistics(x, 2)
  np.testing.assert_array_equal(np.asarray(mean), 1000.0)
  np.testing.assert_allclose(np.asarray(var), 0.0, atol=1e-12)


@pytest.mark.parametrize("num_groups,group_size", [(4, None), (None, 2), (1, None)])
def test_group_norm_per_batch_item(num_groups, group_size):
  x = _norm_input(2, batch=3, channels=8)
  n = int(x.num)
  m = snn.SparseGroupNorm(num_groups=num_groups, group_size=group_size)
  params = perturb(jax.jit(m.init)(KEY, x))
  y = jax.jit(m.apply)(params, x)
  assert np.all(np.asarray(y.feats[n:]) == 0)
  g = num_groups or 8 // group_size
  coords, feats = np.asarray(x.coords[:n]), np.asarray(x.feats[:n], np.float64)
  scale, bias = np.asarray(params["params"]["scale"]), np.asarray(params["params"]["bias"])
  flax_gn = nn.GroupNorm(num_groups=num_groups, group_size=group_size)
  for b in range(x.batch_size):
    rows = coords[:, 0] == b
    assert rows.sum() > 0
    grouped = feats[rows].reshape(-1, g, 8 // g)
    mu = grouped.mean(axis=(0, 2), keepdims=True)
    var = grouped.var(axis=(0, 2), keepdims=True)
    ref = ((grouped - mu) / np.sqrt(var + 1e-6)).reshape(-1, 8) * scale + bias
    assert rel_err(np.asarray(y.feats[:n])[rows], ref) < 1e-5
    # flax's GroupNorm on the item's valid rows as a [1, rows, C] batch agrees too.
    ref_flax = jax.jit(flax_gn.apply)(params, jnp.asarray(feats[rows], jnp.float32)[None])[0]
    assert rel_err(np.asarray(y.feats[:n])[rows], ref_flax) < 1e-5

  # Gradient w.r.t. the input equals flax's per item, summed over items.
  cot = jnp.asarray(np.random.default_rng(5).standard_normal(x.feats.shape), jnp.float32)
  gs = jax.jit(jax.grad(lambda f: jnp.sum(m.apply(params, x.replace(feats=f)).feats * cot)))(x.feats)
  seg = np.where(np.arange(x.capacity) < n, np.asarray(x.coords[:, 0]), -1)
  items = [np.nonzero(seg == b)[0] for b in range(x.batch_size)]

  def dense_loss(f):
    return sum(jnp.sum(flax_gn.apply(params, f[i][None])[0] * cot[i]) for i in items)

  assert rel_err(gs, jax.jit(jax.grad(dense_loss))(x.feats)) < 1e-4


# Each activation and each dtype at least once, rather than the product (the activation's backward and the
# half-precision casts are separate steps of the unit), and silu, the one with a nonlinear derivative, in float32 too.
@pytest.mark.parametrize("act,dtype,tol", [(None, jnp.float32, 2e-5), (jax.nn.silu, jnp.float32, 2e-5),
                                           (jax.nn.relu, jnp.float16, 4e-3), (jax.nn.silu, jnp.bfloat16, 3e-2)],
                         ids=["none-float32", "silu-float32", "relu-float16", "silu-bfloat16"])
def test_group_norm_with_activation_values_and_gradients(dtype, tol, act):
  """group_norm(activation=...) (one custom_vjp unit) against autodiff of the textbook formula per batch item:
  output, and the gradients of feats, scale and bias, with three items of different sizes, padding rows holding
  garbage, a mean far from zero, and half precision."""
  rng = np.random.default_rng(3)
  sizes, pad, c, groups, eps = (70, 23, 41), 9, 12, 3, 1e-5
  coords = np.concatenate([np.stack([np.full(k, b), np.arange(k) % 5, np.arange(k) // 5 % 5, np.arange(k) // 25], 1)
                           for b, k in enumerate(sizes)]).astype(np.int32)
  n = len(coords)
  feats = (rng.standard_normal((n, c)) * 2.0 + 3.0).astype(np.float32)
  x = jsparse.SparseTensor.from_coords(coords, jnp.asarray(feats, dtype), (5, 5, 3), len(sizes), capacity=n + pad)
  x = x.replace(feats=x.feats.at[n:].set(jnp.asarray(7.5, dtype)))  # padding rows are never read
  scale = jnp.asarray(rng.standard_normal(c) + 1, jnp.float32)
  bias = jnp.asarray(rng.standard_normal(c), jnp.float32)
  w = jnp.asarray(rng.standard_normal((n + pad, c)), jnp.float32)
  order = np.asarray(x.coords[:n, 0])

  def ours(f, s, b):
    y = norm.group_norm(x.replace(feats=f), groups, s, b, epsilon=eps, activation=act)
    return jnp.sum(y.feats.astype(jnp.float32) * w), y.feats

  def reference(f, s, b):
    out = jnp.zeros((n + pad, c), jnp.float32)
    for item in range(len(sizes)):
      rows = np.nonzero(order == item)[0]
      v = f[rows].astype(jnp.float32).reshape(len(rows), groups, c // groups)
      mu, var = jnp.mean(v, axis=(0, 2), keepdims=True), jnp.var(v, axis=(0, 2), keepdims=True)
      z = ((v - mu) / jnp.sqrt(var + eps)).reshape(len(rows), c) * s + b
      out = out.at[rows].set(z if act is None else act(z))
    return jnp.sum(out * w), out

  (grads, y) = jax.jit(jax.grad(ours, (0, 1, 2), has_aux=True))(x.feats, scale, bias)
  (want_grads, want_y) = jax.jit(jax.grad(reference, (0, 1, 2), has_aux=True))(x.feats, scale, bias)
  assert y.dtype == dtype and np.all(np.asarray(y[n:]) == 0)
  assert rel_err(y, want_y) < tol
  for got, want in zip(grads, want_grads):
    assert np.all(np.isfinite(np.asarray(got, np.float32)))
    assert rel_err(got, want) < tol
  assert np.all(np.asarray(grads[0][n:]) == 0)


def test_group_norm_modules_fuse_the_activation():
  """SparseGroupNorm(activation=silu), linen and nnx, equals silu applied after the plain module (values and the
  input gradient), with the same parameter tree."""
  from flax import nnx
  from jsparse import nnx as snnx

  x = _norm_input(4, batch=3, channels=8)
  m, fused = snn.SparseGroupNorm(num_groups=4), snn.SparseGroupNorm(num_groups=4, activation=nn.silu)
  params = perturb(jax.jit(m.init)(KEY, x))
  assert jax.tree.structure(jax.eval_shape(fused.init, KEY, x)) == jax.tree.structure(params)
  cot = jnp.asarray(np.random.default_rng(2).standard_normal(x.feats.shape), jnp.float32)

  def pair(apply_plain, apply_fused):
    plain = lambda f: norm.activation(apply_plain(x.replace(feats=f)), jax.nn.silu).feats  # noqa: E731
    # one jitted program per function for its value and input gradient
    outs = [jax.jit(jax.value_and_grad(lambda f, fn=fn: (jnp.sum(fn(f) * cot), fn(f)), has_aux=True))(x.feats)
            for fn in (plain, lambda f: apply_fused(x.replace(feats=f)).feats)]
    both, grads = [o[0][1] for o in outs], [o[1] for o in outs]
    assert rel_err(both[1], both[0]) < 1e-6 and rel_err(grads[1], grads[0]) < 1e-5

  pair(lambda t: m.apply(params, t), lambda t: fused.apply(params, t))
  nm = snnx.SparseGroupNorm(8, 4, rngs=nnx.Rngs(0))
  nf = snnx.SparseGroupNorm(8, 4, activation=nnx.silu, rngs=nnx.Rngs(0))
  nm.scale[...] = nf.scale[...] = params["params"]["scale"]
  nm.bias[...] = nf.bias[...] = params["params"]["bias"]
  pair(nm, nf)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "separate"])
def test_norm_units_keep_only_their_input_for_the_backward(fused, capsys):
  """What autodiff keeps for the backward of a norm + SiLU, by JAX's own account (print_saved_residuals): the
  fused units (group norm and batch norm with activation=) keep one [rows, C] array, their input; a norm
  followed by a separate activation keeps several more (the count is asserted, so this test also shows what
  the fusion saves)."""
  n, c = 300, 64
  coords = np.stack([np.arange(n) % 2, np.arange(n) % 7, np.arange(n) // 7 % 7, np.arange(n) // 49], 1)
  x = jsparse.SparseTensor.from_coords(coords.astype(np.int32), jnp.ones((n, c), jnp.float16), (7, 7, 7), 2)
  s, b = jnp.ones(c), jnp.zeros(c)
  if fused:
    fns = [lambda f: norm.group_norm(x.replace(feats=f), 8, s, b, activation=jax.nn.silu).feats,
           lambda f: norm.batch_norm(x.replace(feats=f), s, b, activation=jax.nn.silu).feats]
  else:
    fns = [lambda f: norm.activation(norm.group_norm(x.replace(feats=f), 8, s, b), jax.nn.silu).feats]
  for fn in fns:
    ad_checkpoint.print_saved_residuals(fn, x.feats)
    kept = [line for line in capsys.readouterr().out.splitlines() if f"[{x.capacity},{c}]" in line]
    if fused:
      assert len(kept) == 1 and "from the argument" in kept[0], kept
    else:
      assert len(kept) >= 4, kept


def test_group_norm_empty_batch_item_is_finite():
  coords = np.array([[0, 1, 1, 1], [0, 2, 1, 1], [2, 0, 0, 0]], np.int32)  # item 1 has no sites
  x = jsparse.SparseTensor.from_coords(coords, np.arange(12, dtype=np.float32).reshape(3, 4), (3, 3, 3), 3,
                                       capacity=6)
  y = norm.group_norm(x, 2)
  assert np.all(np.isfinite(np.asarray(y.feats))) and np.all(np.asarray(y.feats[3:]) == 0)
  g = jax.grad(lambda f: jnp.sum(norm.group_norm(x.replace(feats=f), 2).feats ** 2))(x.feats)
  assert np.all(np.isfinite(np.asarray(g)))


def test_activation_keeps_padding_zero():
  x = _norm_input(3)
  n = int(x.num)
  for fn in (jax.nn.sigmoid, jnp.cos, lambda f: f + 1.0, nn.gelu):
    y = norm.activation(x, fn)
    assert np.all(np.asarray(y.feats[n:]) == 0)
    np.testing.assert_allclose(np.asarray(y.feats[:n]), np.asarray(fn(x.feats[:n])), rtol=1e-6)
  g = jax.grad(lambda f: jnp.sum(norm.activation(x.replace(feats=f), jnp.cos).feats))(x.feats)
  assert np.all(np.asarray(g[n:]) == 0)


def test_activation_takes_row_per_site_results_only():
  # A result without a row per site broadcast against the row mask into [capacity, capacity]; a channel change
  # (jax.nn.glu) is an activation's right.
  x = _norm_input(5)
  n = int(x.num)
  for fn in (lambda f: f.sum(axis=1), lambda f: f.sum(axis=0), lambda f: f[:1]):
    with pytest.raises(ValueError, match="fn must map"):
      norm.activation(x, fn)
  y = norm.activation(x, jax.nn.glu)
  assert y.feats.shape == (x.capacity, x.num_channels // 2)
  np.testing.assert_allclose(np.asarray(y.feats[:n]), np.asarray(jax.nn.glu(x.feats[:n])), rtol=1e-6)
  assert np.all(np.asarray(y.feats[n:]) == 0)


def test_norms_ignore_padding_amount():
  """The same sites with more padding rows (a bigger capacity bucket) give the same outputs."""
  x = _norm_input(4, pad=3)
  n = int(x.num)
  pad = 40
  x2 = jsparse.SparseTensor.from_coords(np.asarray(x.coords[:n]), x.feats[:n], x.spatial_shape, x.batch_size,
                                        capacity=n + pad)
  for m in (snn.SparseBatchNorm(use_running_average=False), snn.SparseLayerNorm(), snn.SparseGroupNorm(4)):
    v = jax.jit(m.init)(KEY, x)
    apply = jax.jit(lambda v, t, m=m: m.apply(v, t, mutable=["batch_stats"])[0])
    y1, y2 = apply(v, x), apply(v, x2)
    np.testing.assert_allclose(np.asarray(y1.feats[:n]), np.asarray(y2.feats[:n]), rtol=1e-5, atol=1e-6)


# ---- neighbour-map sharing, compilation, training --------------------------------------------------------


class ThreeConvs(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = snn.SubMConv3d(8)(x)
    x = snn.SparseBatchNorm(use_running_average=not train)(x)
    x = norm.activation(x, nn.relu)
    x = snn.SubMConv3d(8)(x)
    x = norm.activation(x, nn.relu)
    return snn.SubMConv3d(1)(x)


def test_conv_stack_builds_neighbor_map_once(monkeypatch):
  calls = []
  original = jsparse.conv.build_neighbor_map

  def counting(*args, **kwargs):
    calls.append(1)
    return original(*args, **kwargs)

  monkeypatch.setattr(jsparse.conv, "build_neighbor_map", counting)
  x = random_sparse(np.random.default_rng(0), (6, 6, 6), 4, batch_size=2, pad=6)
  model = ThreeConvs()
  variables = jax.jit(model.init)(KEY, x)
  assert len(calls) == 1
  calls.clear()
  fwd = jax.jit(lambda v, x: model.apply(v, x, mutable=["batch_stats"]))
  fwd(variables, x)
  assert len(calls) == 1  # three convolutions, one map
  # and in the backward pass too
  calls.clear()
  jax.jit(jax.grad(lambda v, x: jnp.sum(model.apply(v, x, mutable=["batch_stats"])[0].feats ** 2)))(variables, x)
  assert len(calls) == 1


def test_resnet_block():
  x = random_sparse(np.random.default_rng(1), (6, 5, 6), 4, batch_size=2, pad=5)
  n = int(x.num)
  for norm_kind, width in (("batch", 8), ("group", 8), (None, 4)):
    block = snn.SparseResNetBlock(width, norm=norm_kind, num_groups=4)
    v = jax.jit(block.init)(KEY, x)
    assert ("proj" in v["params"]) == (width != 4)

    def loss(p):
      y = block.apply({**v, "params": p}, x, mutable=["batch_stats"])[0]
      return jnp.sum(y.feats**2), y

    (_, y), g = jax.jit(jax.value_and_grad(loss, has_aux=True))(v["params"])
    assert y.feats.shape == (x.capacity, width) and np.all(np.asarray(y.feats[n:]) == 0)
    assert np.all(np.asarray(y.coords) == np.asarray(x.coords))
    assert all(np.all(np.isfinite(np.asarray(l))) for l in jax.tree.leaves(g))
    if norm_kind is None:
      # identity shortcut: with zero convolution kernels the block is relu(x)
      zeros = jax.tree.map(jnp.zeros_like, v)
      np.testing.assert_allclose(np.asarray(jax.jit(block.apply)(zeros, x).feats), np.asarray(jax.nn.relu(x.feats)))


def _random_batch(rng, n, spatial=(10, 10, 10), batch_size=2, channels=3):
  keys = rng.choice(batch_size * int(np.prod(spatial)), size=n, replace=False)
  coords = np.stack(np.unravel_index(keys, (batch_size,) + spatial), axis=-1).astype(np.int32)
  feats = rng.standard_normal((n, channels)).astype(np.float32)
  return jsparse.SparseTensor.from_coords(coords, feats, spatial, batch_size, capacity=jsparse.round_capacity(n))


def test_jitted_train_step_compiles_once_per_capacity_and_learns():
  rng = np.random.default_rng(0)
  teacher = snn.SubMConv3d(1)
  teacher_params = perturb(jax.jit(teacher.init)(KEY, _random_batch(rng, 50)), seed=8)

  class Student(nn.Module):
    @nn.compact
    def __call__(self, x):
      h = norm.activation(snn.SubMConv3d(16)(x), nn.relu)
      return snn.SubMConv3d(1)(h)

  student = Student()
  params = jax.jit(student.init)(KEY, _random_batch(rng, 50))
  opt = optax.adam(3e-2)
  opt_state = jax.jit(opt.init)(params)
  traces = []

  @jax.jit
  def step(params, opt_state, x):
    traces.append(x.capacity)  # runs once per compilation
    target = teacher.apply(teacher_params, x).feats

    def loss_fn(p):
      err = student.apply(p, x).feats - target  # zero at padding rows on both sides
      return jnp.sum(err**2) / x.num

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  losses, capacities = [], []
  for i in range(20):
    x = _random_batch(rng, int(rng.integers(150, 450)))  # capacities 256, 384, 512
    capacities.append(x.capacity)
    params, opt_state, loss = step(params, opt_state, x)
    losses.append(float(loss))
  distinct = len(set(capacities))
  assert distinct > 1
  assert len(traces) <= distinct, (traces, capacities)
  assert step._cache_size() <= distinct
  assert np.mean(losses[-4:]) < 0.3 * np.mean(losses[:4]), losses


# ---- data parallel ---------------------------------------------------------------------------------------


def test_data_parallel_shard_map_two_cpu_devices():
  script = os.path.join(os.path.dirname(__file__), "nn_data_parallel.py")
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  proc = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0 and "OK" in proc.stdout, proc.stdout + proc.stderr


# ---- bad input -------------------------------------------------------------------------------------------


def test_bad_input_errors():
  x = random_sparse(np.random.default_rng(0), (4, 4, 4), 3, pad=2)
  with pytest.raises(ValueError, match="strides must be 1"):
    snn.SubMConv3d(4, strides=2).init(KEY, x)
  with pytest.raises(ValueError, match="strides must be 1"):
    snn.SubMConv3d(4, strides=(1, 2, 1)).init(KEY, x)
  with pytest.raises(ValueError, match="padding must be 'SAME'"):
    snn.SubMConv3d(4, padding="VALID").init(KEY, x)
  with pytest.raises(ValueError, match="padding must be 'SAME'"):
    snn.SubMConv3d(4, padding=1).init(KEY, x)
  with pytest.raises(ValueError, match="kernel_size must be odd"):
    snn.SubMConv3d(4, kernel_size=(3, 2, 3)).init(KEY, x)
  with pytest.raises(TypeError, match="SparseTensor"):
    snn.SubMConv3d(4).init(KEY, x.todense())
  # An integer compute dtype is refused naming dtype (it failed after the promotion, naming feats).
  for module in (snn.SubMConv3d(4, dtype=jnp.int32), snn.SparseConv3d(4, 3, 2, dtype=jnp.bool_)):
    with pytest.raises(TypeError, match="dtype must be real floating point"):
      module.init(KEY, x)

  class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
      return snn.SubMConv3d(4, name="conv")(x)

  params = jax.jit(Net().init)(KEY, x)
  x5 = random_sparse(np.random.default_rng(1), (4, 4, 4), 5, pad=2)
  with pytest.raises(ValueError, match=r"'conv'.*expects 3 input channels.*has 5"):
    Net().apply(params, x5)
  with pytest.raises(ValueError, match="expects 3 input channels"):
    jax.jit(Net().apply)(params, x5)

  x6 = random_sparse(np.random.default_rng(1), (4, 4, 4), 6, pad=2)
  with pytest.raises(ValueError, match=r"channels \(6\) must be divisible by num_groups \(4\)"):
    snn.SparseGroupNorm(num_groups=4).init(KEY, x6)
  with pytest.raises(ValueError, match="divisible by group_size"):
    snn.SparseGroupNorm(num_groups=None, group_size=4).init(KEY, x6)
  with pytest.raises(ValueError, match="exactly one of num_groups and group_size"):
    snn.SparseGroupNorm(num_groups=2, group_size=3).init(KEY, x6)
  for bad in (0, -2, 2.0, True):
    with pytest.raises(ValueError, match=r"num_groups must be a positive int"):
      snn.SparseGroupNorm(num_groups=bad).init(KEY, x6)
    with pytest.raises(ValueError, match=r"group_size must be a positive int"):
      snn.SparseGroupNorm(num_groups=None, group_size=bad).init(KEY, x6)
  with pytest.raises(ValueError, match="divisible by num_groups"):
    norm.group_norm(x6, 4)
  with pytest.raises(ValueError, match="scale must have shape"):
    norm.batch_norm(x6, jnp.ones(5))


def test_norms_name_a_channel_mismatch_with_their_variables():
  """A norm applied to an input of another width than its variables: a ValueError naming the variable and the
  widths. Without scale and bias the batch norm's only per-channel state is its running statistics: a 1-channel
  input broadcast against 6-channel ones and returned 6-channel statistics, a 4-channel one failed inside."""
  x6 = _norm_input(0, channels=6)
  for channels in (1, 4):
    x = _norm_input(1, channels=channels)
    bn = snn.SparseBatchNorm(use_scale=False, use_bias=False)
    variables = jax.jit(lambda t, bn=bn: bn.init(KEY, t, use_running_average=False))(x6)
    with pytest.raises(ValueError, match=rf"batch_stats 'mean' has shape \(6,\).*has {channels} channels"):
      bn.apply(variables, x, use_running_average=False, mutable=["batch_stats"])
    with pytest.raises(ValueError, match=rf"batch_stats 'mean' has shape \(6,\).*has {channels} channels"):
      bn.apply(variables, x, use_running_average=True)
    for m in (snn.SparseBatchNorm(use_running_average=True), snn.SparseLayerNorm(), snn.SparseGroupNorm(1)):
      with pytest.raises(ValueError, match=rf"{type(m).__name__}: its params 'scale' has shape \(6,\)"):
        m.apply(jax.jit(m.init)(KEY, x6), x)


def test_batch_norms_name_running_statistics_of_another_shape():
  """Running statistics loaded with a wrong shape (a PyTorch state dict's running_var reshaped to [C, 1], say):
  a ValueError naming the variable, in jsparse.nn and jsparse.nnx, with batch or running statistics. The linen
  module checked only "mean", so a [6, 1] "var" broadcast against the batch's [6] in the update and came back
  [6, 6] (a (1,) one came back (6,)), silently."""
  from flax import nnx
  import jsparse.nnx as snnx
  x = _norm_input(0, channels=6)
  bn = snn.SparseBatchNorm(epsilon=1e-3, momentum=0.99)
  variables = jax.jit(lambda t: bn.init(KEY, t, use_running_average=False))(x)
  for bad in (jnp.ones((6, 1)), jnp.ones(1)):
    for name in ("mean", "var"):
      loaded = {**variables, "batch_stats": {**variables["batch_stats"], name: bad}}
      for use_running_average in (False, True):
        with pytest.raises(ValueError, match=rf"SparseBatchNorm: its batch_stats '{name}' has shape "
                                             rf"\({bad.shape[0]},( 1)?\) but the input SparseTensor has 6 channels"):
          bn.apply(loaded, x, use_running_average=use_running_average, mutable=["batch_stats"])
      module = snnx.SparseBatchNorm(6, rngs=nnx.Rngs(0))
      getattr(module, name).set_value(bad)  # as nnx.update puts a loaded state
      for use_running_average in (False, True):
        with pytest.raises(ValueError, match=rf"SparseBatchNorm: its BatchStat '{name}' has shape "
                                             rf"\({bad.shape[0]},( 1)?\) but num_features is 6"):
          module(x, use_running_average=use_running_average)


def test_conv_modules_check_their_sizes_before_making_the_kernel():
  """kernel_size < 1 reached the kernel parameter's initialiser (jnp's TypeError on a negative shape, naming
  neither module nor argument) unless the op's checks ran first; they ran only for SparseConv3d with "SAME"."""
  x = random_sparse(np.random.default_rng(0), (4, 4, 4), 3, pad=2)
  x2 = jsparse.SparseTensor.from_coords(np.array([[0, 1, 2]], np.int32), np.ones((1, 3), np.float32), (4, 4))
  cases = [(snn.SubMConv3d(4, -1), x, "SubMConv3d: kernel_size must be >= 1"),
           (snn.SubMConv2d(4, (3, -1)), x2, r"SubMConv2d: kernel_size must be >= 1, got \(3, -1\)"),
           (snn.SubMConv3d(4, kernel_dilation=0), x, "SubMConv3d: dilation must be >= 1"),
           (snn.SparseConv3d(4, -1, padding="VALID"), x, "SparseConv3d: kernel_size must be >= 1"),
           (snn.SparseConv3d(4, -1, padding=1), x, "SparseConv3d: kernel_size must be >= 1"),
           (snn.SparseConv3d(4, 3, 0, "VALID"), x, "SparseConv3d: stride must be >= 1"),
           (snn.SparseConv3d(4, 3, padding=-1), x, "SparseConv3d: padding must be >= 0")]
  for module, inp, message in cases:
    with pytest.raises(ValueError, match=message):
      module.init(KEY, inp)
  with pytest.raises(ValueError, match="SparseInverseConv3d: kernel_size must be >= 1"):
    snn.SparseInverseConv3d(4, -1, padding="VALID").init(KEY, x, like=x)


def test_size_of_wrong_rank_names_the_module_once():
  """A size of the wrong length (strides=(2, 2) for a 3D module) raised "SparseConv3d: SparseConv3d: strides
  must be ...": the size was lifted inside the block that prefixes the op's errors with the module's name, and
  the lifting had named it already."""
  x = random_sparse(np.random.default_rng(0), (4, 4, 4), 3, pad=2)
  cases = [(snn.SparseConv3d(4, 2, strides=(2, 2)), {}, "SparseConv3d", "strides"),
           (snn.SparseConv3d(4, (2, 2), strides=2), {}, "SparseConv3d", "kernel_size"),
           (snn.SparseConv3d(4, 3, kernel_dilation=(1, 1)), {}, "SparseConv3d", "kernel_dilation"),
           (snn.SparseInverseConv3d(4, 2, strides=(2, 2)), {"like": x}, "SparseInverseConv3d", "strides")]
  for module, kwargs, name, arg in cases:
    with pytest.raises(ValueError) as info:
      module.init(KEY, x, **kwargs)
    assert str(info.value).startswith(f"{name}: {arg} must be an int or 3 ints"), str(info.value)
    assert str(info.value).count(name) == 1, str(info.value)


def test_pool_sizes_of_wrong_length_name_the_module():
  """The pool modules passed kernel_size and strides to the op unchecked, so a size of the wrong length raised
  "kernel_size must be an int or 3 ints" without the module's name (every other module names itself); a
  SparseMaxPool2d still takes 2 ints and pools as the function does."""
  x = random_sparse(np.random.default_rng(0), (4, 4, 4), 3, pad=2)
  cases = [(snn.SparseMaxPool3d((2, 2)), "kernel_size"), (snn.SparseAvgPool3d(2, strides=(2, 2)), "strides")]
  for module, arg in cases:
    with pytest.raises(ValueError, match=rf"^{type(module).__name__}: {arg} must be an int or 3 ints"):
      module.apply({}, x)
  x2 = jsparse.SparseTensor.from_coords(np.array([[0, 1, 2], [0, 3, 3]], np.int32),
                                        np.array([[1.0], [2.0]], np.float32), (4, 4))
  y = snn.SparseMaxPool2d((2, 2), strides=(2, 2)).apply({}, x2)
  np.testing.assert_array_equal(y.todense(), jsparse.sparse_max_pool2d(x2, 2).todense())
  assert y.todense()[0, 0, 1, 0] == 1.0 and y.todense()[0, 1, 1, 0] == 2.0


def test_counts_take_numpy_integers():
  """features, feature_group_count and num_groups / group_size as numpy integers (a config read with numpy), as
  flax's modules and every size of the ops (kernel_size, strides) take them: the modules raised "must be a
  positive int, got np.int64(4)"; bools and floats still raise."""
  x = random_sparse(np.random.default_rng(0), (4, 4, 4), 4, pad=2)
  i = np.int64
  # the submanifold convolution's shapes alone (jax.eval_shape): nothing compiles
  assert jax.eval_shape(snn.SubMConv3d(i(6), feature_group_count=i(2)).init, KEY, x)["params"]["kernel"].shape == (
      3, 3, 3, 2, 6)
  # (eagerly: the strided convolution counts its output sites on the host)
  assert snn.SparseConv3d(i(6), i(2), i(2)).init(KEY, x)["params"]["kernel"].shape == (2, 2, 2, 4, 6)
  for gn in (snn.SparseGroupNorm(np.int32(2)), snn.SparseGroupNorm(num_groups=None, group_size=i(2))):
    assert jax.jit(lambda t, gn=gn: gn.apply(gn.init(KEY, t), t))(x).num_channels == 4
  for bad in (True, np.bool_(True), 4.0):
    with pytest.raises(ValueError, match="features must be a positive int"):
      snn.SubMConv3d(bad).init(KEY, x)
    with pytest.raises(ValueError, match="num_groups must be a positive int"):
      snn.SparseGroupNorm(bad).init(KEY, x)


def test_norm_defaults_are_flaxs_and_the_default_momentum_moves_running_averages():
  """The norm modules' defaults are flax's (momentum 0.99, epsilons, num_groups), and a training call with the
  default momentum moves the running averages by 1 - 0.99 towards the batch's statistics (two items, padding)."""
  for ours, theirs, fields in ((snn.SparseBatchNorm, nn.BatchNorm, ("momentum", "epsilon")),
                               (snn.SparseLayerNorm, nn.LayerNorm, ("epsilon",)),
                               (snn.SparseGroupNorm, nn.GroupNorm, ("epsilon", "num_groups", "group_size"))):
    for field in fields:
      assert getattr(ours(), field) == getattr(theirs(), field), (ours.__name__, field)
  x = random_sparse(np.random.default_rng(4), (3, 4, 5), 3, batch_size=2, pad=4)
  x = x.replace(feats=jnp.where(x.valid_mask()[:, None], x.feats * 2 + 1, 0))
  bn = snn.SparseBatchNorm()
  variables = bn.init(jax.random.key(0), x, use_running_average=False)
  _, state = bn.apply(variables, x, use_running_average=False, mutable=["batch_stats"])
  f = np.asarray(x.feats[: int(x.num)], np.float64)
  np.testing.assert_allclose(np.asarray(state["batch_stats"]["mean"]), 0.01 * f.mean(0), rtol=1e-4, atol=1e-7)
  np.testing.assert_allclose(np.asarray(state["batch_stats"]["var"]), 0.99 + 0.01 * f.var(0), rtol=1e-5)


@pytest.mark.parametrize("use_scale,use_bias", [(False, False), (True, True), (True, False), (False, True)])
def test_norm_output_dtype_promotes_as_flax(use_scale, use_bias):
  """flax's LayerNorm and GroupNorm return the promotion of the input's dtype and the dtypes of the parameters
  that exist: float32 with a float32 scale or bias (either one is enough), the input's own bfloat16 without
  either. Ours give the same dtype as flax's on the valid rows, and layer norm flax's values."""
  x = _norm_input(1)
  x = x.replace(feats=x.feats.astype(jnp.bfloat16))
  n = int(x.num)
  want = jnp.float32 if use_scale or use_bias else jnp.bfloat16
  kw = dict(use_scale=use_scale, use_bias=use_bias, param_dtype=jnp.float32)
  for ours, theirs in ((snn.SparseLayerNorm(**kw), nn.LayerNorm(**kw)),
                       (snn.SparseGroupNorm(num_groups=None, group_size=x.num_channels, **kw),
                        nn.GroupNorm(num_groups=None, group_size=x.num_channels, **kw))):
    params = perturb(jax.jit(ours.init)(KEY, x))
    y = jax.jit(ours.apply)(params, x)
    layer = isinstance(ours, snn.SparseLayerNorm)
    ref = jax.jit(theirs.apply)(params, x.feats[:n] if layer else x.feats[:n][None])
    assert y.feats.dtype == ref.dtype == want, type(ours).__name__
    if layer:
      assert rel_err(y.feats[:n], ref) < (1e-5 if want == jnp.float32 else 1e-2)


def test_norm_dtype_sets_the_output_dtype_as_flax():
  """dtype=bfloat16 on float32 features and parameters: the output is bfloat16 (flax's rule), close to flax's
  LayerNorm on the valid rows, for layer, group and batch norm."""
  x = _norm_input(2)
  n = int(x.num)
  ln = snn.SparseLayerNorm(dtype=jnp.bfloat16)
  params = perturb(jax.jit(ln.init)(KEY, x))
  y = jax.jit(ln.apply)(params, x)
  ref = jax.jit(nn.LayerNorm(dtype=jnp.bfloat16).apply)(params, x.feats[:n])
  assert y.feats.dtype == ref.dtype == jnp.bfloat16 and rel_err(y.feats[:n], ref) < 1e-2
  for m in (snn.SparseGroupNorm(num_groups=2, dtype=jnp.bfloat16), snn.SparseBatchNorm(dtype=jnp.bfloat16)):
    kw = {"use_running_average": False} if isinstance(m, snn.SparseBatchNorm) else {}
    variables = jax.jit(lambda x: m.init(KEY, x, **kw))(x)  # noqa: B023
    out = m.apply(variables, x, mutable=["batch_stats"], **kw)[0] if kw else m.apply(variables, x)
    assert out.feats.dtype == jnp.bfloat16, type(m).__name__


def test_norm_epsilons_are_used():
  """A large epsilon (1.0, against features of variance ~1-9) changes the answer: layer and group norm use the
  module's, as flax's LayerNorm and GroupNorm on the valid rows (one item's rows as a flax batch of one)."""
  x = _norm_input(3, batch=1, channels=8)
  n = int(x.num)
  for ours, theirs in ((snn.SparseLayerNorm(epsilon=1.0), nn.LayerNorm(epsilon=1.0)),
                       (snn.SparseGroupNorm(num_groups=2, epsilon=1.0), nn.GroupNorm(num_groups=2, epsilon=1.0))):
    params = perturb(jax.jit(ours.init)(KEY, x))
    y = jax.jit(ours.apply)(params, x)
    rows = x.feats[:n] if isinstance(ours, snn.SparseLayerNorm) else x.feats[:n][None]
    ref = jax.jit(theirs.apply)(params, rows).reshape(n, 8)
    assert rel_err(y.feats[:n], ref) < 1e-5, type(ours).__name__


def test_an_odhwi_kernel_is_initialised_as_the_dhwio_one_transposed():
  """kernel_layout="ODHWI" draws the DHWIO kernel (the fan-in and fan-out that nn.Conv's initialiser reads) and
  moves its output axis first: the same values as the DHWIO module's, for any initialiser."""
  x = random_sparse(np.random.default_rng(2), (4, 4, 4), 6, density=0.5)
  for kernel_init in (nn.initializers.lecun_normal(), nn.initializers.variance_scaling(2.0, "fan_out", "uniform")):
    dhwio = snn.SubMConv3d(5, (3, 1, 3), kernel_init=kernel_init).init(jax.random.PRNGKey(3), x)
    odhwi = snn.SubMConv3d(5, (3, 1, 3), kernel_init=kernel_init, kernel_layout="ODHWI").init(jax.random.PRNGKey(3), x)
    np.testing.assert_array_equal(np.asarray(odhwi["params"]["kernel"]),
                                  np.moveaxis(np.asarray(dhwio["params"]["kernel"]), -1, 0))
