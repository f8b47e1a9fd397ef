"""Time of each jsparse.nn layer kind, forward + backward, on a batch of solid procedural shapes.

    python -m benchmarks.probes.profile_layers [--res 64] [--batch 32] [--width 32] [--repeats 10]

Finds the layer that dominates a network's step (e.g. notebook 2's VAE at 64^3). Each layer is jitted
alone as value_and_grad of sum(out^2) w.r.t. its parameters and input features; the median of `repeats`
timed calls after a warm-up is printed. Neighbour maps are built inside the timed function, as in training.
It found the group norm's scatter-add contention (5.8 s at 835k rows on an H100, docs/perf_notes.md).
"""
from __future__ import annotations

import argparse
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

import jsparse
import jsparse.nn as snn
from benchmarks.suite import time_calls
from jsparse import norm


def solid_batch(res, batch, width, seed=0):
  rng = np.random.default_rng(seed)
  masks = [jsparse.shapes.sphere_mask(res, rng.uniform(0.2, 0.35) * res) for _ in range(batch)]
  x = jsparse.shapes.masks_to_tensor(np.stack(masks))
  feats = rng.standard_normal((x.capacity, width)).astype(np.float32)
  return x.replace(feats=jnp.asarray(np.where(np.arange(x.capacity)[:, None] < int(x.num), feats, 0)))


def time_layer(name, module, x, repeats, *call_args):
  params = jax.jit(module.init)(jax.random.key(0), x, *call_args)

  def loss(p, feats):
    y = module.apply(p, x.replace(feats=feats), *call_args)
    return jnp.sum(y.feats.astype(jnp.float32) ** 2)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  t0 = time.perf_counter()
  jax.block_until_ready(step(params, x.feats))
  compile_s = time.perf_counter() - t0
  ms = time_calls(lambda: step(params, x.feats), jax.block_until_ready, 0, repeats)["median_ms"]
  print(f"{name:42s} {ms:9.3f} ms   (compile {compile_s:.1f} s)", flush=True)


class GroupNormOnly(nn.Module):
  num_groups: int = 4

  @nn.compact
  def __call__(self, x):
    return norm.group_norm(x, self.num_groups)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--res", type=int, default=64)
  ap.add_argument("--batch", type=int, default=32)
  ap.add_argument("--width", type=int, default=32)
  ap.add_argument("--repeats", type=int, default=10)
  args = ap.parse_args()
  x = solid_batch(args.res, args.batch, args.width)
  w = args.width
  print(f"device {jax.devices()[0].device_kind}; RES {args.res}, batch {args.batch}: {int(x.num):,} voxels "
        f"(capacity {x.capacity:,}), width {w}", flush=True)
  mask = jnp.asarray(np.random.default_rng(1).random((x.capacity, 8)) < 0.5)
  layers = [
      ("SubMConv3d 3x3x3", snn.SubMConv3d(w), ()),
      ("group_norm (4 groups)", GroupNormOnly(), ()),
      ("SparseResNetBlock group norm", snn.SparseResNetBlock(w, norm="group", num_groups=4, activation=nn.silu), ()),
      ("SparseResNetBlock no norm", snn.SparseResNetBlock(w, norm=None, activation=nn.silu), ()),
      ("SparseConv3d k2 s2", snn.SparseConv3d(2 * w, kernel_size=2, strides=2, out_capacity=x.capacity // 4), ()),
      ("SparseConvTranspose3d k2 s2 (mask)", snn.SparseConvTranspose3d(w, out_capacity=4 * x.capacity), (mask,)),
  ]
  for name, module, extra in layers:
    try:
      time_layer(name, module, x, args.repeats, *extra)
    except Exception as e:  # report and go on: one broken layer should not hide the others' times
      print(f"{name:42s} FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)


if __name__ == "__main__":
  main()
