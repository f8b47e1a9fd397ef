"""Data-parallel check of jsparse.nn, run by tests/test_nn.py in a subprocess.

It needs two CPU devices, which XLA only creates if XLA_FLAGS is set before jax is imported; hence a separate
process. Each device gets its own SparseTensor (two tensors of equal capacity stacked along a new leading
axis); a shard_map'd step computes per-device gradients and averages them with lax.pmean, and a
SparseBatchNorm with axis_name pools its statistics over both devices. Prints "OK" on success.

tests/test_gpu.py imports the helpers (Net, make, sharded_grads and the references) to run the same check on
two GPUs; imported, this module leaves XLA_FLAGS alone.
"""
import os

if __name__ == "__main__":
  os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jsparse
import jsparse.nn as snn
from reference import rel_err

AXIS = "data"


class Net(nn.Module):
  axis_name: str | None = None
  precision: Any = None  # of the convolutions ("highest" for float32 comparisons on a GPU)

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = snn.SubMConv3d(6, precision=self.precision)(x)
    x = snn.SparseBatchNorm(use_running_average=not train, momentum=0.5, axis_name=self.axis_name)(x)
    x = jsparse.norm.activation(x, nn.relu)
    return snn.SubMConv3d(2, precision=self.precision)(x)


def make(rng, n, capacity, spatial=(6, 5, 7), channels=3, batch_size=2):
  keys = rng.choice(batch_size * np.prod(spatial), size=n, replace=False)
  coords = np.stack(np.unravel_index(keys, (batch_size,) + spatial), axis=-1).astype(np.int32)
  feats = rng.standard_normal((n, channels)).astype(np.float32) * 2 + 1
  return jsparse.SparseTensor.from_coords(coords, feats, spatial, batch_size, capacity=capacity)


def per_device(tree):
  return jax.tree.map(lambda a: jax.lax.pcast(a, AXIS, to="varying"), tree)


def loss_fn(params, batch_stats, x, target, axis_name, precision=None):
  y, upd = Net(axis_name, precision).apply({"params": params, "batch_stats": batch_stats}, x,
                                           mutable=["batch_stats"])
  # Masked mean over this device's valid rows.
  err = jnp.where(x.valid_mask()[:, None], y.feats - target, 0)
  return jnp.sum(err**2) / x.num, upd["batch_stats"]


def sharded_grads(mesh, params, stats, xs, targets, precision=None):
  """One training step's (gradients, new batch_stats) with xs[i], targets[i] on mesh device i.

  Per-device step: grads averaged over devices with pmean, batch-norm statistics pooled over AXIS.
  """
  def step(params, stats, x, target):
    x, target = jax.tree.map(lambda a: a[0], (x, target))  # drop the per-device leading axis of size 1
    # Per-device gradients: mark the replicated params as device-varying, else shard_map's transpose of
    # their broadcast already sums the gradients over devices.
    params = per_device(params)
    grad_fn = jax.grad(loss_fn, has_aux=True)
    grads, new_stats = grad_fn(params, stats, x, target, AXIS, precision)
    return jax.lax.pmean(grads, AXIS), new_stats

  stacked_x = jax.tree.map(lambda *a: jnp.stack(a), *xs)
  stacked_t = jnp.stack(targets)
  sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)), out_specs=(P(), P())))
  return sharded(params, stats, stacked_x, stacked_t)


def pooled_statistics(params, xs, precision=None):
  """Reference: (mean, var) of the first conv's output over the valid rows of all of xs, on one device."""
  conv_params = {"params": params["SubMConv3d_0"]}
  hs = [snn.SubMConv3d(6, precision=precision).apply(conv_params, x) for x in xs]
  rows = np.concatenate([np.asarray(h.feats[: int(h.num)]) for h in hs]).astype(np.float64)
  return rows.mean(0), rows.var(0)


def pooled_reference_grads(params, xs, targets, precision=None):
  """Reference: the pooled statistics fed to each device's loss separately (no mapped axis), grads averaged
  by hand, on one device. Fixing the statistics to the pooled ones is what makes the per-device losses
  separable, and their gradient is exactly what the cross-device psum's transpose delivers."""
  def net(params, x):
    return snn.SubMConv3d(6, precision=precision).apply({"params": params["SubMConv3d_0"]}, x)

  def loss_with_stats(params, x, target):
    # The statistics depend on every device's rows: recompute them from all inputs, differentiably.
    hs = [net(params, xi) for xi in xs]
    n = sum(h.num for h in hs)
    mu = sum(jnp.sum(h.feats, 0) for h in hs) / n  # padding rows are zero
    sig = sum(jnp.sum(jnp.where(h.valid_mask()[:, None], h.feats - mu, 0) ** 2, 0) for h in hs) / n
    h = net(params, x)
    bn = params["SparseBatchNorm_0"]
    y = jsparse.norm.batch_norm(h, bn["scale"], bn["bias"], mean=mu, var=sig, epsilon=1e-5)
    y = jsparse.norm.activation(y, nn.relu)
    y = snn.SubMConv3d(2, precision=precision).apply({"params": params["SubMConv3d_1"]}, y)
    err = jnp.where(x.valid_mask()[:, None], y.feats - target, 0)
    return jnp.sum(err**2) / x.num

  g_ref = [jax.jit(jax.grad(loss_with_stats))(params, x, t) for x, t in zip(xs, targets)]
  return jax.tree.map(lambda *g: sum(g) / len(g), *g_ref)


def main():
  assert jax.device_count() == 2, jax.devices()
  rng = np.random.default_rng(0)
  cap = jsparse.round_capacity(90)
  xs = [make(rng, 70, cap), make(rng, 85, cap)]  # different voxel counts, same capacity
  targets = [jnp.asarray(rng.standard_normal((cap, 2)), jnp.float32) for _ in xs]
  variables = Net().init(jax.random.key(0, impl="unsafe_rbg"), xs[0])  # rbg: compiles fast on the CPU
  params, stats = variables["params"], variables["batch_stats"]

  mesh = Mesh(np.array(jax.devices()), (AXIS,))
  grads, new_stats = sharded_grads(mesh, params, stats, xs, targets)

  # Reference 1: the pooled batch statistics, from the valid rows of both tensors on one device.
  mean, var = pooled_statistics(params, xs)
  got = new_stats["SparseBatchNorm_0"]
  assert rel_err(got["mean"], 0.5 * 0.0 + 0.5 * mean) < 1e-5, (got["mean"], mean)
  assert rel_err(got["var"], 0.5 * 1.0 + 0.5 * var) < 1e-5, (got["var"], var)

  # Reference 2: per-device losses with the pooled statistics, gradients averaged by hand.
  g_mean = pooled_reference_grads(params, xs, targets)
  # (The first conv's bias feeds batch norm, so its true gradient is ~0: compare with an absolute floor.)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), grads, g_mean)

  # Reference 3: without batch norm statistics in play (use_running_average), the averaged gradient is
  # exactly the mean of the two single-device gradients.
  def step_eval(params, stats, x, target):
    x, target = jax.tree.map(lambda a: a[0], (x, target))
    params = per_device(params)

    def loss(params):
      y = Net().apply({"params": params, "batch_stats": stats}, x, train=False)
      err = jnp.where(x.valid_mask()[:, None], y.feats - target, 0)
      return jnp.sum(err**2) / x.num
    return jax.lax.pmean(jax.grad(loss)(params), AXIS)

  stacked_x = jax.tree.map(lambda *a: jnp.stack(a), *xs)
  stacked_t = jnp.stack(targets)
  sharded_eval = jax.jit(jax.shard_map(step_eval, mesh=mesh, in_specs=(P(), P(), P(AXIS), P(AXIS)), out_specs=P()))
  grads_eval = sharded_eval(params, stats, stacked_x, stacked_t)

  def single(params, x, target):
    y = Net().apply({"params": params, "batch_stats": stats}, x, train=False)
    err = jnp.where(x.valid_mask()[:, None], y.feats - target, 0)
    return jnp.sum(err**2) / x.num

  g_single = [jax.jit(jax.grad(single))(params, x, t) for x, t in zip(xs, targets)]
  g_mean = jax.tree.map(lambda a, b: (a + b) / 2, *g_single)
  errs = jax.tree.map(rel_err, grads_eval, g_mean)
  assert max(jax.tree.leaves(errs)) < 1e-5, errs
  # and it is not just one device's gradient
  assert min(jax.tree.leaves(jax.tree.map(rel_err, g_single[0], g_single[1]))) > 1e-2

  check_plans_inside_shard_map(mesh, xs)
  check_pooled_statistics_offset_data(mesh, rng)
  print("OK")


def check_pooled_statistics_offset_data(mesh, rng):
  """norm.batch_statistics pooled over devices with different row counts, channel means far from zero and
  unequal between devices (the one-psum parallel-variance formula's hard case) against float64 numpy."""
  cap = jsparse.round_capacity(120)
  xs = [make(rng, n, cap, channels=4) for n in (60, 110)]
  xs = [x.replace(feats=x.feats * 0.5 + jnp.asarray([40.0, -25.0, 3.0, 0.0]) + 5.0 * i) for i, x in enumerate(xs)]

  def stats(x):
    mean, var = jsparse.norm.batch_statistics(jax.tree.map(lambda a: a[0], x), axis_name=AXIS)
    return mean, var

  stacked = jax.tree.map(lambda *a: jnp.stack(a), *xs)
  mean, var = jax.jit(jax.shard_map(stats, mesh=mesh, in_specs=P(AXIS), out_specs=P()))(stacked)
  rows = np.concatenate([np.asarray(x.feats[: int(x.num)], np.float64) for x in xs])
  np.testing.assert_allclose(np.asarray(mean), rows.mean(0), rtol=1e-6)
  np.testing.assert_allclose(np.asarray(var), rows.var(0), rtol=1e-4)


def check_plans_inside_shard_map(mesh, xs):
  """The Pallas GEMMs' work plans built per device inside shard_map equal the ones built on one device: their
  XLA ops (`masked_plan_reference`, `pair_lists_reference` and `pair_lists_from_plan_reference`, the forms the
  plan and pair-list kernels are tested against; training reads a submanifold map's lists from its plan, through
  the XLA scatters `plan_positions` and `offset_slots`). A
  full-range `zeros(n).at[:n].set(...)` in the masked plan once crashed XLA's Shardy pass here (segfault at
  compile time, on CPU and GPU alike); the CPU's Pallas interpret mode cannot run kernels inside shard_map (the
  plan kernel inside shard_map runs in the two-GPU test), so this is what CI can check of the Pallas path's data
  parallelism."""
  from pallas_kernels.gemm_plan import (masked_plan_reference, offset_slots, pair_lists_from_plan_reference,
                                        pair_lists_reference, plan_positions)

  def plans(x):
    nbr = jsparse.neighbor_map(x, 3, implementation="xla").nbr
    plan = masked_plan_reference(nbr, x.num, 64)
    # plan_positions and offset_slots: the XLA scatters pair_lists_from_plan runs before its kernels.
    return (plan, pair_lists_reference(nbr), pair_lists_from_plan_reference(plan, True), plan_positions(plan),
            offset_slots(plan))

  def per_device(x):
    return jax.tree.map(lambda a: a[None], plans(jax.tree.map(lambda a: a[0], x)))

  stacked = jax.tree.map(lambda *a: jnp.stack(a), *xs)
  got = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))(stacked)
  for i, x in enumerate(xs):
    want = jax.jit(plans)(x)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a[i], b), got, want)


if __name__ == "__main__":
  main()
