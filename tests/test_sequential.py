"""Sequencing and flax conventions (issue 17 items 6 and 8): Sequential with modules and feature functions,
ToDense, spconv-style aliases, SparseConv3d / SparseInverseConv3d with nn.Conv's "SAME" default."""
import functools
import inspect

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from reference import random_sparse

import jsparse
import jsparse.nn as snn

# Parameter-init key: threefry's random kernels compile slowly per shape on the CPU; the values only need to be
# some values. Every test below runs its modules under jax.jit: eagerly, each op compiles on its own.
KEY = jax.random.key(0, impl="unsafe_rbg")


def _x(seed=0, shape=(6, 5, 7), channels=3, batch_size=2, dtype=np.float32):
  x = random_sparse(np.random.default_rng(seed), shape, channels, batch_size=batch_size, density=0.3, pad=4)
  return x.replace(feats=x.feats.astype(dtype))


def _at(dense, x):
  c = jnp.maximum(x.coords, 0)
  return jnp.where(x.valid_mask()[:, None], dense[c[:, 0], c[:, 1], c[:, 2], c[:, 3]], 0)


# ---- Sequential ----------------------------------------------------------------------------------------------


def test_sequential_matches_the_layers_by_hand_with_training_flags():
  x = _x()
  model = snn.Sequential([snn.SubMConv3d(8, 3), snn.SparseBatchNorm(), nn.relu, snn.SparseDropout(0.5),
                          snn.SubMConv3d(4, 1), lambda f: f + 1.0])
  variables = jax.jit(lambda t: model.init(KEY, t, use_running_average=False, deterministic=True))(x)
  assert set(variables["params"]) == {"layers_0", "layers_1", "layers_4"}
  train = lambda v, x, key: model.apply(v, x, use_running_average=False, deterministic=False,
                                        rngs={"dropout": key}, mutable=["batch_stats"])
  y, updates = jax.jit(train)(variables, x, jax.random.key(1))

  @jax.jit
  def eval_and_by_hand(p, s, updated, x):
    # By hand, with the same parameters: the batch statistics the train step stored.
    h = snn.SubMConv3d(8, 3).apply({"params": p["layers_0"]}, x)
    _, bn_updates = snn.SparseBatchNorm().apply({"params": p["layers_1"], "batch_stats": s["layers_1"]}, h,
                                                use_running_average=False, mutable=["batch_stats"])
    # Compare in eval mode (no dropout) exactly, and check train mode changes things and updates the stats.
    y_eval = model.apply({"params": p, "batch_stats": updated}, x, use_running_average=True, deterministic=True)
    h_eval = snn.SubMConv3d(8, 3).apply({"params": p["layers_0"]}, x)
    h_eval = snn.SparseBatchNorm().apply({"params": p["layers_1"], "batch_stats": updated["layers_1"]}, h_eval,
                                         use_running_average=True)
    h_eval = snn.SubMConv3d(4, 1).apply({"params": p["layers_4"]}, jsparse.norm.activation(h_eval, nn.relu))
    return bn_updates, y_eval, jsparse.norm.activation(h_eval, lambda f: f + 1)

  bn_updates, y_eval, want_eval = eval_and_by_hand(variables["params"], variables["batch_stats"],
                                                   updates["batch_stats"], x)
  np.testing.assert_allclose(np.asarray(y_eval.feats), np.asarray(want_eval.feats), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(updates["batch_stats"]["layers_1"]["mean"]),
                             np.asarray(bn_updates["batch_stats"]["mean"]), rtol=1e-4, atol=1e-8)
  n = int(y.num)
  assert np.all(np.asarray(y.feats[n:]) == 0) and np.all(np.asarray(y_eval.feats[n:]) == 0)  # f(0) = 1 stays out
  assert y.feats.shape == (x.capacity, 4)
  # Dropout active: the train output differs from an eval pass with the updated statistics.
  assert not np.allclose(np.asarray(y.feats[:n]), np.asarray(y_eval.feats[:n]))


def test_sequential_tensor_functions_to_dense_and_nesting():
  x = _x(1, shape=(6, 6, 6))
  # Under jax.jit the output sites are not counted on the host: x's capacity bounds a stride-2 pool's.
  pool = snn.TensorFn(functools.partial(jsparse.sparse_max_pool3d, kernel_size=2, out_capacity=x.capacity))
  model = snn.Sequential([snn.Sequential([snn.SubMConv3d(5, 3), jax.nn.gelu]), pool, snn.ToDense(channels_first=True)])
  variables = jax.jit(model.init)(KEY, x)
  dense = jax.jit(model.apply)(variables, x)

  @jax.jit
  def by_hand(p, x):
    inner = snn.SubMConv3d(5, 3).apply({"params": p}, x)
    return jsparse.sparse_max_pool3d(jsparse.norm.activation(inner, jax.nn.gelu), 2,
                                     out_capacity=x.capacity).todense()

  expected = by_hand(variables["params"]["layers_0"]["layers_0"], x)
  assert dense.shape == (2, 5, 3, 3, 3)
  np.testing.assert_allclose(np.asarray(dense), np.asarray(jnp.moveaxis(expected, -1, 1)), rtol=1e-6, atol=1e-6)
  with pytest.raises(TypeError, match="layer 1"):
    jax.jit(snn.Sequential([snn.ToDense(), nn.relu]).apply)({}, x)
  with pytest.raises(TypeError, match="SparseTensor"):
    snn.Sequential([nn.relu]).apply({}, x.feats)
  with pytest.raises(TypeError, match="determinstic"):
    jax.jit(lambda v, t: model.apply(v, t, determinstic=True))(variables, x)
  with pytest.raises(ValueError, match="empty"):
    snn.Sequential([]).apply({}, x)
  with pytest.raises(TypeError, match="not a module or a callable"):
    snn.Sequential([3]).apply({}, x)


def test_sequential_gradients_match_dense():
  x = _x(2, dtype=np.float32)
  model = snn.Sequential([snn.SubMConv3d(4, 3), nn.tanh, snn.SubMConv3d(2, 3)])
  variables = jax.jit(model.init)(KEY, x)
  mask = x.replace(feats=jnp.ones_like(x.feats[:, :1])).todense()

  def dense_loss(p):  # the sparse net is the dense one with the inactive sites zeroed after every layer
    h = nn.Conv(4, (3, 3, 3), precision="highest").apply({"params": p["layers_0"]}, x.todense()) * mask
    h = jnp.tanh(h)
    h = nn.Conv(2, (3, 3, 3), precision="highest").apply({"params": p["layers_2"]}, h) * mask
    return jnp.sum(h ** 2)

  loss = lambda p: jnp.sum(model.apply({"params": p}, x).feats ** 2)
  (v, g), (v_ref, g_ref) = (jax.jit(jax.value_and_grad(f))(variables["params"]) for f in (loss, dense_loss))
  np.testing.assert_allclose(float(v), float(v_ref), rtol=1e-4)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-4), g, g_ref)


# ---- ToDense and spconv aliases --------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float32, jnp.float16])
def test_to_dense_layouts_and_aliases(dtype):
  x = _x(3, dtype=dtype)
  last = snn.ToDense().apply({}, x)
  first = snn.ToDense(channels_first=True).apply({}, x)
  assert last.shape == (2, 6, 5, 7, 3) and first.shape == (2, 3, 6, 5, 7) and first.dtype == dtype
  np.testing.assert_array_equal(np.asarray(first), np.asarray(jnp.moveaxis(last, -1, 1)))
  np.testing.assert_array_equal(np.asarray(x.todense(channels_first=True)), np.asarray(first))
  assert x.features is x.feats and x.indices is x.coords
  y = x.replace_feature(x.feats * 2)
  np.testing.assert_array_equal(np.asarray(y.features), np.asarray(x.feats * 2))
  with pytest.raises(TypeError, match="channels_first"):
    x.todense("yes")


# ---- nn.Conv defaults ---------------------------------------------------------------------------------------


def test_conv_modules_take_nn_conv_defaults():
  for module in (snn.SparseConv3d, snn.SparseInverseConv3d):
    fields = {f.name: f for f in module.__dataclass_fields__.values()}
    assert fields["padding"].default == "SAME" == inspect.signature(nn.Conv).parameters["padding"].default
    with pytest.raises(TypeError):
      module(4)  # kernel_size is required, as nn.Conv's


# Each geometry once and each dtype twice, rather than the product: the output grid and sites depend on the
# geometry alone, and the bfloat16 casts are the same code for every geometry.
@pytest.mark.parametrize("shape, kernel, strides, dilation, dtype", [
    ((6, 5, 7), 3, 2, 1, np.float32), ((6, 5, 7), 2, 2, 1, jnp.bfloat16), ((7, 5, 4), 3, 1, 2, np.float32),
    ((6, 6, 5), (4, 3, 2), (3, 2, 1), 1, jnp.bfloat16)])
def test_same_padding_matches_nn_conv(shape, kernel, strides, dilation, dtype):
  x = _x(4, shape=shape, dtype=dtype)
  # Under jax.jit the output sites are not counted on the host: the input grid's size bounds them.
  conv = snn.SparseConv3d(4, kernel, strides, kernel_dilation=dilation, precision="highest",
                          out_capacity=x.batch_size * int(np.prod(shape)))
  variables = jax.jit(conv.init)(KEY, x)
  dense = nn.Conv(4, kernel if isinstance(kernel, tuple) else (kernel,) * 3, strides, kernel_dilation=dilation,
                  precision="highest")
  tol = {"rtol": 3e-2, "atol": 3e-2} if dtype == jnp.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
  inverse = snn.SparseInverseConv3d(3, kernel, strides, kernel_dilation=dilation, precision="highest")
  st = (strides,) * 3 if isinstance(strides, int) else strides
  y_capacity = jax.eval_shape(conv.apply, variables, x).capacity  # static: the shapes alone give it
  cot_values = np.random.default_rng(5).normal(size=(y_capacity, 4))

  @jax.jit
  def everything(variables, x):
    """The sparse convolution, its gradients and its inverse, and their dense references, as one program."""
    def sparse_out(p, f):
      return conv.apply({"params": p}, x.replace(feats=f))

    y = sparse_out(variables["params"], x.feats)
    ref = dense.apply(variables, x.todense())
    # Output sites: every output position whose window holds an active input.
    ones = x.replace(feats=jnp.ones_like(x.feats[:, :1], jnp.float32)).todense()
    window = nn.Conv(1, dense.kernel_size, strides, kernel_dilation=dilation, use_bias=False).apply(
        {"params": {"kernel": jnp.ones(variables["params"]["kernel"].shape[:3] + (1, 1))}}, ones)
    # Gradients with respect to the kernel and the input features.
    cot = jnp.asarray(cot_values, y.dtype)
    cot = cot * y.valid_mask()[:, None].astype(cot.dtype)
    gp, gf = jax.vjp(lambda p, f: sparse_out(p, f).feats, variables["params"], x.feats)[1](cot)
    rp, rd = jax.vjp(lambda p, d: dense.apply({"params": p}, d), variables["params"], x.todense())[1](
        y.replace(feats=cot).todense())
    # The inverse with the same geometry goes back onto x's grid and sites: the dense transposed convolution.
    iv = inverse.init(jax.random.key(1, impl="unsafe_rbg"), y, like=x)
    z = inverse.apply(iv, y, like=x)
    assert z.spatial_shape == x.spatial_shape and z.coords is x.coords  # at trace time: x's very coordinates
    w = iv["params"]["kernel"]
    forward = lambda d: lax.conv_general_dilated(  # noqa: E731
        d, jnp.swapaxes(w, 3, 4).astype(jnp.float32), st, "SAME", rhs_dilation=(dilation,) * 3,
        dimension_numbers=("NDHWC", "DHWIO", "NDHWC"), precision="highest")
    back = jax.vjp(forward, jnp.zeros(x.todense().shape[:4] + (3,), jnp.float32))[1](
        y.todense().astype(jnp.float32))[0] + iv["params"]["bias"]
    return dict(y=y, ref_shape=jnp.zeros(ref.shape[1:4]), ref_at_y=_at(ref, y), num_windows=jnp.sum(window > 0),
                gf=gf, gp=gp["kernel"], rd_at_x=_at(rd, x), rp=rp["kernel"], z=z.feats, back_at_x=_at(back, x))

  r = everything(variables, x)
  y = r["y"]
  assert y.spatial_shape == r["ref_shape"].shape
  assert int(y.num) == int(r["num_windows"])
  np.testing.assert_allclose(np.asarray(y.feats, np.float32), np.asarray(r["ref_at_y"], np.float32), **tol)
  np.testing.assert_allclose(np.asarray(r["gf"], np.float32), np.asarray(r["rd_at_x"], np.float32), **tol)
  np.testing.assert_allclose(np.asarray(r["gp"], np.float32), np.asarray(r["rp"], np.float32),
                             rtol=tol["rtol"], atol=tol["atol"] * 10)
  np.testing.assert_allclose(np.asarray(r["z"], np.float32), np.asarray(r["back_at_x"], np.float32), **tol)


def test_valid_and_int_padding_unchanged():
  x = _x(6, shape=(7, 7, 7))
  cap = x.batch_size * 7 ** 3  # under jax.jit the output sites are not counted on the host: the grid bounds them
  for padding, expect in (("VALID", 0), (0, 0), (1, 1)):
    conv = snn.SparseConv3d(2, 3, 2, padding=padding, out_capacity=cap)
    variables = jax.jit(conv.init)(KEY, x)

    @jax.jit
    def both(variables, x, conv=conv, expect=expect):
      w, b = variables["params"]["kernel"], variables["params"]["bias"]
      return conv.apply(variables, x), jsparse.sparse_conv3d(x, w, b, stride=2, padding=expect, out_capacity=cap)

    y, ref = both(variables, x)
    np.testing.assert_array_equal(np.asarray(y.coords), np.asarray(ref.coords))
    np.testing.assert_allclose(np.asarray(y.feats), np.asarray(ref.feats), rtol=1e-6)
  with pytest.raises(ValueError, match="padding"):
    snn.SparseConv3d(2, 3, padding="FULL").init(KEY, x)


def test_readme_sequential_snippet():
  """The README's "Sequential models and topology ops" example runs as written."""
  from test_packaging import readme_snippet

  namespace = {}
  exec(compile(readme_snippet("### Sequential models and topology ops"), "README.md", "exec"), namespace)  # noqa: S102
  assert namespace["dense"].shape == (2, 8, 4, 4, 4)
  assert namespace["labels"].shape == (namespace["coarse"].capacity, 8)
  assert int(namespace["both"].num) == int(namespace["x"].num)  # kept's sites are x's


def test_sequential_eval_flag_reaches_blocks_that_take_train():
  # SparseResNetBlock takes `train`, not `use_running_average`: Sequential(...)(x, use_running_average=True) left it
  # in train mode, normalising with the batch's statistics and (with mutable) overwriting its running averages.
  x = _x(channels=8)
  model = snn.Sequential([snn.SubMConv3d(8, 3), snn.SparseBatchNorm(), snn.SparseResNetBlock(8)])
  variables = jax.jit(lambda t: model.init(KEY, t, use_running_average=False))(x)
  # Running statistics unlike the batch's, so that eval mode and train mode give different outputs.
  stats = jax.tree.map(lambda s: s + 0.5, variables["batch_stats"])
  v = {"params": variables["params"], "batch_stats": stats}

  @jax.jit
  def both(v, x):
    y, updates = model.apply(v, x, use_running_average=True, mutable=["batch_stats"])
    y_train_flag = model.apply(v, x, train=False)
    h = snn.SubMConv3d(8, 3).apply({"params": v["params"]["layers_0"]}, x)
    h = snn.SparseBatchNorm().apply({"params": v["params"]["layers_1"], "batch_stats": v["batch_stats"]["layers_1"]},
                                    h, use_running_average=True)
    want = snn.SparseResNetBlock(8).apply({"params": v["params"]["layers_2"],
                                           "batch_stats": v["batch_stats"]["layers_2"]}, h, train=False)
    return y, updates, y_train_flag, want

  y, updates, y_train_flag, want = both(v, x)
  np.testing.assert_allclose(np.asarray(y.feats), np.asarray(want.feats), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(np.asarray(y_train_flag.feats), np.asarray(want.feats), rtol=1e-5, atol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), updates["batch_stats"], stats)
  with pytest.raises(ValueError, match="contradict"):
    model.apply(v, x, train=True, use_running_average=True)
  with pytest.raises(TypeError, match="no layer takes"):
    snn.Sequential([snn.SubMConv3d(8, 3)]).apply({"params": {"layers_0": variables["params"]["layers_0"]}}, x,
                                                use_running_average=True)


def test_sequential_takes_either_mode_flag_when_its_layers_name_only_the_other():
  # train=False reaches a Sequential of batch norms (which name use_running_average only), and is not reported as a
  # keyword that no layer takes.
  x = _x(channels=8)
  model = snn.Sequential([snn.SubMConv3d(8, 3), snn.SparseBatchNorm()])
  variables = model.init(KEY, x, use_running_average=False)
  stats = jax.tree.map(lambda s: s + 0.5, variables["batch_stats"])
  v = {"params": variables["params"], "batch_stats": stats}
  y = model.apply(v, x, train=False)
  np.testing.assert_array_equal(np.asarray(y.feats), np.asarray(model.apply(v, x, use_running_average=True).feats))
