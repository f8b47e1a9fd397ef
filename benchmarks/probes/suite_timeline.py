"""Probe: one FlexGEMM-suite row's GPU kernels, jsparse's and FlexGEMM's, launch by launch in one process.

    python -m benchmarks.probes.suite_timeline --row 2 --dtype tf32 --mode inference [--calls 5] [--out F]

The suite reports one time per side. Where a row loses, this says where: each launch of one call with its median
duration over `--calls` calls (each call waited for before the next, so no two calls' kernels overlap), then the
totals by kernel family, and where a call's wall time goes: its kernels, the GPU's idle time between them
(first kernel start to last kernel end, less the kernels), and the host's part (wall time less that span).
jsparse's side is traced with the JAX profiler (`networks.trace_kernels`), FlexGEMM's with `torch.profiler`,
after the same warm-up (FlexGEMM autotunes on its first calls).
"""
from __future__ import annotations

import argparse
import collections
import json
import statistics

import jax

from benchmarks import networks, suite, workloads
from benchmarks.probes import kernel_timeline


def jsparse_launches(args) -> list[dict]:
  _, x, params, compiled = suite.compile_row(args)
  wall = suite.time_calls(lambda: compiled(x, params), jax.block_until_ready, args.warmup, args.repeats)
  launches, span = kernel_timeline.timeline(compiled, (x, params), args.calls)
  return [{"name": e["name"], "us": e["us"]} for e in launches], wall["median_ms"], span


def flexgemm_launches(row, dtype_name, mode, args) -> list[dict]:
  fg, why = suite.import_flexgemm()
  if fg is None:
    raise RuntimeError(why)
  torch = fg[0]
  call, _ = suite.flexgemm_call(fg, row, dtype_name, mode, args)
  # Its first calls autotune: the warm-up covers them.
  wall = suite.time_calls(call, lambda _: torch.cuda.synchronize(), args.warmup, args.repeats)
  per_call = []
  acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
  for _ in range(args.calls):
    with torch.profiler.profile(activities=acts) as prof:
      call()
      torch.cuda.synchronize()
    per_call.append(sorted((ev.time_range.start, ev.name, ev.time_range.elapsed_us())
                           for ev in networks.torch_device_kernels(prof.events(), torch.autograd.DeviceType.CUDA)))
  if len({len(k) for k in per_call}) != 1:
    raise RuntimeError(f"FlexGEMM launched {[len(k) for k in per_call]} kernels in its calls: not one sequence")
  span = kernel_timeline.span_us([{"ts": ts, "dur": us} for call in per_call for ts, _, us in call], len(per_call))
  return [{"name": per_call[0][i][1], "us": statistics.median(c[i][2] for c in per_call)}
          for i in range(len(per_call[0]))], wall["median_ms"], span


def summary(launches: list[dict]) -> dict:
  fam = collections.defaultdict(float)
  for e in launches:
    fam[kernel_timeline.family(e["name"])] += e["us"]
  return {"total_us": sum(e["us"] for e in launches), "launch_count": len(launches),
          "families_us": dict(sorted(fam.items(), key=lambda kv: -kv[1]))}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  suite.add_row_arguments(ap, row=2)
  ap.add_argument("--calls", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=3)
  ap.add_argument("--repeats", type=int, default=10, help="timed calls for the wall time")
  ap.add_argument("--skip-flexgemm", action="store_true")
  ap.add_argument("--min-us", type=float, default=2.0, help="hide launches shorter than this in the listing")
  ap.add_argument("--out", default=None, help="write both sides' launches here as JSON")
  args = ap.parse_args(argv)
  row = workloads.SUITE[args.row]
  print(f"== suite row {args.row} ({row.name}), {args.dtype} {args.mode}, {jax.devices()[0].device_kind}")
  # (launches, median wall ms of a call timed alone, as the suite times it, median span us of a traced call)
  sides = {"jsparse": jsparse_launches(args)}
  if not args.skip_flexgemm:
    sides["flexgemm"] = flexgemm_launches(row, args.dtype, args.mode, args)
  result = {"row": row.name, "dtype": args.dtype, "mode": args.mode, "device": jax.devices()[0].device_kind}
  for side, (launches, wall_ms, span) in sides.items():
    s = summary(launches)
    result[side] = {"launches": launches, "wall_ms": wall_ms, "span_us": span, **s}
    print(f"-- {side}: {s['launch_count']} launches, {s['total_us'] / 1e3:.3f} ms of kernels, "
          f"{wall_ms:.3f} ms a call (median of {args.repeats}, each waited for); first kernel to last "
          f"{span / 1e3:.3f} ms: {(span - s['total_us']) / 1e3:.3f} ms of GPU idle between launches, "
          f"{wall_ms - span / 1e3:.3f} ms host (dispatch + sync; the tracer adds some)")
    for i, e in enumerate(launches):
      if e["us"] >= args.min_us:
        print(f"  {i:4d} {e['us']:9.1f} us  {e['name'][:110]}")
    for name, us in s["families_us"].items():
      print(f"  {us:9.1f} us  {name}")
  if args.out:
    with open(args.out, "w") as f:
      json.dump(result, f, indent=1)


if __name__ == "__main__":
  main()
