"""Measure a shipped tuning table for this GPU: `jsparse.autotune` over the suite's workloads, no FlexGEMM.

    python -m benchmarks.tune_table --out DIR [--dtypes fp16,tf32] [--rows 0,1,...] [--time-budget S]

Each (row, dtype) is tuned on its training function (every pass: forward, input and weight gradient) with a
single layer, since the layers of a row share one shape. Tables are merged and written after every row to
DIR/<device kind>.json (the name `tuning.shipped_table` looks for): copy it into jsparse/tuned/ to ship it.
With --smoke (or off a GPU) one tiny row in interpret mode checks the harness.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jsparse  # noqa: E402
from benchmarks import workloads  # noqa: E402
from benchmarks.suite import DTYPES, SMOKE_ROW, jsparse_fns, jsparse_weight, row_inputs  # noqa: E402
from jsparse.tuning import table_file_name  # noqa: E402


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/jsparse_tune")
  ap.add_argument("--dtypes", default="fp16,tf32", help=f"comma-separated, of {list(DTYPES)}")
  ap.add_argument("--rows", default=None, help="comma-separated indices into workloads.SUITE (default: all)")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--time-budget", type=float, default=0, help="seconds; start no new row after this (0: none)")
  ap.add_argument("--smoke", action="store_true")
  ap.add_argument("--weight-layout", default="DHWIO", choices=("DHWIO", "ODHWI"),
                  help="the weight layout tuned with (the shipped tables: DHWIO); entries serve both layouts, "
                       "but only a pass that reads its weight N-contiguous tries the straight-read candidates")
  args = ap.parse_args(argv)
  os.makedirs(args.out, exist_ok=True)
  on_gpu = jax.default_backend() == "gpu"
  smoke = args.smoke or not on_gpu
  rows = [SMOKE_ROW] if smoke else (
      [workloads.SUITE[int(i)] for i in args.rows.split(",")] if args.rows else list(workloads.SUITE))
  kind = jax.devices()[0].device_kind if on_gpu else "cpu-smoke"
  path = os.path.join(args.out, table_file_name(kind))
  entries: dict = {}
  start = time.perf_counter()
  implementation = None if on_gpu else "pallas"  # off the GPU: interpret mode, a harness check only
  for dtype_name in args.dtypes.split(","):
    jdtype, precision, _ = DTYPES[dtype_name]
    fns = jsparse_fns(implementation, precision, weight_layout=args.weight_layout)
    for row in rows:
      if args.time_budget and time.perf_counter() - start > args.time_budget:
        print(f"time budget reached: {row.name} {dtype_name} and later rows not tuned", flush=True)
        break
      coords, feats, params = row_inputs(dataclasses.replace(row, layers=1) if not smoke else row)
      x = jsparse.SparseTensor.from_coords(coords, jnp.asarray(feats, jdtype), (row.res,) * 3, batch_size=1,
                                                capacity="exact")
      params = [(jnp.asarray(jsparse_weight(w, args.weight_layout), jdtype), jnp.asarray(b, jdtype))
                for w, b in params[:1]]
      t0 = time.perf_counter()
      table = jsparse.autotune(fns["train"], x, params, warmup=1, repeats=args.repeats)
      entries.update(table.entries)
      print(f"{row.name} {dtype_name}: {len(table)} entries in {time.perf_counter() - t0:.1f} s", flush=True)
      jsparse.ConfigTable(entries, device_kind=kind).save(path)
  print(f"wrote {path} ({len(entries)} entries)", flush=True)
  with open(path) as f:
    json.load(f)  # a truncated file would fail here, not in a later session
  return 0


if __name__ == "__main__":
  sys.exit(main())
