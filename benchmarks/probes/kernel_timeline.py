"""Probe: one network call's GPU kernels in launch order, each with its time, HLO op and result shape.

    python -m benchmarks.probes.kernel_timeline --network second --size large --dtype fp16 --mode train \
        [--calls 5] [--groups "maps,conv: other"] [--min-us 5]

`benchmarks.networks --profile` sums kernels by (group, name, op): every argsort of a network's submanifold
convolutions lands in one row, whatever its level or size. This probe keeps them apart: it traces `--calls` calls
of the compiled cell, takes each launch position's median duration over the calls, and prints the launches of the
chosen profile groups (`networks.op_group`) in order, with the HLO instruction's result shape, so that a sort of a
million rows and one of a thousand read as two lines. The totals per group and per kernel family follow.
"""
from __future__ import annotations

import argparse
import collections
import json
import re
import statistics
import tempfile

import jax
import jax.numpy as jnp

from benchmarks import networks


def launches(compiled, call_args, calls: int) -> list[dict]:
  """[{name, op, group, shape, us}]: one entry per launch position of a call, us the median over the calls."""
  return timeline(compiled, call_args, calls)[0]


def timeline(compiled, call_args, calls: int) -> tuple[list[dict], float]:
  """(`launches`, the median span of a call in us: its first kernel's start to its last kernel's end)."""
  with tempfile.TemporaryDirectory() as trace_dir:
    kernels, _ = networks.trace_kernels(compiled, call_args, calls, trace_dir, sync_each=True)
  text = compiled.as_text()
  shapes = {name: shape for name, (shape, _) in networks.hlo_instructions(text).items()}
  return per_launch(kernels, calls, networks.hlo_op_names(text), shapes), span_us(kernels, calls)


def span_us(kernels: list[dict], calls: int) -> float:
  """Median over `calls` calls (the same launch sequence each, as `per_launch` checks) of the time from a call's
  first kernel start to its last kernel end: a call's span less its kernels' time is the GPU's idle time
  between its launches; its wall time less its span is the host's part (dispatch before, sync after)."""
  if calls < 1:
    raise ValueError(f"calls must be >= 1, got {calls}")
  if not kernels:  # no device kernels traced (a CPU run)
    return 0.0
  kernels = sorted(kernels, key=lambda e: e["ts"])
  per_call = len(kernels) // calls
  if per_call == 0 or per_call * calls != len(kernels):
    raise RuntimeError(f"{len(kernels)} kernel events over {calls} calls: not one launch sequence per call")
  spans = []
  for c in range(calls):
    events = kernels[c * per_call:(c + 1) * per_call]
    spans.append(max(e["ts"] + e.get("dur", 0.0) for e in events) - events[0]["ts"])
  return statistics.median(spans)


def per_launch(kernels: list[dict], calls: int, meta: dict, shapes: dict) -> list[dict]:
  """Trace kernel events of `calls` calls of one program -> one row per launch position (the calls launch the
  same sequence): its kernel name, HLO op name (`meta`), result shape (`shapes`), profile group and median
  duration in us."""
  if calls < 1:
    raise ValueError(f"calls must be >= 1, got {calls}")
  kernels = sorted(kernels, key=lambda e: e["ts"])
  per_call = len(kernels) // calls
  if per_call * calls != len(kernels):
    raise RuntimeError(f"{len(kernels)} kernel events over {calls} calls: not one launch sequence per call")
  out = []
  for i in range(per_call):
    events = [kernels[c * per_call + i] for c in range(calls)]
    e = events[0]
    if any(ev["name"] != e["name"] for ev in events):
      raise RuntimeError(f"launch {i} is not the same kernel in every call: not one launch sequence per call")
    hlo = e.get("args", {}).get("hlo_op", "")
    op = meta.get(e["name"], "") or meta.get(hlo, "")
    shape = shapes.get(e["name"]) or shapes.get(hlo, "")
    out.append({"name": e["name"], "op": op, "group": networks.op_group(networks._scope_kind(op), e["name"]),
                "shape": shape, "us": statistics.median(ev.get("dur", 0.0) for ev in events)})
  return out


def family(name: str) -> str:
  """A kernel's family: its name without the numeric suffixes XLA and Pallas add, CUB's template arguments cut."""
  name = re.sub(r"((__|_)\d+)+$", "", name)
  return name[:48]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--network", default="second", choices=list(networks.NETWORKS))
  ap.add_argument("--size", default="large")
  ap.add_argument("--dtype", default="fp16", choices=list(networks.DTYPES))
  ap.add_argument("--mode", default="train", choices=["inference", "train"])
  ap.add_argument("--calls", type=int, default=5)
  ap.add_argument("--groups", default="maps,conv: other",
                  help="comma-separated prefixes of the profile groups to print ('' for all)")
  ap.add_argument("--min-us", type=float, default=5.0, help="hide launches shorter than this")
  ap.add_argument("--impl", default=None)
  ap.add_argument("--inputs-cache", default=None, help="read / write the inputs here (networks.make_inputs)")
  ap.add_argument("--out", default=None, help="also write every launch (all groups) to this JSON file")
  args = ap.parse_args(argv)
  w = networks.workload(args.network, args.size)
  inp = networks.make_inputs(w, cache_dir=args.inputs_cache)
  dtype, precision = networks.DTYPES[args.dtype]
  params = networks.Params(0)
  caps = networks.plan_capacities(networks.NETWORKS[args.network], inp, params, dtype, args.impl, precision)
  p = {k: jnp.asarray(v) for k, v in params.arrays.items()}
  x = networks.jax_input(inp, dtype)
  inference, train = networks.jax_functions(networks.NETWORKS[args.network], inp, caps, dtype, args.impl, precision)
  fn = train if args.mode == "train" else inference
  compiled = jax.jit(fn).lower(p, x).compile()
  rows = launches(compiled, (p, x), args.calls)
  if args.out:  # every launch, whatever --groups prints: a later question about another op needs no new run
    with open(args.out, "w") as f:
      json.dump({"network": args.network, "size": args.size, "dtype": args.dtype, "mode": args.mode,
                 "device": jax.devices()[0].device_kind, "sites": int(len(inp.coords)), "launches": rows}, f)
  prefixes = tuple(g.strip() for g in args.groups.split(",") if g.strip())
  print(f"== {args.network}/{args.size} {args.dtype} {args.mode}: {len(inp.coords):,} input sites, "
        f"{len(rows)} launches a call, {sum(r['us'] for r in rows) / 1e3:.3f} ms of kernels "
        f"({jax.devices()[0].device_kind})")
  print("| # | us | group | kernel | result shape | op |\n|---|---|---|---|---|---|")
  by_group, by_family = collections.Counter(), collections.Counter()
  for i, r in enumerate(rows):
    by_group[r["group"]] += r["us"]
    if prefixes and not r["group"].startswith(prefixes):
      continue
    by_family[(r["group"], family(r["name"]))] += r["us"]
    if r["us"] >= args.min_us:
      print(f"| {i} | {r['us']:.1f} | {r['group']} | {r['name'][:48]} | {r['shape'][:60]} | {r['op'][-70:]} |")
  print("\nms per call by group:")
  for g, us in by_group.most_common():
    print(f"  {us / 1e3:8.4f}  {g}")
  print("\nms per call by kernel family (selected groups):")
  for (g, f), us in by_family.most_common():
    print(f"  {us / 1e3:8.4f}  {g} :: {f}")


if __name__ == "__main__":
  main()
