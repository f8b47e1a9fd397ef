"""Probe: how fast a GPU reads a [rows, C] half-precision array in XLA, against batch norm's column sums (GPU).

Batch norm's statistics (XLA's column sums of [rows, C]) run at ~1.7 TB/s for [1M, 64] fp16 on an H200, where its
fused normalise + ReLU (a read and a write) reaches ~3 TB/s. Whether the sums have headroom depends on what a
plain read of the same array costs, so this times, per array, in GB/s of bytes that must move:

- `total`: the sum of every element (a read with no column structure, the read ceiling a reduction can reach);
- `columns`: the per-channel sums, as batch norm takes them (one XLA column reduction);
- `columns_2stage R`: the per-channel sums of blocks of R rows first ([rows / R, R, C] summed over R), then of
  the blocks (a shape XLA tiles differently);
- `moments`: batch norm's statistics, `jsparse.norm`'s own pass (sums of the rows shifted by the first, rows < num);
- `scale`: x * 2 written out (a read and a write).

    python -m benchmarks.probes.read_ceiling [--rows 1048576] [--channels 64,128,256] [--inputs 8] [--repeats 20]

Each jitted call handles --inputs separate arrays; the time is the median call after warm-up (pipelined, as
benchmarks.suite.time_pipelined) divided by --inputs. Column sums are checked against float64 numpy.
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.suite import time_pipelined
from jsparse import dispatch, norm

XLA = dispatch.resolve("xla")


def column_sums_two_stage(x, block_rows: int):
  rows, c = x.shape
  return jnp.sum(jnp.sum(x.reshape(rows // block_rows, block_rows, c).astype(jnp.float32), axis=1), axis=0)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("--rows", type=int, default=1 << 20)
  ap.add_argument("--channels", default="64,128,256")
  ap.add_argument("--dtype", default="float16")
  ap.add_argument("--inputs", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=20)
  args = ap.parse_args(argv)
  rng = np.random.default_rng(0)
  dtype = jnp.dtype(args.dtype)
  print(f"{jax.devices()[0].device_kind}, rows {args.rows}, {dtype.name}, {args.inputs} arrays a call")
  print("| C | op | us per array | GB/s | max rel err of the column sums |")
  print("|---|---|---|---|---|")
  for c in (int(v) for v in args.channels.split(",")):
    host = [rng.standard_normal((args.rows, c)).astype(dtype) for _ in range(args.inputs)]
    xs = [jax.device_put(h) for h in host]
    want = np.sum(host[0].astype(np.float64), axis=0)
    nbytes = args.rows * c * dtype.itemsize
    num = jnp.int32(args.rows)
    ops = {
        "total": (lambda x: jnp.sum(x.astype(jnp.float32)), 1),
        "columns": (lambda x: jnp.sum(x.astype(jnp.float32), axis=0), 1),
        "moments": (lambda x: norm._moments(x, num, XLA), 1),  # batch norm's own statistics pass
        "scale": (lambda x: x * 2, 2),
    }
    for block_rows in (64, 512, 4096):
      if args.rows % block_rows == 0:
        ops[f"columns_2stage {block_rows}"] = (lambda x, r=block_rows: column_sums_two_stage(x, r), 1)
    for name, (op, passes) in ops.items():
      call = jax.jit(lambda xs, op=op: [op(x) for x in xs])
      t = time_pipelined(lambda: call(xs), jax.block_until_ready, args.repeats, 5)["pipelined_ms"] / args.inputs
      err = ""
      if name.startswith("columns"):
        got = np.asarray(call(xs)[0], np.float64)
        err = f"{np.max(np.abs(got - want) / (np.abs(want) + 1.0)):.1e}"
      print(f"| {c} | {name} | {1e3 * t:.1f} | {passes * nbytes / t / 1e6:.0f} | {err} |", flush=True)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
