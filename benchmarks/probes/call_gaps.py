"""Probe: where the GPU idles between back-to-back calls of one compiled suite row, and what the host does then.

    python -m benchmarks.probes.call_gaps --row 3 --dtype tf32 [--calls 10] [--top 15]

`suite_timeline` found TF32 row 3 idle for ~0.45 ms a call even when calls are issued back to back, with no idle
time inside a call. This traces `--calls` calls issued without waiting (as training issues steps), splits the GPU
events into calls (one launch sequence each), and for every gap between one call's last event and the next call's
first prints its length and the host-side trace events that overlap it, summed by name: the dispatch work (or the
wait) that keeps the GPU from starting the next call. GPU events include copies and memsets, not only kernels.

`--wait` times calls as the suite does, each waited for (call + `block_until_ready`), and splits each call's host
window (a trace annotation around call and wait) into the lead (window start to the call's first GPU event: the
host's dispatch), the GPU span, and the tail (the last GPU event's end to the window's end: the wake-up), with the
host events that overlap the leads and the tails. Ten calls back to back had 3.6 us gaps on the H200 (run 111),
while the suite's waited-for calls take ~0.43 ms more than their kernels: this names where that goes.
"""
from __future__ import annotations

import argparse
import collections
import statistics
import tempfile

import jax

from benchmarks import networks, suite


def gaps(events: list[dict], gpu_events: list[dict], calls: int) -> tuple[list[float], collections.Counter]:
  """(each gap between consecutive calls in us, host events' overlap with the gaps in us, summed by name)."""
  gpu_events = sorted(gpu_events, key=lambda e: e["ts"])
  per_call = len(gpu_events) // calls
  if per_call == 0 or per_call * calls != len(gpu_events):
    raise RuntimeError(f"{len(gpu_events)} GPU events over {calls} calls: not one launch sequence per call")
  gpu_ids = {id(e) for e in gpu_events}
  host = [e for e in events if e.get("ph") == "X" and id(e) not in gpu_ids and e.get("dur", 0) > 0]
  out, overlap = [], collections.Counter()
  for c in range(calls - 1):
    done = max(e["ts"] + e.get("dur", 0.0) for e in gpu_events[c * per_call:(c + 1) * per_call])
    start = gpu_events[(c + 1) * per_call]["ts"]
    out.append(start - done)
    _overlap(host, done, start, overlap)
  return out, overlap


def _overlap(host: list[dict], lo: float, hi: float, into: collections.Counter) -> None:
  for e in host:
    a, b = max(lo, e["ts"]), min(hi, e["ts"] + e["dur"])
    if b > a:
      into[e.get("name", "?")[:100]] += b - a


WAIT_MARKER = "call_gaps.waited_call"


def waited_windows(events: list[dict], gpu_events: list[dict], marker: str = WAIT_MARKER):
  """For calls each waited for inside a host annotation named `marker`: ([(lead, gpu span, tail) in us per call],
  host events' overlap with the leads, and with the tails, in us summed by name). Each call's GPU events are
  those that start inside its window."""
  windows = sorted((e for e in events if e.get("name") == marker and e.get("ph") == "X"), key=lambda e: e["ts"])
  gpu_ids = {id(e) for e in gpu_events}
  host = [e for e in events if e.get("ph") == "X" and id(e) not in gpu_ids and e.get("dur", 0) > 0
          and e.get("name") != marker]
  rows, lead_host, tail_host = [], collections.Counter(), collections.Counter()
  for w in windows:
    start, end = w["ts"], w["ts"] + w["dur"]
    inside = [e for e in gpu_events if start <= e["ts"] < end]
    if not inside:
      raise RuntimeError(f"no GPU event inside the waited call at {start} us")
    first = min(e["ts"] for e in inside)
    last = max(e["ts"] + e.get("dur", 0.0) for e in inside)
    rows.append((first - start, last - first, end - last))
    _overlap(host, start, first, lead_host)
    _overlap(host, last, end, tail_host)
  return rows, lead_host, tail_host


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  suite.add_row_arguments(ap, row=3)
  ap.add_argument("--calls", type=int, default=10)
  ap.add_argument("--top", type=int, default=15)
  ap.add_argument("--wait", action="store_true", help="wait for each call (as the suite times them): split each "
                  "call's host window into dispatch lead, GPU span and wake-up tail")
  args = ap.parse_args(argv)
  row, x, params, compiled = suite.compile_row(args)
  for _ in range(3):
    jax.block_until_ready(compiled(x, params))
  with tempfile.TemporaryDirectory() as trace_dir:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    if args.wait:
      for _ in range(args.calls):
        with jax.profiler.TraceAnnotation(WAIT_MARKER):
          jax.block_until_ready(compiled(x, params))
    else:
      outs = [compiled(x, params) for _ in range(args.calls)]
      jax.block_until_ready(outs)
    jax.profiler.stop_trace()
    events = networks._trace_events(trace_dir)
  gpu_events, threads = networks.device_kernel_events(events)
  how = "each waited for" if args.wait else "back to back"
  print(f"== suite row {args.row} ({row.name}) {args.dtype} {args.mode}, {jax.devices()[0].device_kind}: "
        f"{args.calls} calls {how}, {len(gpu_events)} GPU events on {threads}")
  if not gpu_events:
    print("no GPU events traced (a CPU run): nothing to split")
    return
  if args.wait:
    rows, lead_host, tail_host = waited_windows(events, gpu_events)
    for name, k in (("lead (call to first GPU event)", 0), ("GPU span", 1), ("tail (last GPU event to return)", 2)):
      print(f"{name}, us: median {statistics.median(r[k] for r in rows):.1f}, all {[round(r[k], 1) for r in rows]}")
    for name, counter in (("leads", lead_host), ("tails", tail_host)):
      print(f"host events overlapping the {name}, us summed over {len(rows)} calls:")
      for event, us in counter.most_common(args.top):
        print(f"  {us:10.1f}  {event}")
    return
  between, overlap = gaps(events, gpu_events, args.calls)
  print(f"gaps between calls (us): median {statistics.median(between):.1f}, "
        f"all {[round(g, 1) for g in between]}")
  per_call = len(gpu_events) // args.calls
  first = sorted(gpu_events, key=lambda e: e["ts"])[:per_call]
  print(f"GPU events of one call ({per_call}): {[e['name'][:40] for e in first]}")
  print(f"host events overlapping the gaps, us summed over {args.calls - 1} gaps:")
  for name, us in overlap.most_common(args.top):
    print(f"  {us:10.1f}  {name}")


if __name__ == "__main__":
  main()
