"""Probe: the plan's row key (each row's neighbour bitmask, Gray-ranked) written three ways in XLA (GPU).

`gemm_plan.row_order` reduces the [rows, V] neighbour map to one int32 bitmask a row. As XLA's row reduction of
width 27 it ran at ~1.3 TB/s on an H100 (95 us at 1.18M rows, run 82 / run 85), where a loop over the same map
could stream near 3 TB/s. Variants, all the same key:

- reduce: `jnp.sum(where(has, 1 << v, 0), axis=1)` (main's);
- columns: the V columns added one by one (an elementwise chain: a loop fusion, one thread per row);
- dot: the bits as a bfloat16 [rows, V] x [V, 2] product (low and high halves, each sum exact in float32).

    python -m benchmarks.probes.row_key [--rows 1179648] [--neighbours 27] [--fill 0.4] [--inputs 8]

Each jitted call computes --inputs keys from separate maps (so one launch's overhead is spread); the time is the
median call over --repeats, divided by --inputs. GB/s counts the map's bytes. Every variant is checked against
`reduce`.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.suite import time_calls
from pallas_kernels.gemm_plan import gray_rank


def key_reduce(nbr, num):
  valid = jnp.arange(nbr.shape[0]) < num
  weights = jnp.left_shift(jnp.int32(1), jnp.arange(nbr.shape[1], dtype=jnp.int32))
  mask = jnp.sum(jnp.where((nbr >= 0) & valid[:, None], weights[None, :], 0), axis=1, dtype=jnp.int32)
  return jnp.where(valid, gray_rank(mask), jnp.iinfo(jnp.int32).max)


def key_columns(nbr, num):
  valid = jnp.arange(nbr.shape[0]) < num
  mask = jnp.zeros(nbr.shape[:1], jnp.int32)
  for v in range(nbr.shape[1]):
    mask = mask | jnp.where(nbr[:, v] >= 0, jnp.int32(1 << v), 0)
  return jnp.where(valid, gray_rank(mask), jnp.iinfo(jnp.int32).max)


def key_dot(nbr, num):
  valid = jnp.arange(nbr.shape[0]) < num
  v = nbr.shape[1]
  low = min(v, 14)
  w = np.zeros((v, 2), np.float32)
  w[:low, 0] = 2.0 ** np.arange(low)
  w[low:, 1] = 2.0 ** np.arange(v - low)
  halves = jnp.dot((nbr >= 0).astype(jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), preferred_element_type=jnp.float32)
  mask = halves[:, 0].astype(jnp.int32) | (halves[:, 1].astype(jnp.int32) << low)
  return jnp.where(valid, gray_rank(mask), jnp.iinfo(jnp.int32).max)


VARIANTS = {"reduce": key_reduce, "columns": key_columns, "dot": key_dot}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", type=int, default=1179648)
  ap.add_argument("--neighbours", type=int, default=27)
  ap.add_argument("--fill", type=float, default=0.4, help="fraction of map entries that are neighbours")
  ap.add_argument("--inputs", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=20)
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  maps = []
  for _ in range(args.inputs):
    m = rng.integers(0, args.rows, (args.rows, args.neighbours), dtype=np.int32)
    maps.append(jnp.asarray(np.where(rng.random(m.shape) < args.fill, m, -1)))
  num = jnp.int32(args.rows - 1000)
  nbytes = args.rows * args.neighbours * 4
  print(f"{jax.devices()[0].device_kind}, map [{args.rows}, {args.neighbours}] int32, fill {args.fill}")
  print("| variant | us | GB/s | equal to reduce |\n|---|---|---|---|")
  ref = None
  for name, fn in VARIANTS.items():
    call = jax.jit(lambda ms, fn=fn: [fn(m, num) for m in ms])
    t = time_calls(lambda: call(maps), jax.block_until_ready, 3, args.repeats)["median_ms"] / args.inputs
    out = np.asarray(call(maps)[0])
    ref = out if ref is None else ref
    print(f"| {name} | {1e3 * t:.1f} | {nbytes / t / 1e6:.0f} | {bool(np.array_equal(out, ref))} |", flush=True)


if __name__ == "__main__":
  main()
