"""Probe: per-channel statistics and batch norm + ReLU, forward and backward, at network sizes, against torch.

Variants of the column statistics (sum and sum of squares over rows of [N, C]): XLA reductions of the whole
array, two-stage (rows in chunks, then chunks), a ones-vector matmul; and the whole op: jsparse.norm today and
torch's BatchNorm1d + ReLU. Prints ms (median of 20) and GB/s of one read of the input.
"""
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from jsparse import norm

SHAPES = [(1_000_000, 32), (500_000, 64), (250_000, 128), (120_000, 256)]


def timed(fn, *args, n=20):
  jax.block_until_ready(fn(*args))
  ts = []
  for _ in range(n):
    t0 = time.perf_counter(); jax.block_until_ready(fn(*args)); ts.append(time.perf_counter() - t0)
  return statistics.median(ts) * 1e3


def stats_whole(x):
  d = x.astype(jnp.float32) - x[0].astype(jnp.float32)
  return jnp.sum(d, 0), jnp.sum(d * d, 0)


def stats_two_stage(x, chunk=1000):
  n, c = x.shape
  d = (x.astype(jnp.float32) - x[0].astype(jnp.float32)).reshape(n // chunk, chunk, c)
  return jnp.sum(jnp.sum(d, 1), 0), jnp.sum(jnp.sum(d * d, 1), 0)


def stats_matmul(x):
  ones = jnp.ones((1, x.shape[0]), x.dtype)
  d = x - x[0]
  return (jnp.dot(ones, d, preferred_element_type=jnp.float32)[0],
          jnp.dot(ones, d * d, preferred_element_type=jnp.float32)[0])


def main():
  import torch
  for n, c in SHAPES:
    for dt in (jnp.float16, jnp.float32):
      rng = np.random.default_rng(0)
      x_np = (rng.standard_normal((n, c)) * 2 + 1).astype(np.float32)
      x = jnp.asarray(x_np, dt)
      gb = n * c * jnp.dtype(dt).itemsize / 1e9
      row = [f"{n}x{c} {jnp.dtype(dt).name}"]
      for name, fn in (("whole", stats_whole), ("two-stage", stats_two_stage), ("matmul", stats_matmul)):
        ms = timed(jax.jit(fn), x)
        row.append(f"{name} {ms:.3f} ms ({gb / ms * 1e3:.0f} GB/s)")
      coords = jnp.zeros((n, 4), jnp.int32)
      st = jsparse.SparseTensor(coords, x, jnp.asarray(n, jnp.int32), (8, 8, 8), 1)
      scale, bias = jnp.ones(c), jnp.zeros(c)
      g = jnp.asarray(rng.standard_normal((n, c)), dt)

      def two_pass(f):  # jsparse before: batch_statistics (two passes) + normalise, then ReLU, all autodiff
        t = st.replace(feats=f)
        mean, var = norm.batch_statistics(t)
        return norm.activation(norm.batch_norm(t, scale, bias, mean=mean, var=var), jax.nn.relu).feats

      def fused(f):
        return norm.batch_norm(st.replace(feats=f), scale, bias, activation=jax.nn.relu).feats

      for name, fn in (("two-pass", two_pass), ("fused", fused)):
        def fwd_bwd(f, fn=fn):
          y, vjp = jax.vjp(fn, f)
          return y, vjp(g)
        row.append(f"jsparse {name} bn+relu fwd {timed(jax.jit(fn), x):.3f} fwd+bwd {timed(jax.jit(fwd_bwd), x):.3f}")
      tdt = torch.float16 if dt == jnp.float16 else torch.float32
      xt = torch.from_numpy(x_np).cuda().to(tdt).requires_grad_(True)
      gt = torch.from_numpy(np.asarray(g, np.float32)).cuda().to(tdt)
      bn = torch.nn.BatchNorm1d(c).cuda().to(tdt)

      def t_fwd():
        with torch.no_grad():
          return torch.relu(bn(xt))

      def t_fb():
        y = torch.relu(bn(xt))
        y.backward(gt)

      for name, f in (("fwd", t_fwd), ("fwd+bwd", t_fb)):
        f(); torch.cuda.synchronize()
        ts = []
        for _ in range(20):
          t0 = time.perf_counter(); f(); torch.cuda.synchronize(); ts.append(time.perf_counter() - t0)
        row.append(f"torch {name} {statistics.median(ts) * 1e3:.3f}")
      print(" | ".join(row), flush=True)


if __name__ == "__main__":
  main()
