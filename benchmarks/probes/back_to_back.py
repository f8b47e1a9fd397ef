"""Probe: one compiled suite row timed three ways, with the GPU's SM clock sampled during each.

    python -m benchmarks.probes.back_to_back --row 3 --dtype tf32 [--calls 10] [--batches 5]

Run 119 timed suite row 3 (TF32 inference) at 5.30 ms a call waited for and 5.40 ms a call issued back to back,
while traces (runs 111, 117) saw 4.76-4.81 ms of GPU work a call and 3.6 us gaps between back-to-back calls.
This times, on one machine and in one process: each call waited for; batches of `--calls` calls back to back
(one wait a batch); the same batches under `jax.profiler` (wall time, and the traced GPU span a call). During
each, `nvidia-smi` samples the SM clock, power and temperature, so that a clock drop under sustained load and a
profiler that changes what runs can be told apart. Without nvidia-smi (a CPU) the clock columns are empty.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import tempfile
import threading
import time

import jax

from benchmarks import networks, suite

QUERY = ("nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu", "--format=csv,noheader,nounits")


class ClockSampler:
  """Samples (seconds since start, SM MHz, watts, deg C) from `command` (nvidia-smi's query, repeated every
  `interval_ms`) in a thread while the context is open. A missing command leaves `samples` empty."""

  def __init__(self, interval_ms: int = 20, command=QUERY):
    self.command = [*command, f"-lms={interval_ms}"]
    self.samples: list[tuple[float, float, float, float]] = []

  def __enter__(self):
    self._t0 = time.perf_counter()
    try:
      self._proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    except OSError:  # no nvidia-smi: no samples
      self._proc = None
      return self
    self._thread = threading.Thread(target=self._read, daemon=True)
    self._thread.start()
    return self

  def _read(self):
    for line in self._proc.stdout:
      parsed = parse_sample(line)
      if parsed is not None:
        self.samples.append((time.perf_counter() - self._t0, *parsed))

  def __exit__(self, *exc):
    if self._proc is not None:
      self._proc.terminate()
      self._proc.wait()
      self._thread.join(timeout=5)


def parse_sample(line: str) -> tuple[float, float, float] | None:
  """(SM MHz, watts, deg C) from one line of the query's CSV; None for a line that is not three numbers (a GPU
  that reports "[N/A]")."""
  try:
    mhz, watts, temp = (float(v) for v in line.strip().split(","))
  except ValueError:
    return None
  return mhz, watts, temp


def clock_summary(samples) -> str:
  if not samples:
    return "no clock samples"
  mhz = [s[1] for s in samples]
  watts = [s[2] for s in samples]
  return (f"SM clock min / median / max {min(mhz):.0f} / {statistics.median(mhz):.0f} / {max(mhz):.0f} MHz, "
          f"power median {statistics.median(watts):.0f} W, {len(samples)} samples")


def gpu_span_per_call(gpu_events, calls: int) -> float:
  """ms of GPU time a call: the traced events' first start to last end, over `calls` back-to-back calls."""
  start = min(e["ts"] for e in gpu_events)
  end = max(e["ts"] + e.get("dur", 0.0) for e in gpu_events)
  return (end - start) / 1e3 / calls


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  suite.add_row_arguments(ap, row=3)
  ap.add_argument("--calls", type=int, default=10, help="calls a back-to-back batch")
  ap.add_argument("--batches", type=int, default=5)
  ap.add_argument("--interval-ms", type=int, default=20, help="nvidia-smi's sampling interval")
  args = ap.parse_args(argv)
  row, x, params, compiled = suite.compile_row(args)
  call = lambda: compiled(x, params)  # noqa: E731
  for _ in range(3):
    jax.block_until_ready(call())
  print(f"== suite row {args.row} ({row.name}) {args.dtype} {args.mode}, {jax.devices()[0].device_kind}")
  with ClockSampler(args.interval_ms) as clocks:
    waited = suite.time_calls(call, jax.block_until_ready, 0, args.calls * args.batches)
  print(f"waited for, ms a call: median {waited['median_ms']:.3f}, min {waited['min_ms']:.3f}; "
        f"{clock_summary(clocks.samples)}")
  with ClockSampler(args.interval_ms) as clocks:
    piped = suite.time_pipelined(call, jax.block_until_ready, args.batches, args.calls)
  print(f"back to back, ms a call: median {piped['pipelined_ms']:.3f}, min {piped['pipelined_min_ms']:.3f}; "
        f"{clock_summary(clocks.samples)}")
  with tempfile.TemporaryDirectory() as trace_dir, ClockSampler(args.interval_ms) as clocks:
    jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
    t0 = time.perf_counter()
    outs = [call() for _ in range(args.calls)]
    jax.block_until_ready(outs)
    wall = (time.perf_counter() - t0) * 1e3 / args.calls
    jax.profiler.stop_trace()
    gpu_events, _ = networks.device_kernel_events(networks._trace_events(trace_dir))
  span = f"{gpu_span_per_call(gpu_events, args.calls):.3f}" if gpu_events else "n/a (no GPU events)"
  print(f"back to back under the profiler, ms a call: wall {wall:.3f}, traced GPU span {span}; "
        f"{clock_summary(clocks.samples)}")


if __name__ == "__main__":
  main()
