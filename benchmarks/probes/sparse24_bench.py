"""Probe: the native 2:4 forward against jsparse's dense Pallas forward and the XLA path, same weight, same map.

  python -m benchmarks.probes.sparse24_bench /tmp/sparse24.json            # GPU: C 128 / 256, ~100k / ~1M sites
  python -m benchmarks.probes.sparse24_bench /tmp/s.json --smoke           # CPU: tiny shapes, dense routes only

Workload: submanifold 3x3x3 C -> C on a one-voxel sphere shell (benchmarks.workloads.sphere_shell_coords, the
suite's surface-like sites), float16 or bfloat16, the weight 2:4-pruned along Cin. The neighbour map is built
once and passed in (not timed). Routes, each one jitted call applying the op to `inner` distinct feature sets:
  native   submconv3d on the Compressed2to4 weight (the mma.sp kernel through jax.ffi)
  pallas   submconv3d on the same pruned weight, dense (jsparse's Pallas kernels)
  xla      the same with implementation="xla"
Per-call time = median over `repeats` timed calls (after `warmup`), each synchronised with block_until_ready,
divided by `inner`. Errors: max |route - pallas| over the valid rows (xla on a CPU, where pallas does not run).
"""
from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from benchmarks.suite import short_error, time_calls
from benchmarks.workloads import sphere_shell_coords
from jsparse import sparse24, sparsity

DTYPES = {"fp16": jnp.float16, "bf16": jnp.bfloat16}


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("out", help="JSON output path")
  ap.add_argument("--channels", type=int, nargs="+", default=[128, 256])
  ap.add_argument("--res", type=int, nargs="+", default=[160, 512], help="shell grid sizes (160: ~100k, 512: ~1M)")
  ap.add_argument("--dtypes", nargs="+", default=["fp16"], choices=list(DTYPES))
  ap.add_argument("--inner", type=int, default=2)
  ap.add_argument("--xla-max-sites", type=int, default=200_000,
                  help="skip the XLA path above this many sites (it materialises the [sites, 27, C] gather)")
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--repeats", type=int, default=10)
  ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
  args = ap.parse_args(argv)
  if args.smoke:
    args.channels, args.res, args.inner, args.warmup, args.repeats = [32], [12], 2, 1, 2
  return args


def bench_route(fn, feat_sets, operands, warmup, repeats) -> dict:
  """Per-call time of fn(feats, operands) over the feature sets, in one jitted call (operands: the weight, the
  tensor and its map, passed as arguments rather than baked in as constants)."""
  batched = jax.jit(lambda sets, ops: [fn(f, ops) for f in sets])
  compiled = batched.lower(feat_sets, operands).compile()
  t = time_calls(lambda: compiled(feat_sets, operands), jax.block_until_ready, warmup, repeats)
  first = compiled(feat_sets, operands)[0]
  return {"ms": t["median_ms"] / len(feat_sets), "min_ms": t["min_ms"] / len(feat_sets), "out": first}


def run_case(res: int, channels: int, dtype, args) -> dict:
  rng = np.random.default_rng(res + channels)
  coords = sphere_shell_coords(res)
  x = jsparse.SparseTensor.from_coords(coords, np.zeros((len(coords), channels), np.float32), (res,) * 3, 1)
  x = x.replace(feats=x.feats.astype(dtype))
  cache = jsparse.neighbor_map(x, 3)
  w = rng.standard_normal((3, 3, 3, channels, channels)).astype(np.float32) / np.sqrt(27 * channels)
  pruned = sparsity.prune_2to4(jnp.asarray(w, dtype))
  compressed = sparsity.compress_2to4(pruned)
  feat_sets = [jnp.asarray(rng.standard_normal(x.feats.shape), dtype) for _ in range(args.inner)]

  def conv(implementation):
    def run(f, ops):
      weight, x, cache = ops
      return jsparse.submconv3d(x.replace(feats=f), weight, cache=cache, implementation=implementation).feats
    return run

  def kernel(tile):  # the native kernel alone, one CTA tile
    def run(f, ops):
      c, nbr, num = ops
      return sparse24.sparse24_forward(f, c.values, c.metadata, nbr, num, tile=tile)
    return run

  native_ok, native_why = sparse24.forward_route(
      dtype, compressed, implementation_is_pallas_on_gpu=jax.default_backend() == "gpu", num_offsets=27,
      cin=channels, cout=channels)
  row = {"res": res, "sites": int(len(coords)), "channels": channels, "dtype": jnp.dtype(dtype).name,
         "native_route": native_why}
  on_gpu = jax.default_backend() == "gpu"
  routes = {"native": (conv(None), (compressed, x, cache), native_ok),
            "pallas": (conv(None), (pruned, x, cache), on_gpu),
            "xla": (conv("xla"), (pruned, x, cache), len(coords) <= args.xla_max_sites)}
  for tile in (1, 2, 3):
    routes[f"native_tile{tile}"] = (kernel(tile), (compressed, cache.nbr, x.num), native_ok)
  outs = {}
  for name, (fn, weight, runs) in routes.items():
    if not runs:
      why = {"xla": f"over --xla-max-sites={args.xla_max_sites}", "pallas": "no GPU"}
      row[name] = {"skipped": native_why if name.startswith("native") else why[name]}
      continue
    try:
      r = bench_route(fn, feat_sets, weight, args.warmup, args.repeats)
    except Exception as e:  # noqa: BLE001 (a route that fails is reported, the others still run)
      row[name] = {"error": short_error(e)}
      continue
    outs[name] = np.asarray(r.pop("out"), np.float32)[: len(coords)]
    row[name] = r
  base = "pallas" if "pallas" in outs else "xla"
  for name, out in outs.items():
    row[name]["max_abs_err_vs_" + base] = float(np.max(np.abs(out - outs[base])))
  if "native" in outs and "pallas" in outs:
    row["speedup_native_vs_pallas"] = row["pallas"]["ms"] / row["native"]["ms"]
  return row


def fmt(cell: dict) -> str:
  if "ms" in cell:
    err = next((v for k, v in cell.items() if k.startswith("max_abs_err")), float("nan"))
    return f"{cell['ms']:8.3f} ms (err {err:.2e})"
  return ("skipped: " + cell.get("skipped", "") if "skipped" in cell else "error: " + cell.get("error", ""))[:40]


def main(argv=None):
  args = parse_args(argv)
  print(f"devices: {jax.devices()}; native: {sparse24.native_status()}", flush=True)
  rows = []
  for dname in args.dtypes:
    for res in args.res:
      for channels in args.channels:
        with sparse24.native_2to4():  # the native route is opt-in; the pallas and xla routes take dense weights
          row = run_case(res, channels, DTYPES[dname], args)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items()}, default=str), flush=True)
        write(args, rows)  # after every case: a run cut short keeps what it measured
  header = f"{'dtype':6} {'sites':>9} {'C':>4} | {'native':32} | {'pallas (dense)':32} | {'xla':32} | speedup"
  print(header + "\n" + "-" * len(header))
  for r in rows:
    speed = f"{r['speedup_native_vs_pallas']:.2f}x" if "speedup_native_vs_pallas" in r else "-"
    print(f"{r['dtype']:6} {r['sites']:9d} {r['channels']:4d} | {fmt(r['native']):32} | {fmt(r['pallas']):32} | "
          f"{fmt(r['xla']):32} | {speed}")
  print("\nnative kernel alone per CTA tile (1: 64 ch x 64 sites, 2: 64 x 128, 3: 128 x 128):")
  for r in rows:
    print(f"{r['dtype']:6} {r['sites']:9d} {r['channels']:4d} | " +
          " | ".join(f"tile {t}: {fmt(r[f'native_tile{t}'])}" for t in (1, 2, 3)))
  write(args, rows)
  print(f"wrote {args.out}")
  return 0


def write(args, rows) -> None:
  with open(args.out, "w") as f:
    json.dump({"device": str(jax.devices()[0]), "native_status": list(sparse24.native_status()),
               "settings": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}, f, indent=1)


if __name__ == "__main__":
  sys.exit(main())
