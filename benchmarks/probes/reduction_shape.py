"""Probe: batch norm's column sums in XLA, with the rows folded into wider rows first (GPU).

Batch norm's statistics and backward sums are XLA reductions over the rows of [rows, C] features. In MinkUNet's
fp16 training step they run at ~2.0-2.2 TB/s on an H100 (run 85, kernel_timeline), where elementwise passes over
the same arrays reach ~3 TB/s. A question XLA's reduction emitter may answer differently: the same sums taken
over [rows / k, k * C] (k rows side by side, a free reshape), then the k partial rows added. Wider rows give each
thread more contiguous columns.

    python -m benchmarks.probes.reduction_shape [--rows 1179648] [--channels 32,64,96,128,256] [--folds 1,2,4,8]
        [--inputs 8] [--repeats 20]

Each jitted call reduces --inputs separate arrays (so one launch's overhead is spread); the time is the median
call over --repeats after warm-up, divided by --inputs. GB/s counts the bytes the sums must read. Every fold is
checked against k = 1 (float32 sums: relative difference printed).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.suite import time_calls


def folded_moments(x, num, shift, fold):
  """(sum d, sum d^2) float32 [C], d = x - shift over the rows < num, summed over [rows / fold, fold * C]."""
  rows, c = x.shape
  xw = x.reshape(rows // fold, fold * c)
  row = jnp.arange(rows // fold)[:, None] * fold + jnp.arange(fold * c)[None, :] // c
  d = jnp.where(row < num, xw.astype(jnp.float32) - jnp.tile(shift, fold), 0)
  return jnp.sum(d, axis=0).reshape(fold, c).sum(0), jnp.sum(d * d, axis=0).reshape(fold, c).sum(0)


def folded_grad_sums(x, g_y, num, mean, inv_std, fold):
  """(sum g, sum g * xhat) float32 [C] of batch norm + ReLU's backward (scale 1, bias 0), folded as above."""
  rows, c = x.shape
  xw, gw = x.reshape(rows // fold, fold * c), g_y.reshape(rows // fold, fold * c)
  row = jnp.arange(rows // fold)[:, None] * fold + jnp.arange(fold * c)[None, :] // c
  valid = row < num
  xhat = jnp.where(valid, (xw.astype(jnp.float32) - jnp.tile(mean, fold)) * jnp.tile(inv_std, fold), 0)
  g = jnp.where(valid & (xhat > 0), gw.astype(jnp.float32), 0)
  return jnp.sum(g, axis=0).reshape(fold, c).sum(0), jnp.sum(g * xhat, axis=0).reshape(fold, c).sum(0)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", type=int, default=1179648)
  ap.add_argument("--channels", default="32,64,96,128,256")
  ap.add_argument("--folds", default="1,2,4,8")
  ap.add_argument("--dtype", default="float16")
  ap.add_argument("--inputs", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=20)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(args.dtype)
  print(f"{jax.devices()[0].device_kind}, rows {args.rows}, {dtype.name}, {args.inputs} inputs a call")
  print("| C | fold | moments us | GB/s | grad sums us | GB/s | max rel diff vs fold 1 |")
  print("|---|---|---|---|---|---|---|")
  for c in (int(v) for v in args.channels.split(",")):
    xs = [jnp.asarray(rng.standard_normal((args.rows, c)), dtype) for _ in range(args.inputs)]
    gs = [jnp.asarray(rng.standard_normal((args.rows, c)), dtype) for _ in range(args.inputs)]
    num = jnp.int32(args.rows - 1000)
    shift = xs[0][0].astype(jnp.float32)
    mean, inv_std = jnp.full((c,), 0.1, jnp.float32), jnp.full((c,), 0.9, jnp.float32)
    ref = None
    nbytes = args.rows * c * dtype.itemsize
    for fold in (int(v) for v in args.folds.split(",")):
      if args.rows % fold:
        continue
      mom = jax.jit(lambda xs, fold=fold: [folded_moments(x, num, shift, fold) for x in xs])
      grad = jax.jit(lambda xs, gs, fold=fold: [folded_grad_sums(x, g, num, mean, inv_std, fold)
                                                for x, g in zip(xs, gs)])
      t_m = time_calls(lambda: mom(xs), jax.block_until_ready, 3, args.repeats)["median_ms"] / args.inputs
      t_g = time_calls(lambda: grad(xs, gs), jax.block_until_ready, 3, args.repeats)["median_ms"] / args.inputs
      out = np.concatenate([np.concatenate([np.asarray(a) for a in r]) for r in (mom(xs)[0], grad(xs, gs)[0])])
      ref = out if ref is None else ref
      diff = float(np.max(np.abs(out - ref) / (np.abs(ref) + 1e-3)))
      print(f"| {c} | {fold} | {1e3 * t_m:.1f} | {nbytes / t_m / 1e6:.0f} | {1e3 * t_g:.1f} | "
            f"{2 * nbytes / t_g / 1e6:.0f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
  main()
