"""jsparse.nnx (flax.nnx modules) against their jsparse.nn (flax.linen) twins and dense references, on the CPU."""
import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jsparse
import jsparse.nn as snn
import jsparse.nnx as snnx
from reference import dense_submconv_at_sites, random_sparse, rel_err

# threefry's random kernels compile slowly per shape on the CPU; the values only need to be some values.
KEY = jax.random.key(0, impl="unsafe_rbg")
HALF_TOL = {jnp.float32: 1e-6, jnp.float16: 2e-3, jnp.bfloat16: 1e-2}


def perturb(tree, seed=1, scale=0.3):
  """Noise on every leaf (zero-initialised biases and unit scales are exercised too); numpy, nothing compiles
  (an eager jnp add would compile one program per leaf shape and dtype)."""
  rng = np.random.default_rng(seed)
  return jax.tree.map(lambda l: jnp.asarray(np.asarray(l) + np.asarray(scale * rng.standard_normal(l.shape), l.dtype),
                                            l.dtype), tree)


def linen_init(module, *args, **kwargs):
  """module.init(KEY, *args, **kwargs) as one jitted program (eagerly, every op of the initialisers and of the
  forward compiles on its own)."""
  return jax.jit(functools.partial(module.init, **kwargs))(KEY, *args)


def assert_trees_close(a, b, tol):
  assert jax.tree.structure(a) == jax.tree.structure(b)
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
    assert x.shape == y.shape and x.dtype == y.dtype
    assert rel_err(x, y) <= tol, rel_err(x, y)


def nnx_value_and_grads(model, x, cot, call):
  """(output feats, d loss / d params as a pure dict, d loss / d feats) with loss = sum(out * cot)."""

  def loss(model, feats):
    y = call(model, x.replace(feats=feats))
    return jnp.sum(y.feats.astype(jnp.float32) * cot), y.feats

  (_, y), (g_model, g_feats) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(model, x.feats)
  return y, nnx.to_pure_dict(g_model), g_feats


def linen_value_and_grads(module, variables, x, cot, call):
  def loss(params, feats):
    y = call(module, {**variables, "params": params}, x.replace(feats=feats))
    return jnp.sum(y.feats.astype(jnp.float32) * cot), y.feats

  (_, y), (g_params, g_feats) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(variables["params"], x.feats)
  return y, g_params, g_feats


# ---- convolutions ----------------------------------------------------------------------------------------


def _strided_pair(rng, dtype):
  """x and, for the inverse convolution, the coarse y of a stride-2 SparseConv3d of x."""
  x = random_sparse(rng, (6, 7, 5), 3, batch_size=2, density=0.4, pad=6, dtype=np.float32)
  y = jsparse.sparse_conv3d(x, jnp.zeros((2, 2, 2, 3, 4)), stride=2, out_capacity=x.capacity)
  y = y.replace(feats=jnp.asarray(rng.standard_normal(y.feats.shape), dtype) * y.valid_mask()[:, None])
  return x.replace(feats=x.feats.astype(dtype)), y


# name -> (linen module, nnx module given in_features and rngs, how both are called with x and the pair)
CONVS = {
    "submconv": (lambda dt: snn.SubMConv3d(5, (3, 1, 3), kernel_dilation=(1, 2, 1), dtype=dt, param_dtype=dt),
                 lambda dt, r: snnx.SubMConv3d(3, 5, (3, 1, 3), kernel_dilation=(1, 2, 1), dtype=dt, param_dtype=dt,
                                               rngs=r),
                 "x"),
    "submconv_odhwi": (lambda dt: snn.SubMConv3d(4, 3, kernel_layout="ODHWI", dtype=dt, param_dtype=dt),
                       lambda dt, r: snnx.SubMConv3d(3, 4, 3, kernel_layout="ODHWI", dtype=dt, param_dtype=dt,
                                                     rngs=r),
                       "x"),
    "sparse_conv": (lambda dt: snn.SparseConv3d(4, 3, strides=2, padding=1, out_capacity=256, dtype=dt,
                                                param_dtype=dt),
                    lambda dt, r: snnx.SparseConv3d(3, 4, 3, strides=2, padding=1, out_capacity=256, dtype=dt,
                                                    param_dtype=dt, rngs=r),
                    "x"),
    "inverse_conv": (lambda dt: snn.SparseInverseConv3d(5, 2, strides=2, padding=0, dtype=dt, param_dtype=dt),
                     lambda dt, r: snnx.SparseInverseConv3d(4, 5, 2, strides=2, padding=0, dtype=dt, param_dtype=dt,
                                                            rngs=r),
                     "inverse"),
    "conv_transpose": (lambda dt: snn.SparseConvTranspose3d(2, strides=(2, 1, 2), out_capacity=1024, dtype=dt,
                                                            param_dtype=dt),
                       lambda dt, r: snnx.SparseConvTranspose3d(3, 2, (2, 1, 2), out_capacity=1024, dtype=dt,
                                                                param_dtype=dt, rngs=r),
                       "x"),
    "conv_transpose_general": (
        lambda dt: snn.SparseConvTranspose3d(2, 2, 2048, kernel_size=(3, 2, 3), padding=(1, 0, 1),
                                             output_padding=(1, 0, 0), kernel_dilation=(1, 1, 2), dtype=dt,
                                             param_dtype=dt),
        lambda dt, r: snnx.SparseConvTranspose3d(3, 2, 2, kernel_size=(3, 2, 3), padding=(1, 0, 1),
                                                 output_padding=(1, 0, 0), kernel_dilation=(1, 1, 2),
                                                 out_capacity=2048, dtype=dt, param_dtype=dt, rngs=r),
        "x"),
}


# Each layer once and each dtype twice, rather than the product: the dtype handling (casting the inputs and the
# parameters to `dtype`, the float32 accumulation) is the one shared code path of every layer.
@pytest.mark.parametrize("name,dtype", [("submconv", jnp.float32), ("submconv_odhwi", jnp.float16),
                                        ("sparse_conv", jnp.bfloat16), ("inverse_conv", jnp.float32),
                                        ("conv_transpose", jnp.float16), ("conv_transpose_general", jnp.bfloat16)],
                         ids=lambda v: jnp.dtype(v).name if not isinstance(v, str) else v)
def test_conv_layers_match_linen(name, dtype):
  make_linen, make_nnx, inputs = CONVS[name]
  rng = np.random.default_rng(len(name))
  x, y = _strided_pair(rng, dtype)
  inp, call_linen, call_nnx = (x, lambda m, v, t: m.apply(v, t), lambda m, t: m(t))
  if inputs == "inverse":
    inp = y
    call_linen = lambda m, v, t: m.apply(v, t, like=x)  # noqa: E731
    call_nnx = lambda m, t: m(t, like=x)  # noqa: E731
  linen = make_linen(dtype)
  variables = perturb(linen_init(linen, *((y,) if inputs == "inverse" else (x,)),
                                 **({"like": x} if inputs == "inverse" else {})))
  model = make_nnx(dtype, nnx.Rngs(0))
  nnx.update(model, snnx.linen_to_nnx(variables, model))
  out_capacity = nnx.eval_shape(call_nnx, model, inp).capacity  # static: the shapes alone give it
  cot = jnp.asarray(rng.standard_normal((out_capacity, model.out_features)), jnp.float32)
  yn, gn, gxn = nnx_value_and_grads(model, inp, cot, call_nnx)
  yl, gl, gxl = linen_value_and_grads(linen, variables, inp, cot, call_linen)
  assert yn.dtype == jnp.dtype(dtype)
  tol = HALF_TOL[dtype]
  assert rel_err(yn, yl) <= tol and rel_err(gxn, gxl) <= tol
  assert_trees_close(gn, gl, tol)
  assert float(jnp.max(jnp.abs(yn.astype(jnp.float32)))) > 0


def test_strided_conv_defaults_are_linen_ones():
  """Every default the linen SparseConv3d / SparseInverseConv3d fields have, the nnx constructor has; neither
  defaults kernel_size."""
  import dataclasses
  import inspect
  for linen_cls, nnx_cls in ((snn.SparseConv3d, snnx.SparseConv3d),
                             (snn.SparseInverseConv3d, snnx.SparseInverseConv3d)):
    fields = {f.name: f for f in dataclasses.fields(linen_cls)}
    params = inspect.signature(nnx_cls.__init__).parameters
    assert params["kernel_size"].default is inspect.Parameter.empty
    assert fields["kernel_size"].default is dataclasses.MISSING
    for name in ("strides", "padding", "kernel_dilation", "use_bias", "dtype", "param_dtype", "precision",
                 "implementation", "kernel_layout", "out_capacity"):
      if name in fields:
        assert params[name].default == fields[name].default, name
    assert params["padding"].default == "SAME"


@functools.partial(jax.jit, static_argnums=(3, 4))
def _dense_same_conv_at(x, kernel, bias, strides, dilation, sites):
  """nn.Conv's "SAME" convolution of x.todense() in float32, read at the rows of `sites`."""
  from jax import lax
  dense = lax.conv_general_dilated(
      x.todense().astype(jnp.float32), kernel.astype(jnp.float32), strides, "SAME", rhs_dilation=dilation,
      dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), precision="highest") + bias.astype(jnp.float32)
  c = jnp.maximum(sites.coords, 0)
  return jnp.where(sites.valid_mask()[:, None], dense[c[:, 0], c[:, 1], c[:, 2], c[:, 3]], 0)


# Each kernel shape once and each dtype once, rather than the product: the "SAME" padding depends on the shapes
# alone, and the dtype handling is the one shared by every convolution layer.
@pytest.mark.parametrize("kernel_size,strides,dilation,dtype", [
    (2, 2, 1, jnp.float32), (3, 2, 1, jnp.float16), ((3, 2, 1), (2, 1, 2), (1, 1, 2), jnp.bfloat16)],
                         ids=["even-float32", "odd-float16", "mixed-bfloat16"])
def test_same_padding_conv_and_inverse_match_linen(kernel_size, strides, dilation, dtype):
  """The default ("SAME") SparseConv3d on odd extents (uneven padding) and the SparseInverseConv3d back onto x:
  nnx equals linen in values and in the gradients of parameters and features, and the convolution is the
  dense "SAME" convolution."""
  rng = np.random.default_rng(7)
  x = random_sparse(rng, (7, 6, 5), 3, batch_size=2, density=0.35, pad=6, dtype=np.float32)
  x = x.replace(feats=x.feats.astype(dtype))
  down_l = snn.SparseConv3d(4, kernel_size, strides, kernel_dilation=dilation, out_capacity=x.capacity,
                            dtype=dtype, param_dtype=dtype)
  up_l = snn.SparseInverseConv3d(5, kernel_size, strides, kernel_dilation=dilation, dtype=dtype,
                                 param_dtype=dtype)
  v_down = perturb(linen_init(down_l, x))
  y_l = jax.jit(down_l.apply)(v_down, x)
  v_up = perturb(linen_init(up_l, y_l, like=x), seed=2)
  down = snnx.SparseConv3d(3, 4, kernel_size, strides, kernel_dilation=dilation, out_capacity=x.capacity,
                           dtype=dtype, param_dtype=dtype, rngs=nnx.Rngs(0))
  up = snnx.SparseInverseConv3d(4, 5, kernel_size, strides, kernel_dilation=dilation, dtype=dtype,
                                param_dtype=dtype, rngs=nnx.Rngs(1))
  nnx.update(down, snnx.linen_to_nnx(v_down, down))
  nnx.update(up, snnx.linen_to_nnx(v_up, up))
  st = (strides,) * 3 if isinstance(strides, int) else strides
  assert y_l.spatial_shape == tuple(-(-n // s) for n, s in zip(x.spatial_shape, st))
  tol = HALF_TOL[dtype]

  # The strided convolution alone, against linen and the dense convolution.
  cot = jnp.asarray(rng.standard_normal((x.capacity, 4)), jnp.float32)
  yn, gn, gxn = nnx_value_and_grads(down, x, cot, lambda m, t: m(t))
  yl, gl, gxl = linen_value_and_grads(down_l, v_down, x, cot, lambda m, v, t: m.apply(v, t))
  assert yn.dtype == jnp.dtype(dtype)
  assert rel_err(yn, yl) <= tol and rel_err(gxn, gxl) <= tol
  assert_trees_close(gn, gl, tol)
  y = down(x)
  assert y.spatial_shape == y_l.spatial_shape and int(y.num) == int(y_l.num) > 0
  dense = _dense_same_conv_at(x, v_down["params"]["kernel"], v_down["params"]["bias"], tuple(st),
                              (dilation,) * 3 if isinstance(dilation, int) else tuple(dilation), y)
  assert rel_err(y.feats.astype(jnp.float32), dense) <= max(tol, 1e-5)

  # The pair: down then back up onto x, gradients through both.
  def nnx_pair(models, feats):
    d, u = models
    t = x.replace(feats=feats)
    return u(d(t), like=t)

  def loss_nnx(models, feats):
    out = nnx_pair(models, feats)
    return jnp.sum(out.feats.astype(jnp.float32) * cot5), out.feats

  def loss_linen(params, feats):
    t = x.replace(feats=feats)
    out = up_l.apply({"params": params[1]}, down_l.apply({"params": params[0]}, t), like=t)
    return jnp.sum(out.feats.astype(jnp.float32) * cot5), out.feats

  cot5 = jnp.asarray(rng.standard_normal((x.capacity, 5)), jnp.float32)
  (_, zn), (gmn, gfn) = nnx.jit(nnx.value_and_grad(loss_nnx, argnums=(0, 1), has_aux=True))((down, up), x.feats)
  (_, zl), (gpl, gfl) = jax.jit(jax.value_and_grad(loss_linen, (0, 1), has_aux=True))(
      (v_down["params"], v_up["params"]), x.feats)
  assert rel_err(zn, zl) <= tol and rel_err(gfn, gfl) <= tol
  assert_trees_close(nnx.to_pure_dict(gmn[0]), gpl[0], tol)
  assert_trees_close(nnx.to_pure_dict(gmn[1]), gpl[1], tol)
  z = nnx_pair((down, up), x.feats)
  assert z.spatial_shape == x.spatial_shape and np.array_equal(np.asarray(z.coords), np.asarray(x.coords))
  z_l = jax.jit(up_l.apply)(v_up, y_l, like=x)  # linen's too: on x's grid, not on the "SAME"-padded one
  assert z_l.spatial_shape == x.spatial_shape and np.array_equal(np.asarray(z_l.coords), np.asarray(x.coords))
  assert float(jnp.max(jnp.abs(zn.astype(jnp.float32)))) > 0


def test_valid_and_int_padding_keep_the_grid():
  """padding="VALID" is padding 0, and ints pad symmetrically, in both families alike."""
  x = random_sparse(np.random.default_rng(3), (7, 6, 5), 3, batch_size=2, density=0.35, pad=6)
  for padding, expect in (("VALID", (3, 3, 2)), ((1, 0, 1), (4, 3, 3))):
    linen = snn.SparseConv3d(4, 2, 2, padding=padding, out_capacity=x.capacity)
    v = perturb(linen_init(linen, x))
    model = snnx.SparseConv3d(3, 4, 2, 2, padding=padding, out_capacity=x.capacity, rngs=nnx.Rngs(0))
    nnx.update(model, snnx.linen_to_nnx(v, model))
    y, y_l = nnx.jit(lambda m, t: m(t))(model, x), jax.jit(linen.apply)(v, x)
    assert y.spatial_shape == y_l.spatial_shape == expect
    assert rel_err(y.feats, y_l.feats) <= 1e-6


def test_submconv_matches_dense_reference_and_round_trips():
  """An nnx layer's own parameters, exported to linen, give the same output, and that output is the dense
  convolution's (the other direction of linen_to_nnx)."""
  rng = np.random.default_rng(3)
  x = random_sparse(rng, (6, 5, 7), 4, batch_size=2, pad=5)
  model = snnx.SubMConv3d(4, 6, 3, kernel_dilation=(2, 1, 1), precision="highest", rngs=nnx.Rngs(1))
  model.bias[...] = jnp.asarray(rng.standard_normal(6), jnp.float32)
  variables = snnx.nnx_to_linen(model)
  assert set(variables) == {"params"} and variables["params"]["kernel"].shape == (3, 3, 3, 4, 6)
  y = nnx.jit(lambda m, t: m(t))(model, x)
  ref = dense_submconv_at_sites(x, x.feats, model.kernel[...], model.bias[...], dilation=(2, 1, 1))
  assert rel_err(y.feats, ref) < 1e-5
  linen = snn.SubMConv3d(6, 3, kernel_dilation=(2, 1, 1), precision="highest")
  assert rel_err(jax.jit(linen.apply)(variables, x).feats, y.feats) < 1e-6


# ---- pools -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pools_match_linen(kind):
  rng = np.random.default_rng(5)
  x = random_sparse(rng, (7, 6, 5), 3, batch_size=2, density=0.4, pad=4)
  linen = (snn.SparseMaxPool3d if kind == "max" else snn.SparseAvgPool3d)(3, 2, 1, out_capacity=x.capacity)
  model = (snnx.SparseMaxPool3d if kind == "max" else snnx.SparseAvgPool3d)(3, 2, 1, out_capacity=x.capacity)
  f_l = jax.jit(jax.value_and_grad(lambda f: jnp.sum(jnp.sin(linen.apply({}, x.replace(feats=f)).feats))))
  f_n = nnx.jit(nnx.value_and_grad(lambda m, f: jnp.sum(jnp.sin(m(x.replace(feats=f)).feats)), argnums=1))
  (vl, gl), (vn, gn) = f_l(x.feats), f_n(model, x.feats)
  assert rel_err(vn, vl) < 1e-6 and rel_err(gn, gl) < 1e-6 and float(jnp.abs(gn).sum()) > 0


# ---- normalisations --------------------------------------------------------------------------------------


NORMS = {
    "layer": (lambda dt: snn.SparseLayerNorm(dtype=dt, param_dtype=dt),
              lambda dt, r: snnx.SparseLayerNorm(8, dtype=dt, param_dtype=dt, rngs=r)),
    "group": (lambda dt: snn.SparseGroupNorm(num_groups=None, group_size=2, dtype=dt, param_dtype=dt),
              lambda dt, r: snnx.SparseGroupNorm(8, None, 2, dtype=dt, param_dtype=dt, rngs=r)),
    "batch_eval": (lambda dt: snn.SparseBatchNorm(use_running_average=True, dtype=dt, param_dtype=dt),
                   lambda dt, r: snnx.SparseBatchNorm(8, use_running_average=True, dtype=dt, param_dtype=dt,
                                                      rngs=r)),
    "batch_relu": (lambda dt: snn.SparseBatchNorm(use_running_average=False, activation=nn.relu),
                   lambda dt, r: snnx.SparseBatchNorm(8, activation=nnx.relu, rngs=r)),
}


# Each norm once and each dtype at least once, rather than the product: the dtype handling (statistics in float32,
# the output cast to `dtype`) is the one code path shared by every norm.
# batch_relu takes a half-precision input with the default dtype, which must follow the input's.
@pytest.mark.parametrize("name,dtype", [("layer", jnp.float32), ("group", jnp.bfloat16), ("batch_eval", jnp.float16),
                                        ("batch_relu", jnp.float16)],
                         ids=lambda v: jnp.dtype(v).name if not isinstance(v, str) else v)
def test_norm_layers_match_linen(name, dtype):
  rng = np.random.default_rng(11)
  x = random_sparse(rng, (5, 6, 4), 8, batch_size=3, pad=7)
  x = x.replace(feats=(2.0 + 1.5 * x.feats).astype(dtype))
  linen, model = NORMS[name][0](dtype), NORMS[name][1](dtype, nnx.Rngs(0))
  variables = perturb(linen_init(linen, x))
  if "batch_stats" in variables:  # valid running statistics: a positive variance
    variables["batch_stats"]["var"] = jnp.abs(variables["batch_stats"]["var"]) + 0.5
  nnx.update(model, snnx.linen_to_nnx(variables, model))
  cot = jnp.asarray(rng.standard_normal((x.capacity, 8)), jnp.float32)
  mutable = ["batch_stats"] if name == "batch_relu" else False
  call_linen = lambda m, v, t: m.apply(v, t, mutable=mutable)[0] if mutable else m.apply(v, t)  # noqa: E731
  yn, gn, gxn = nnx_value_and_grads(model, x, cot, lambda m, t: m(t))
  yl, gl, gxl = linen_value_and_grads(linen, variables, x, cot, call_linen)
  tol = HALF_TOL[dtype]
  assert rel_err(yn, yl) <= tol and rel_err(gxn, gxl) <= tol
  assert_trees_close(gn, gl, tol)
  assert np.all(np.asarray(yn[int(x.num):]) == 0)


def test_batch_norm_train_eval_and_running_statistics():
  rng = np.random.default_rng(2)
  momentum, eps = 0.8, 1e-5
  model = snnx.SparseBatchNorm(4, momentum=momentum, epsilon=eps, rngs=nnx.Rngs(0))
  model.scale[...] = jnp.asarray([1.0, 2.0, 0.5, -1.0])
  model.bias[...] = jnp.asarray([0.0, 1.0, -1.0, 3.0])
  linen = snn.SparseBatchNorm(momentum=momentum, epsilon=eps)
  step = nnx.jit(lambda m, t: m(t))
  mean, var = np.zeros(4), np.ones(4)
  for i in range(3):  # different batches, different padding
    x = random_sparse(rng, (5, 5, 5), 4, batch_size=2, pad=3 + 4 * i)
    x = x.replace(feats=(1.0 + i + (i + 2) * x.feats) * x.valid_mask()[:, None])
    variables = snnx.nnx_to_linen(model)
    y_linen, updated = jax.jit(lambda v, t: linen.apply(v, t, use_running_average=False,
                                                        mutable=["batch_stats"]))(variables, x)
    y = step(model, x)  # training mode (the default): batch statistics, running averages move
    f = np.asarray(x.feats[:int(x.num)], np.float64)
    bm, bv = f.mean(0), f.var(0)
    want = (f - bm) / np.sqrt(bv + eps) * np.asarray(model.scale[...]) + np.asarray(model.bias[...])
    np.testing.assert_allclose(np.asarray(y.feats[:int(x.num)]), want, rtol=1e-4, atol=1e-4)
    mean, var = momentum * mean + (1 - momentum) * bm, momentum * var + (1 - momentum) * bv
    np.testing.assert_allclose(np.asarray(model.mean[...]), mean, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(model.var[...]), var, rtol=1e-5)
    assert rel_err(y.feats, y_linen.feats) < 1e-6
    assert rel_err(model.mean[...], updated["batch_stats"]["mean"]) < 1e-6
    assert rel_err(model.var[...], updated["batch_stats"]["var"]) < 1e-6
  model.eval()
  assert model.use_running_average is True
  y = step(model, x)
  want = ((f - mean) / np.sqrt(var + eps)) * np.asarray(model.scale[...]) + np.asarray(model.bias[...])
  np.testing.assert_allclose(np.asarray(y.feats[:int(x.num)]), want, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(model.mean[...]), mean, rtol=1e-5)  # eval leaves them alone
  model.train()
  assert model.use_running_average is False
  snapshot = np.asarray(model.mean[...])
  model(x, use_running_average=True)  # the call's argument overrides the module's mode
  np.testing.assert_array_equal(np.asarray(model.mean[...]), snapshot)
  model.use_running_average = None
  with pytest.raises(ValueError, match="use_running_average is None"):
    model(x)


def test_batch_norm_pools_statistics_over_a_mapped_axis():
  """axis_name: under a mapped axis (vmap here, shard_map across devices) the statistics are those of every
  member's valid rows together, though the members hold different numbers of rows."""
  rng = np.random.default_rng(4)
  parts = []
  for n in (30, 55):
    coords = np.argwhere(rng.random((1, 6, 6, 6)) < 0.5)[:n].astype(np.int32)
    feats = (3.0 + 2.0 * rng.standard_normal((n, 4))).astype(np.float32)
    parts.append(jsparse.SparseTensor.from_coords(coords, feats, (6, 6, 6), 1, capacity=64))
  stacked = jax.tree.map(lambda a, b: jnp.stack([a, b]), *parts)
  model = snnx.SparseBatchNorm(4, momentum=0.5, axis_name="members", rngs=nnx.Rngs(0))
  graphdef, state = nnx.split(model)

  def member(state, x):
    bn = nnx.merge(graphdef, state)
    y = bn(x)
    return y.feats, nnx.state(bn, nnx.BatchStat)

  feats, stats = jax.jit(jax.vmap(member, in_axes=(None, 0), axis_name="members"))(state, stacked)
  rows = np.concatenate([np.asarray(p.feats[:int(p.num)]) for p in parts]).astype(np.float64)
  mean, var = rows.mean(0), rows.var(0)
  for k, p in enumerate(parts):
    want = (np.asarray(p.feats[:int(p.num)]) - mean) / np.sqrt(var + 1e-5)
    np.testing.assert_allclose(np.asarray(feats[k, :int(p.num)]), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(stats["mean"][k]), 0.5 * mean, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(stats["var"][k]), 0.5 + 0.5 * var, rtol=1e-5)


# ---- models and conversion -------------------------------------------------------------------------------


@pytest.mark.parametrize("norm_kind", ["group", "batch"])
def test_unet_matches_linen_both_directions(norm_kind):
  rng = np.random.default_rng(7)
  x = random_sparse(rng, (8, 8, 8), 3, batch_size=2, density=0.3, pad=9)
  linen = snn.SparseUNet((8, 16), out_features=2, norm=norm_kind, num_groups=4)
  variables = perturb(jax.jit(linen.init)(KEY, x), scale=0.1)
  if norm_kind == "batch":
    variables["batch_stats"] = jax.tree.map(lambda v: jnp.abs(v) + 0.5, variables["batch_stats"])
  model = snnx.SparseUNet(3, (8, 16), 2, norm=norm_kind, num_groups=4, rngs=nnx.Rngs(0))
  nnx.update(model, snnx.linen_to_nnx(variables, model))
  back = snnx.nnx_to_linen(model)
  assert jax.tree.structure(back) == jax.tree.structure(dict(variables))
  assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), back, dict(variables)))
  # linen -> nnx: same values and parameter gradients, in eval mode (running statistics).
  model.eval()
  cot = jnp.asarray(rng.standard_normal((x.capacity, 2)), jnp.float32)

  @jax.jit
  def linen_eval(v):  # the linen output and parameter gradients in eval mode, for any variables: one program
    def loss(params):
      y = linen.apply({**v, "params": params}, x, train=False)
      return jnp.sum(y.feats * cot), y.feats

    (_, y), g = jax.value_and_grad(loss, has_aux=True)(v["params"])
    return y, g

  yn, gn, _ = nnx_value_and_grads(model, x, cot, lambda m, t: m(t))
  yl, gl = linen_eval(variables)
  assert rel_err(yn, yl) < 1e-5
  assert_trees_close(gn, gl, 1e-5)
  # nnx -> linen: a freshly initialised nnx model's variables drive the linen model to the same output.
  fresh = snnx.SparseUNet(3, (8, 16), 2, norm=norm_kind, num_groups=4, rngs=nnx.Rngs(5))
  y_fresh = nnx.jit(lambda m, t: m(t, train=False))(fresh, x)
  y_linen, _ = linen_eval(snnx.nnx_to_linen(fresh))
  assert rel_err(y_fresh.feats, y_linen) < 1e-5 and float(jnp.abs(y_fresh.feats).max()) > 0


def test_resnet_block_matches_linen_in_training_mode():
  rng = np.random.default_rng(9)
  x = random_sparse(rng, (6, 5, 6), 4, batch_size=2, pad=5)
  linen = snn.SparseResNetBlock(8, norm="batch")
  variables = perturb(jax.jit(linen.init)(KEY, x), scale=0.1)
  model = snnx.SparseResNetBlock(4, 8, norm="batch", rngs=nnx.Rngs(0))
  nnx.update(model, snnx.linen_to_nnx(variables, model))
  y_linen, updated = jax.jit(lambda v, t: linen.apply(v, t, train=True, mutable=["batch_stats"]))(variables, x)
  y = nnx.jit(lambda m, t: m(t))(model, x)
  assert rel_err(y.feats, y_linen.feats) < 1e-5
  assert_trees_close(snnx.nnx_to_linen(model)["batch_stats"], updated["batch_stats"], 1e-6)


def test_conversion_errors_name_the_problem():
  x = random_sparse(np.random.default_rng(0), (4, 4, 4), 3, pad=2)
  variables = linen_init(snn.SubMConv3d(4), x)
  with pytest.raises(ValueError, match=r"shape \(3, 3, 3, 3, 4\) where the nnx model has \(3, 3, 3, 5, 4\)"):
    snnx.linen_to_nnx(variables, snnx.SubMConv3d(5, 4, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="missing bias"):
    snnx.linen_to_nnx(linen_init(snn.SubMConv3d(4, use_bias=False), x), snnx.SubMConv3d(3, 4, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="unexpected bias"):
    snnx.linen_to_nnx(variables, snnx.SubMConv3d(3, 4, use_bias=False, rngs=nnx.Rngs(0)))
  with pytest.raises(ValueError, match="collections.*'cache'"):
    snnx.linen_to_nnx({**variables, "cache": {}}, snnx.SubMConv3d(3, 4, rngs=nnx.Rngs(0)))
  with pytest.raises(TypeError, match="model must be an nnx.Module"):
    snnx.linen_to_nnx(variables, snn.SubMConv3d(4))
  with pytest.raises(TypeError, match="model must be an nnx.Module"):
    snnx.nnx_to_linen(variables)


def test_conv_layers_check_a_kernel_put_in_after_construction():
  """A kernel of another shape put into an nnx conv (a state dict loaded by hand; linen_to_nnx and flax's linen
  modules check shapes): a ValueError naming the layer and both shapes. The ops read the kernel size and output
  width off the kernel, so spconv's (3, 1, 1) kernel in a layer built for (1, 1, 3), or a DHWIO kernel in an
  ODHWI layer with as many input as output channels, ran as that other convolution, silently."""
  r = nnx.Rngs(0)
  x = random_sparse(np.random.default_rng(0), (6, 6, 6), 4, batch_size=2, pad=2)
  y = jsparse.sparse_conv3d(x, jnp.ones((4, 1, 1, 3, 4)), stride=(1, 1, 2), padding=(0, 0, 1), weight_layout="ODHWI")
  layers = [("SubMConv3d", snnx.SubMConv3d(4, 4, (1, 1, 3), use_bias=False, kernel_layout="ODHWI", rngs=r),
             lambda m: m(x)),
            ("SparseConv3d", snnx.SparseConv3d(4, 4, (1, 1, 3), (1, 1, 2), (0, 0, 1), use_bias=False,
                                               kernel_layout="ODHWI", rngs=r), lambda m: m(x)),
            ("SparseInverseConv3d", snnx.SparseInverseConv3d(4, 4, (1, 1, 3), (1, 1, 2), (0, 0, 1), use_bias=False,
                                                             kernel_layout="ODHWI", rngs=r), lambda m: m(y, like=x)),
            ("SparseConvTranspose3d", snnx.SparseConvTranspose3d(4, 4, (1, 1, 2), kernel_size=(1, 1, 3),
                                                                 use_bias=False, kernel_layout="ODHWI", rngs=r),
             lambda m: m(x))]
  for name, layer, call in layers:
    call(layer)  # its own kernel runs
    for bad in ((4, 3, 1, 1, 4), (1, 1, 3, 4, 4)):  # spconv's axes order; the DHWIO layout
      layer.kernel.set_value(jnp.ones(bad))
      with pytest.raises(ValueError, match=rf"^{name}: its kernel has shape {re.escape(str(bad))} but "
                                           r"kernel_size=\(1, 1, 3\), in_features=4, out_features=4 and "
                                           r"kernel_layout='ODHWI' make it \(4, 1, 1, 3, 4\)"):
        call(layer)
  # And a bias of another width, named with the layer (the op's own error named neither).
  layer = snnx.SubMConv3d(4, 4, 3, rngs=r)
  layer.bias.set_value(jnp.ones((4, 1)))
  with pytest.raises(ValueError, match=r"^SubMConv3d: its bias has shape \(4, 1\) but out_features=4 makes it \(4,\)"):
    layer(x)


def test_bad_arguments_errors():
  r = nnx.Rngs(0)
  x = random_sparse(np.random.default_rng(0), (4, 4, 4), 3, pad=2)
  with pytest.raises(ValueError, match="SubMConv3d: strides must be 1"):
    snnx.SubMConv3d(3, 4, strides=2, rngs=r)
  with pytest.raises(ValueError, match="kernel_size must be odd"):
    snnx.SubMConv3d(3, 4, (3, 2, 3), rngs=r)
  with pytest.raises(ValueError, match="padding must be 'SAME'"):
    snnx.SubMConv3d(3, 4, padding=1, rngs=r)
  with pytest.raises(ValueError, match="in_features must be a positive int"):
    snnx.SubMConv3d(0, 4, rngs=r)
  # numpy integers are counts too (as for nnx.Conv and the ops' sizes); they were "not a positive int".
  conv = snnx.SubMConv3d(np.int64(3), np.int64(6), feature_group_count=np.int64(3), rngs=r)
  assert conv.kernel.shape == (3, 3, 3, 1, 6) and type(conv.in_features) is int
  gn = snnx.SparseGroupNorm(np.int64(3), np.int64(3), rngs=r)
  assert gn(x).num_channels == 3 and type(gn.num_features) is int and type(gn.group_size) is int
  assert snnx.SparseBatchNorm(np.int32(3), rngs=r)(x).num_channels == 3
  # Sizes are checked before the kernel is made from them (a negative extent failed inside jnp, unnamed).
  with pytest.raises(ValueError, match="SubMConv3d: kernel_size must be >= 1"):
    snnx.SubMConv3d(3, 4, -1, rngs=r)
  with pytest.raises(ValueError, match="SubMConv3d: dilation must be >= 1"):
    snnx.SubMConv3d(3, 4, kernel_dilation=0, rngs=r)  # raised at the first call before
  for padding in ("SAME", "VALID", 1):
    with pytest.raises(ValueError, match="SparseConv3d: kernel_size must be >= 1"):
      snnx.SparseConv3d(3, 4, -1, padding=padding, rngs=r)
    with pytest.raises(ValueError, match="SparseInverseConv3d: kernel_size must be >= 1"):
      snnx.SparseInverseConv3d(3, 4, (3, -1, 3), padding=padding, rngs=r)
  with pytest.raises(ValueError, match="SparseConv3d: stride must be >= 1"):
    snnx.SparseConv3d(3, 4, 3, 0, "VALID", rngs=r)
  with pytest.raises(ValueError, match="kernel_layout must be one of"):
    snnx.SparseConv3d(3, 4, 3, kernel_layout="OIDHW", rngs=r)
  with pytest.raises(ValueError, match="SparseConv3d: padding must be 'SAME', 'VALID' or ints"):
    snnx.SparseConv3d(3, 4, 3, padding="FULL", rngs=r)
  with pytest.raises(ValueError, match="SparseInverseConv3d: padding must be 'SAME', 'VALID' or ints"):
    snnx.SparseInverseConv3d(3, 4, 3, padding="full", rngs=r)
  with pytest.raises(TypeError, match="kernel_size"):
    snnx.SparseConv3d(3, 4, rngs=r)  # required, as nnx.Conv's
  with pytest.raises(TypeError, match="dtype must be real floating point"):
    snnx.SubMConv3d(3, 4, dtype=jnp.int32, rngs=r)(x)
  with pytest.raises(TypeError, match="kernel_size"):
    snnx.SparseInverseConv3d(3, 4, rngs=r)
  with pytest.raises(ValueError, match="SparseMaxPool3d: padding must be"):
    snnx.SparseMaxPool3d(2, padding="FULL")
  with pytest.raises(ValueError, match="^SparseMaxPool3d: kernel_size must be an int or 3 ints"):
    snnx.SparseMaxPool3d((2, 2))(x)  # named the argument, not the module
  with pytest.raises(ValueError, match="^SparseAvgPool3d: strides must be an int or 3 ints"):
    snnx.SparseAvgPool3d(2, strides=(2, 2))(x)
  with pytest.raises(TypeError, match="rngs must be an nnx.Rngs"):
    snnx.SubMConv3d(3, 4, rngs=0)
  with pytest.raises(ValueError, match="expects 5 input channels but the input SparseTensor has 3"):
    snnx.SubMConv3d(5, 4, rngs=r)(x)
  with pytest.raises(TypeError, match="SubMConv3d takes a jsparse.SparseTensor"):
    snnx.SubMConv3d(3, 4, rngs=r)(x.todense())
  with pytest.raises(ValueError, match=r"channels \(6\) must be divisible by num_groups \(4\)"):
    snnx.SparseGroupNorm(6, 4, rngs=r)
  with pytest.raises(ValueError, match="exactly one of num_groups and group_size"):
    snnx.SparseGroupNorm(6, 2, 3, rngs=r)
  with pytest.raises(ValueError, match=r"built for 5 channels \(num_features\) but the input SparseTensor has 3"):
    snnx.SparseLayerNorm(5, rngs=r)(x)
  with pytest.raises(ValueError, match="norm must be 'batch', 'group' or None"):
    snnx.SparseResNetBlock(3, 4, norm="layer", rngs=r)
  with pytest.raises(TypeError, match="layer 1 is a flax.linen module"):
    snnx.Sequential(snnx.SubMConv3d(3, 4, rngs=r), snn.SubMConv3d(4))
  with pytest.raises(TypeError, match="layer 0 is a int"):
    snnx.Sequential(3)
  with pytest.raises(ValueError, match="Sequential: layers is empty"):
    snnx.Sequential()
  with pytest.raises(TypeError, match=r"no layer takes the keyword argument\(s\) \['determinstic'\]"):
    snnx.Sequential(snnx.SparseDropout(0.5, deterministic=True))(x, determinstic=True)
  with pytest.raises(TypeError, match="SparseDropout takes a jsparse.SparseTensor"):
    snnx.SparseDropout(0.5, deterministic=True)(x.feats)
  with pytest.raises(ValueError, match="no rngs were given"):
    snnx.SparseDropout(0.5)(x)
  with pytest.raises(ValueError, match=r"rate must be a number in \[0, 1\]"):
    snnx.SparseDropout(1.5)
  with pytest.raises(TypeError, match="rngs must be an nnx.Rngs, an nnx.RngStream or None"):
    snnx.SparseDropout(0.5, rngs=0)
  with pytest.raises(TypeError, match="ToDense takes a jsparse.SparseTensor"):
    snnx.ToDense()(x.feats)


# ---- training ---------------------------------------------------------------------------------------------


def _random_batch(rng, n, spatial=(10, 10, 10), batch_size=2, channels=3):
  keys = rng.choice(batch_size * int(np.prod(spatial)), size=n, replace=False)
  coords = np.stack(np.unravel_index(keys, (batch_size,) + spatial), axis=-1).astype(np.int32)
  feats = rng.standard_normal((n, channels)).astype(np.float32)
  return jsparse.SparseTensor.from_coords(coords, feats, spatial, batch_size, capacity=jsparse.round_capacity(n))


def test_nnx_training_loop_learns_without_recompiling_per_batch():
  """nnx.Optimizer + optax under nnx.jit on a small U-Net with batch norm: batches of varied sizes in a few
  capacity buckets compile once per bucket, and the loss goes down."""
  rng = np.random.default_rng(0)
  model = snnx.SparseUNet(3, (8, 16), 1, norm="batch", rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adam(2e-2), wrt=nnx.Param)
  traces = []

  @nnx.jit
  def train_step(model, optimizer, x):
    traces.append(x.capacity)  # runs once per compilation
    c = x.coords[:, 1:].astype(jnp.float32)
    target = jnp.sin(0.7 * c[:, :1]) * jnp.cos(0.5 * c[:, 1:2]) + x.feats[:, :1]
    target = jnp.where(x.valid_mask()[:, None], target, 0)

    def loss_fn(model):
      return jnp.sum((model(x).feats - target) ** 2) / x.num  # zero at padding rows on both sides

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses, capacities = [], []
  stats_before = np.asarray(model.bottom.norm1.mean[...])
  for _ in range(30):
    x = _random_batch(rng, int(rng.integers(150, 450)))  # capacities 256, 384, 512
    capacities.append(x.capacity)
    losses.append(float(train_step(model, optimizer, x)))
  distinct = len(set(capacities))
  assert distinct > 1
  assert len(traces) == distinct, (traces, capacities)
  assert np.mean(losses[-5:]) < 0.7 * np.mean(losses[:5]), losses
  assert not np.allclose(np.asarray(model.bottom.norm1.mean[...]), stats_before)  # running stats moved
  model.eval()
  x = _random_batch(rng, 300)
  y = nnx.jit(lambda m, t: m(t))(model, x)
  assert np.all(np.isfinite(np.asarray(y.feats))) and np.all(np.asarray(y.feats[int(x.num):]) == 0)


def test_readme_nnx_snippet(tmp_path):
  """The README's flax.nnx example runs as written (training step, eval, linen <-> nnx conversion)."""
  from test_packaging import readme_snippet, run_snippet
  run_snippet(readme_snippet("### flax.nnx") + "print('OK')\n", tmp_path, {"JAX_PLATFORMS": "cpu"})


# ---- containers --------------------------------------------------------------------------------------------


def _linen_and_nnx_sequentials(dtype=jnp.float32):
  """The same network in both families: convolutions, a batch norm, feature functions, dropout, a stride-2
  "SAME" SparseConv3d and a function of SparseTensors."""
  import functools
  pool = functools.partial(jsparse.sparse_max_pool3d, kernel_size=(2, 1, 2), stride=1, out_capacity=256)
  linen = snn.Sequential([snn.SubMConv3d(8, 3, dtype=dtype, param_dtype=dtype), snn.SparseBatchNorm(), nn.relu,
                          snn.SparseDropout(0.3), snn.SparseConv3d(6, 3, 2, out_capacity=256, dtype=dtype,
                                                                   param_dtype=dtype),
                          jnp.tanh, snn.TensorFn(pool), snn.SubMConv3d(2, 1, dtype=dtype, param_dtype=dtype)])
  r = nnx.Rngs(0, dropout=1)
  model = snnx.Sequential(snnx.SubMConv3d(3, 8, 3, dtype=dtype, param_dtype=dtype, rngs=r),
                          snnx.SparseBatchNorm(8, rngs=r), nnx.relu, snnx.SparseDropout(0.3, rngs=r),
                          snnx.SparseConv3d(8, 6, 3, 2, out_capacity=256, dtype=dtype, param_dtype=dtype, rngs=r),
                          jnp.tanh, snnx.TensorFn(pool), snnx.SubMConv3d(6, 2, 1, dtype=dtype, param_dtype=dtype,
                                                                         rngs=r))
  return linen, model


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
def test_sequential_matches_linen_values_gradients_and_statistics(dtype):
  """linen variables drive the nnx Sequential to the same output and gradients, with batch statistics in
  training mode (dropout off) and running statistics in eval mode; parameters convert both ways."""
  x = random_sparse(np.random.default_rng(4), (7, 6, 5), 3, batch_size=2, density=0.35, pad=6)
  x = x.replace(feats=x.feats.astype(dtype))
  linen, model = _linen_and_nnx_sequentials(dtype)
  variables = linen_init(linen, x, use_running_average=False, deterministic=True)
  assert set(variables["params"]) == {"layers_0", "layers_1", "layers_4", "layers_7"}
  variables = {"params": perturb(variables["params"]), "batch_stats": variables["batch_stats"]}
  nnx.update(model, snnx.linen_to_nnx(variables, model))
  tol = HALF_TOL[dtype]
  cot = jnp.asarray(np.random.default_rng(5).standard_normal((256, 2)), jnp.float32)

  # Training mode, dropout off: batch statistics, which move the running averages the same way.
  def linen_loss(params, feats):  # the updated running statistics come out of the same program
    y, updated = linen.apply({**variables, "params": params}, x.replace(feats=feats), use_running_average=False,
                             deterministic=True, mutable=["batch_stats"])
    return jnp.sum(y.feats.astype(jnp.float32) * cot), (y.feats, updated)

  (_, (yl, updated)), (gl, gxl) = jax.jit(jax.value_and_grad(linen_loss, (0, 1), has_aux=True))(
      variables["params"], x.feats)
  yn, gn, gxn = nnx_value_and_grads(model, x, cot, lambda m, t: m(t, deterministic=True))
  assert yn.dtype == jnp.dtype(dtype)
  assert rel_err(yn, yl) <= tol and rel_err(gxn, gxl) <= tol
  assert_trees_close(gn, gl, tol)
  # The nnx training pass above moved the running averages in place, by the same step.
  assert_trees_close(snnx.nnx_to_linen(model)["batch_stats"], updated["batch_stats"], 1e-5)
  assert not np.allclose(np.asarray(model.layers_1.mean[...]), 0)

  # Eval mode: model.eval() sets every flag; the linen twin is told them per call.
  model.eval()
  assert model.layers_3.deterministic and model.layers_1.use_running_average
  y_eval = nnx.jit(lambda m, t: m(t))(model, x)
  eval_l = jax.jit(lambda v, t: linen.apply(v, t, use_running_average=True, deterministic=True))
  y_eval_l = eval_l({"params": variables["params"], "batch_stats": updated["batch_stats"]}, x)
  assert rel_err(y_eval.feats, y_eval_l.feats) <= tol
  assert float(jnp.max(jnp.abs(y_eval.feats.astype(jnp.float32)))) > 0
  assert np.all(np.asarray(y_eval.feats[int(y_eval.num):]) == 0)
  # nnx -> linen: the nnx parameters drive the linen model to the same eval output.
  back = snnx.nnx_to_linen(model)
  y_back = eval_l(back, x)
  assert rel_err(y_back.feats, y_eval.feats) <= tol


def test_dropout_matches_linen_for_a_key_and_follows_train_eval():
  x = random_sparse(np.random.default_rng(6), (5, 5, 5), 4, batch_size=2, density=0.4, pad=5)
  key = jax.random.key(3)
  linen = snn.SparseDropout(0.4)
  y_l = linen.apply({}, x, deterministic=False, rng=key)
  model = snnx.SparseDropout(0.4)  # no stream: keys come per call
  y = model(x, rngs=key)
  np.testing.assert_array_equal(np.asarray(y.feats), np.asarray(y_l.feats))
  n = int(x.num)
  kept = np.asarray(y.feats[:n]) != 0
  assert 0.3 < kept.mean() < 0.9
  np.testing.assert_allclose(np.asarray(y.feats[:n])[kept], (np.asarray(x.feats[:n]) / 0.6)[kept], rtol=1e-6)
  assert np.all(np.asarray(y.feats[n:]) == 0) and y.coords is x.coords
  # A stream from the constructor: each call draws a new key; eval() (or deterministic=True) passes x through.
  model = snnx.SparseDropout(0.4, rngs=nnx.Rngs(dropout=0))
  step = nnx.jit(lambda m, t: m(t))
  a, b = step(model, x), step(model, x)
  assert not np.array_equal(np.asarray(a.feats), np.asarray(b.feats))
  assert model(x, deterministic=True).feats is x.feats
  model.eval()
  assert step(model, x).feats.shape == x.feats.shape
  np.testing.assert_array_equal(np.asarray(step(model, x).feats), np.asarray(x.feats))
  model.train()
  assert not np.array_equal(np.asarray(step(model, x).feats), np.asarray(x.feats))
  # Rate 0 draws no key, so it needs no rngs.
  assert snnx.SparseDropout(0.0)(x).feats is x.feats


@pytest.mark.parametrize("channels_first", [False, True])
def test_to_dense_matches_linen(channels_first):
  x = random_sparse(np.random.default_rng(8), (4, 5, 3), 3, batch_size=2, density=0.4, pad=3)
  d = nnx.jit(lambda m, t: m(t))(snnx.ToDense(channels_first), x)
  np.testing.assert_array_equal(np.asarray(d), np.asarray(jax.jit(snn.ToDense(channels_first).apply)({}, x)))
  assert d.shape == ((2, 3, 4, 5, 3) if channels_first else (2, 4, 5, 3, 3))
  # At the end of a Sequential, gradients reach the convolution through the dense array.
  model = snnx.Sequential(snnx.SubMConv3d(3, 2, 3, rngs=nnx.Rngs(0)), snnx.ToDense(channels_first))
  g = nnx.jit(nnx.grad(lambda m: jnp.sum(m(x) ** 2)))(model)
  assert float(jnp.abs(g.layers_0.kernel[...]).sum()) > 0


def test_sequential_trains_in_an_nnx_step():
  """A Sequential with batch norm, dropout and a "SAME" stride-2 convolution under nnx.jit + nnx.Optimizer:
  the loss goes down, the running statistics move, dropout draws new masks per step, eval() is deterministic."""
  rng = np.random.default_rng(9)
  r = nnx.Rngs(0, dropout=1)
  model = snnx.Sequential(snnx.SubMConv3d(3, 16, 3, rngs=r), snnx.SparseBatchNorm(16, activation=nnx.relu, rngs=r),
                          snnx.SparseDropout(0.1, rngs=r), snnx.SparseConv3d(16, 16, 3, 2, rngs=r),
                          nnx.gelu, snnx.SubMConv3d(16, 1, 1, rngs=r))
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
  x = _random_batch(rng, 200)
  target_of = lambda y: jnp.where(y.valid_mask()[:, None],  # noqa: E731
                                  jnp.sin(0.6 * y.coords[:, 1:2].astype(jnp.float32)), 0)

  @nnx.jit
  def train_step(model, optimizer, x):
    def loss_fn(model):
      y = model(x, out_capacity=x.capacity)
      return jnp.sum((y.feats - target_of(y)) ** 2) / jnp.maximum(y.num, 1)

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  stats_before = np.asarray(model.layers_1.mean[...])
  losses = [float(train_step(model, optimizer, x)) for _ in range(25)]
  assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
  assert not np.allclose(np.asarray(model.layers_1.mean[...]), stats_before)
  model.eval()
  infer = nnx.jit(lambda m, t: m(t, out_capacity=t.capacity))
  y1, y2 = infer(model, x), infer(model, x)
  np.testing.assert_array_equal(np.asarray(y1.feats), np.asarray(y2.feats))
  assert y1.spatial_shape == (5, 5, 5) and np.all(np.isfinite(np.asarray(y1.feats)))


@pytest.mark.parametrize("features", [(), 16, None])
def test_unet_features_must_be_a_nonempty_sequence(features):
  """A U-Net's widths per level: an empty tuple or a bare int failed inside the model's indexing (IndexError,
  'int' object is not subscriptable) without naming the argument, in both families."""
  x = random_sparse(np.random.default_rng(0), (4, 4, 4), 3, pad=2)
  with pytest.raises(ValueError, match="SparseUNet: features must be a non-empty sequence of ints"):
    snn.SparseUNet(features).init(jax.random.key(0), x)
  with pytest.raises(ValueError, match="SparseUNet: features must be a non-empty sequence of ints"):
    snnx.SparseUNet(3, features, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="SparseUNet: features must be a positive int, got 0"):
    snnx.SparseUNet(3, (8, 0), rngs=nnx.Rngs(0))
  assert snnx.SparseUNet(3, [8], rngs=nnx.Rngs(0))(x).num_channels == 1  # a list (or one level) is fine


def test_norm_defaults_are_nnxs():
  """The nnx norms' defaults are flax.nnx's (momentum, epsilons, use_running_average, num_groups), as the linen
  twins' are flax.linen's (test_nn.test_norm_defaults_are_flaxs_...)."""
  r = nnx.Rngs(0)
  for ours, theirs, fields in ((snnx.SparseBatchNorm(64, rngs=r), nnx.BatchNorm(64, rngs=r),
                                ("momentum", "epsilon", "use_running_average")),
                               (snnx.SparseLayerNorm(64, rngs=r), nnx.LayerNorm(64, rngs=r), ("epsilon",)),
                               (snnx.SparseGroupNorm(64, rngs=r), nnx.GroupNorm(64, rngs=r),
                                ("epsilon", "num_groups"))):
    for field in fields:
      assert getattr(ours, field) == getattr(theirs, field), (type(ours).__name__, field)


@pytest.mark.parametrize("param_dtype", [jnp.bfloat16, jnp.float16])
def test_norm_parameters_take_param_dtype_as_nnxs(param_dtype):
  """scale and bias are made in param_dtype with nnx's shapes (and running statistics in float32), as flax.nnx's
  norms make theirs."""
  r = nnx.Rngs(0)
  kw = dict(param_dtype=param_dtype, rngs=r)
  for ours, theirs in ((snnx.SparseBatchNorm(8, **kw), nnx.BatchNorm(8, **kw)),
                       (snnx.SparseLayerNorm(8, **kw), nnx.LayerNorm(8, **kw)),
                       (snnx.SparseGroupNorm(8, num_groups=2, **kw), nnx.GroupNorm(8, num_groups=2, **kw))):
    for kind in (nnx.Param, nnx.BatchStat):
      a, b = nnx.to_pure_dict(nnx.state(ours, kind)), nnx.to_pure_dict(nnx.state(theirs, kind))
      assert jax.tree.map(lambda v: (v.shape, v.dtype), a) == jax.tree.map(lambda v: (v.shape, v.dtype), b), \
          (type(ours).__name__, kind.__name__)


@pytest.mark.parametrize("dtype,in_dtype", [(None, jnp.bfloat16), (jnp.bfloat16, jnp.float32)])
def test_norm_output_dtypes_are_nnxs(dtype, in_dtype):
  """The output dtype of each nnx norm is that of its flax.nnx twin: the promoted input and parameter dtypes
  with dtype None (bfloat16 features, float32 parameters: float32), else dtype."""
  x = random_sparse(np.random.default_rng(3), (4, 5, 3), 8, batch_size=2, pad=3)
  x = x.replace(feats=x.feats.astype(in_dtype))
  r = nnx.Rngs(0)
  for ours, theirs in ((snnx.SparseLayerNorm(8, dtype=dtype, rngs=r), nnx.LayerNorm(8, dtype=dtype, rngs=r)),
                       (snnx.SparseGroupNorm(8, num_groups=2, dtype=dtype, rngs=r),
                        nnx.GroupNorm(8, num_groups=2, dtype=dtype, rngs=r)),
                       (snnx.SparseBatchNorm(8, use_running_average=True, dtype=dtype, rngs=r),
                        nnx.BatchNorm(8, use_running_average=True, dtype=dtype, rngs=r))):
    want = theirs(x.feats[None]).dtype
    assert ours(x).feats.dtype == want, (type(ours).__name__, want)
