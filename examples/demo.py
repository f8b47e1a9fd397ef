"""jsparse demo: a sparse voxel shape through a small SubMConv3d stack, forward and backward.

Runs on the default backend (the XLA path on a CPU, the Pallas/Triton kernels on a GPU), checks the
result against the dense convolution, and prints shapes and timings.
"""
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import jsparse


def voxel_shape(res: int) -> np.ndarray:
  """A sphere shell and a torus through it, as int32 (batch, x, y, z) coordinates."""
  p = np.stack(np.meshgrid(*(np.arange(res),) * 3, indexing="ij"), -1).reshape(-1, 3) + 0.5 - res / 2
  r = np.linalg.norm(p, axis=1)
  shell = (r <= res / 2) & (r >= res / 2 - 1.25)
  ring = (np.sqrt(p[:, 0] ** 2 + p[:, 1] ** 2) - res / 4) ** 2 + p[:, 2] ** 2 <= (res / 10) ** 2
  xyz = np.argwhere((shell | ring).reshape((res,) * 3)).astype(np.int32)
  return np.concatenate([np.zeros((len(xyz), 1), np.int32), xyz], axis=1)


def timed(fn, *args, repeats=5):
  out = jax.block_until_ready(fn(*args))  # compile + warm up
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return out, 1e3 * float(np.median(times))


def main(res=32, channels=(4, 32, 32, 8)):
  print(f"jax {jax.__version__}, backend: {jax.default_backend()}, device: {jax.devices()[0].device_kind}")
  coords = voxel_shape(res)
  rng = np.random.default_rng(0)
  feats = rng.standard_normal((len(coords), channels[0])).astype(np.float32)
  x = jsparse.SparseTensor.from_coords(coords, feats, (res, res, res),
                                       capacity=jsparse.round_capacity(len(coords)))
  print(x, f"-> {int(x.num) / res**3:.1%} of the {res}^3 grid is active")

  keys = jax.random.split(jax.random.key(0), len(channels) - 1)
  params = [(jax.random.normal(k, (3, 3, 3, cin, cout)) / np.sqrt(27 * cin), jnp.zeros(cout))
            for k, cin, cout in zip(keys, channels[:-1], channels[1:])]

  @jax.jit
  def forward(x, params):
    cache = jsparse.neighbor_map(x, 3)  # built once, shared by every layer
    h = x
    for i, (w, b) in enumerate(params):
      h = jsparse.submconv3d(h, w, b, cache=cache, precision="highest")
      if i < len(params) - 1:
        h = h.replace(feats=jax.nn.relu(h.feats))
    return h

  @jax.jit
  def loss_and_grads(x, params):
    # Mean over the valid entries (padding rows are zero, so a sum over all rows is the same sum).
    loss = lambda p, f: jnp.sum(forward(x.replace(feats=f), p).feats ** 2) / (x.num * channels[-1])
    return jax.value_and_grad(loss, argnums=(0, 1))(params, x.feats)

  y, t_fwd = timed(forward, x, params)
  (loss, (g_params, g_feats)), t_bwd = timed(loss_and_grads, x, params)
  print(f"forward:  {x.feats.shape} -> {y.feats.shape} through {len(params)} SubMConv3d layers, {t_fwd:.2f} ms")
  print(f"backward: loss {float(loss):.4f}, grads {[g[0].shape for g in g_params]} + input {g_feats.shape}, "
        f"{t_bwd:.2f} ms")

  # The same stack densely: lax.conv_general_dilated on todense(), masked back to the active sites.
  def dense_forward(params, f):
    d = x.replace(feats=f).todense()
    mask = (x.replace(feats=jnp.ones((x.capacity, 1))).todense() > 0).astype(d.dtype)
    for i, (w, b) in enumerate(params):
      d = (lax.conv_general_dilated(d, w, (1, 1, 1), "SAME", dimension_numbers=("NDHWC", "DHWIO", "NDHWC"),
                                    precision=lax.Precision.HIGHEST) + b) * mask
      if i < len(params) - 1:
        d = jax.nn.relu(d)
    return d

  y_dense = jax.jit(dense_forward)(params, x.feats)
  err = float(jnp.max(jnp.abs(y.todense() - y_dense)) / jnp.max(jnp.abs(y_dense)))
  _, t_dense = timed(jax.jit(dense_forward), params, x.feats)
  dense_loss = lambda p, f: jnp.sum(dense_forward(p, f) ** 2) / (int(x.num) * channels[-1])
  g_dense = jax.jit(jax.grad(dense_loss, argnums=(0, 1)))(params, x.feats)
  g_err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b)))
              for a, b in zip(jax.tree_util.tree_leaves(g_params), jax.tree_util.tree_leaves(g_dense[0])))
  print(f"dense check: forward max rel. error {err:.2e}, weight-gradient max rel. error {g_err:.2e} "
        f"(dense forward {t_dense:.2f} ms)")
  assert err < 1e-4 and g_err < 1e-4, "sparse and dense results disagree"
  print("OK")


if __name__ == "__main__":
  main()
