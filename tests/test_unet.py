"""SparseUNet (jsparse.nn.models) against the same network run densely on small inputs."""
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jsparse
from jsparse.nn import SparseUNet
from reference import rel_err

DN = ("NDHWC", "DHWIO", "NDHWC")


def _conv(d, w, b=None, stride=1, padding="SAME"):
  out = lax.conv_general_dilated(d, w, (stride,) * 3, padding, dimension_numbers=DN, precision=lax.Precision.HIGHEST)
  return out if b is None else out + b


def dense_unet(p, d, mask, levels):
  """The network on dense grids; every layer's output is masked to its level's active sites."""
  relu = jax.nn.relu

  def subm(d, m, q):
    return _conv(d, q["kernel"], q.get("bias")) * m

  def block(d, m, q):
    h = relu(subm(d, m, q["conv1"]))
    h = subm(h, m, q["conv2"])
    short = subm(d, m, q["proj"]) if "proj" in q else d
    return relu(h + short)

  masks = [mask]
  for _ in range(levels - 1):
    masks.append(lax.reduce_window(masks[-1], 0.0, lax.max, (1, 2, 2, 2, 1), (1, 2, 2, 2, 1), "VALID"))
  h = relu(subm(d, masks[0], p["stem"]))
  skips = []
  for lvl in range(levels - 1):
    h = block(h, masks[lvl], p[f"down_block{lvl}"])
    skips.append(h)
    q = p[f"down{lvl}"]
    h = relu((_conv(h, q["kernel"], q["bias"], 2, "VALID")) * masks[lvl + 1])
  h = block(h, masks[-1], p["bottom"])
  for lvl in reversed(range(levels - 1)):
    q = p[f"up{lvl}"]
    w_fwd = jnp.swapaxes(q["kernel"], 3, 4)  # the inverse conv is the adjoint of the conv with this weight
    fine = jnp.zeros(skips[lvl].shape[:-1] + (w_fwd.shape[3],), h.dtype)
    _, vjp = jax.vjp(lambda z: _conv(z, w_fwd, None, 2, "VALID"), fine)
    (up,) = vjp(h)
    h = relu((up + q["bias"]) * masks[lvl])
    h = block(jnp.concatenate([h, skips[lvl]], -1), masks[lvl], p[f"up_block{lvl}"])
  return subm(h, masks[0], p["head"])


def test_unet_matches_dense_values_and_grads():
  x = jsparse.shapes.random_shapes(jax.random.key(3), 2, 12, channels=2)
  model = SparseUNet(features=(4, 8, 8), out_features=3, norm=None)
  params = model.init(jax.random.key(1, impl="unsafe_rbg"), x)
  mask = (x.replace(feats=jnp.ones((x.capacity, 1))).todense() > 0).astype(jnp.float32)
  cot = jnp.asarray(np.random.default_rng(0).standard_normal((x.capacity, 3)), jnp.float32)
  cot = jnp.where(x.valid_mask()[:, None], cot, 0)
  c = jnp.where(x.valid_mask()[:, None], x.coords, 0)

  def sparse_loss(p, feats):
    y = model.apply(p, x.replace(feats=feats))
    assert y.capacity == x.capacity and y.num_channels == 3
    return jnp.sum(y.feats * cot), y.feats

  def dense_loss(p, feats):
    out = dense_unet(p["params"], x.replace(feats=feats).todense(), mask, 3)
    at = jnp.where(x.valid_mask()[:, None], out[c[:, 0], c[:, 1], c[:, 2], c[:, 3]], 0)
    return jnp.sum(at * cot), at

  with jax.default_matmul_precision("highest"):
    (_, ys), gs = jax.jit(jax.value_and_grad(sparse_loss, (0, 1), has_aux=True))(params, x.feats)
    (_, yd), gd = jax.jit(jax.value_and_grad(dense_loss, (0, 1), has_aux=True))(params, x.feats)
  assert float(jnp.abs(yd).max()) > 0
  assert rel_err(ys, yd) < 1e-4
  for a, r in zip(jax.tree_util.tree_leaves(gs), jax.tree_util.tree_leaves(gd)):
    assert rel_err(a, r) < 1e-4
