"""What is live at the peak of a network's step: XLA's memory analysis and its buffer assignment, by network op.

    python -m benchmarks.probes.network_memory --networks minkunet --sizes large --dtypes tf32 --modes train \
        [--run] [--out FILE.json] [--top 40] [--group-depth 0] [--impl xla] [--keep-dump DIR]

For each (network, size, dtype, mode) it builds the network, its parameters and its input exactly as
benchmarks/networks.py does (planned capacities, jitted step over a params dict), compiles the step without
running it and prints:
- argument / output / temp / alias bytes from `compiled.memory_analysis()`; their sum (less the alias) is the
  "jsparse MB" networks.md reports, and on a GPU what the step holds while it runs (XLA allocates the whole temp
  buffer and every output up front);
- from the buffer assignment XLA dumps for that compile (`--xla_dump_to`, passed as a compiler option of this
  compile only): the bytes of each allocation kind, and the moment of the schedule at which the values in the
  temp allocation peak (the live range dump gives each value's [first, last] step, the buffer assignment its
  size and offset). At that moment every live temp value is listed, largest first, with its dtype, shape, size,
  HLO instruction and op_name metadata (`jvp(op:subm)` is a submanifold convolution's forward,
  `transpose(jvp(op:subm))` its backward; a forward value live during the backward is a residual kept for it),
  and the values are grouped by that op prefix with totals (`--group-depth 1` splits each op by its next scope);
- the arguments and outputs (resident for the whole step) by group, XLA's own whole-program live peak, and the
  reconciliation: arguments + outputs + temp live at its peak = analysed peak - fragmentation of the temp buffer.
With --run the step is executed once and the device's peak_bytes_in_use (a process-lifetime high-water mark, so
the capacity-planning forward that precedes it can mask it) is reported beside the analysis; CPU devices report
no memory statistics. MiB throughout (networks.md's "MB" are MiB). Runs anywhere: `--sizes tiny` on the CPU.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np

MIB = 2**20

_ALLOCATION = re.compile(r"^allocation (\d+): size (\d+), (.*):\s*$")
_VALUE = re.compile(r"^\s+value: <\d+ (\S+?)(\{[\d,]*\})?( \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (.*)$")
_LIVE_RANGE = re.compile(r"^\s+(\S+?)(\{[\d,]*\}):(\d+)-(\d+)\s*$")
_PEAK_HEADER = re.compile(r"^\s+Live ranges at (\d+) \(peak\):")
_PEAK_VALUE = re.compile(r"^\s+(\S+?)(\{[\d,]*\}): (\d+) bytes")
_SEQUENCE = re.compile(r"^\s+(\d+):(\S+)\s*$")
_SHAPE = re.compile(r"^([a-z]+\d*)\[([\d,]*)\]")


@dataclasses.dataclass
class Value:
  """One HLO value of a buffer assignment: instruction name, shape index, bytes, offset in its allocation."""
  instruction: str
  index: str
  size: int
  offset: int
  shape: str
  allocation: int

  @property
  def key(self) -> str:
    return f"{self.instruction}{self.index}"

  @property
  def dtype(self) -> str:
    m = _SHAPE.match(self.shape)
    return m.group(1) if m else ""

  @property
  def dims(self) -> str:
    m = _SHAPE.match(self.shape)
    return f"[{m.group(2)}]" if m else self.shape.split("{")[0]


@dataclasses.dataclass
class Allocation:
  """One allocation of a buffer assignment and the values XLA placed in it."""
  index: int
  size: int
  kind: str  # parameter | output | temp | constant | thread-local | other
  header: str
  values: list


def allocation_kind(header: str) -> str:
  """An allocation's role from its header in XLA's buffer-assignment text (a donated parameter is a parameter)."""
  if re.search(r"\bparameter \d+", header):
    return "parameter"
  if "constant" in header:
    return "constant"
  if "thread-local" in header:
    return "thread-local"
  if "maybe-live-out" in header or "output shape" in header:
    return "output"
  if "preallocated-temp" in header:
    return "temp"
  return "other"


def parse_buffer_assignment(path: str) -> list[Allocation]:
  """The allocations of XLA's `*buffer-assignment.txt` dump, each with the values placed in it."""
  allocations, current = [], None
  with open(path) as f:
    for line in f:
      m = _ALLOCATION.match(line)
      if m:
        current = Allocation(int(m.group(1)), int(m.group(2)), allocation_kind(m.group(3)), m.group(3), [])
        allocations.append(current)
        continue
      m = _VALUE.match(line)
      if m and current is not None:
        current.values.append(Value(m.group(1), m.group(2) or "{}", int(m.group(4)), int(m.group(5)),
                                    m.group(6).strip(), current.index))
  if not allocations:
    raise ValueError(f"path: no allocations in {path!r} (not an XLA buffer-assignment dump?)")
  return allocations


@dataclasses.dataclass
class LiveRanges:
  """What XLA's live-range dump says about one compiled module."""
  sequence: list        # instruction name at each step of the flattened schedule
  ranges: dict          # "name{index}" -> (first step, last step), both inclusive
  xla_peak_step: int | None
  xla_peak: dict        # "name{index}" -> bytes, the values XLA lists as live at its peak


def parse_live_range(path: str) -> LiveRanges:
  """XLA's `*live-range.txt` dump (written with --xla_dump_buffer_assignment_analysis): the flattened schedule,
  each value's live range, and the values XLA lists at its own peak."""
  sequence, ranges, peak_step, peak = [], {}, None, {}
  section = None
  with open(path) as f:
    for line in f:
      stripped = line.strip()
      if stripped.startswith("InstructionSequence"):
        section = "sequence"
        continue
      if stripped.startswith("BufferLiveRange"):
        section = "ranges"
        continue
      m = _PEAK_HEADER.match(line)
      if m:
        section, peak_step = "peak", int(m.group(1))
        continue
      if stripped.startswith("Stack trace"):
        section = None
        continue
      if section == "sequence" and (m := _SEQUENCE.match(line)):
        sequence.append(m.group(2))
      elif section == "ranges" and (m := _LIVE_RANGE.match(line)):
        ranges[m.group(1) + m.group(2)] = (int(m.group(3)), int(m.group(4)))
      elif section == "peak" and (m := _PEAK_VALUE.match(line)):
        peak[m.group(1) + m.group(2)] = int(m.group(3))
  if not ranges:
    raise ValueError(f"path: no buffer live ranges in {path!r} (not an XLA live-range dump?)")
  return LiveRanges(sequence, ranges, peak_step, peak)


def live_values(allocations: list[Allocation], live: LiveRanges, kinds: tuple[str, ...]) -> list[Value]:
  """The values of the allocations of `kinds` that have a place in the schedule (a value inside a fusion's own
  computation has none)."""
  return [v for a in allocations if a.kind in kinds for v in a.values if v.key in live.ranges]


def occupied(values: list[Value]) -> list[tuple[Value, int]]:
  """(value, bytes it adds) for values live at one moment: values XLA placed on overlapping bytes of one allocation
  share memory (an in-place update, a while loop's carried values), so each adds only what the values before it
  in (allocation, offset, largest first) order do not cover. The added bytes sum to the occupied bytes."""
  out, alloc, covered_to = [], None, 0
  for v in sorted(values, key=lambda v: (v.allocation, v.offset, -v.size)):
    if v.allocation != alloc:
      alloc, covered_to = v.allocation, 0
    end = v.offset + v.size
    out.append((v, max(0, end - max(v.offset, covered_to))))
    covered_to = max(covered_to, end)
  return out


def live_bytes(allocations: list[Allocation], live: LiveRanges, kinds: tuple[str, ...]) -> np.ndarray:
  """Bytes occupied at each step of the schedule by the values of the allocations of `kinds`, a value being live
  from the step that defines it to its last use, both included."""
  values = live_values(allocations, live, kinds)
  steps = max(len(live.sequence), 1 + max((live.ranges[v.key][1] for v in values), default=0))
  starts: dict[int, list] = {}
  for v in values:
    starts.setdefault(live.ranges[v.key][0], []).append(v)
  active: list[Value] = []
  out = np.zeros(steps, np.int64)
  for t in range(steps):
    active = [v for v in active if live.ranges[v.key][1] >= t] + starts.get(t, [])
    out[t] = sum(added for _, added in occupied(active))
  return out


def values_at(allocations: list[Allocation], live: LiveRanges, kinds: tuple[str, ...], step: int):
  """(value, bytes it adds) for the values live at `step`, largest addition first."""
  now = [v for v in live_values(allocations, live, kinds) if live.ranges[v.key][0] <= step <= live.ranges[v.key][1]]
  return sorted(occupied(now), key=lambda va: (-va[1], -va[0].size))


def op_group(op_name: str, depth: int = 0) -> str:
  """The group of a value by its op_name metadata: the path component naming the network op (`jvp(op:subm)`,
  `transpose(jvp(op:subm))`), with `depth` further components; the top-level jit's name is dropped. An argument's
  group is its pytree path, a normalisation's scale and bias together at depth 0 (`params['stem_bn_a']`)."""
  if not op_name:
    return "(no metadata)"
  if not op_name.startswith("jit("):  # an argument's pytree path, e.g. params[\'enc1_bn_a/scale\']
    path = op_name.replace("\\'", "'")
    return path if depth else re.sub(r"/[^'\]]*", "", path)
  parts = op_name.split("/")[1:]
  for i, part in enumerate(parts):
    if "op:" in part:
      return "/".join(parts[: i + 1 + depth])
  return "/".join(parts[: 1 + depth])


def summarise_values(values: list[tuple[Value, int, str]], depth: int) -> list[dict]:
  """[{group, bytes, values}] largest first, from (value, bytes it adds, op_name) triples."""
  groups: dict[str, list] = {}
  for _, added, op_name in values:
    g = groups.setdefault(op_group(op_name, depth), [0, 0])
    g[0] += added
    g[1] += 1
  return [{"group": k, "bytes": b, "values": n} for k, (b, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])]


def dump_files(dump: str, module: str | None = None) -> dict:
  """{suffix: path} of the buffer assignment and live range XLA dumped for the largest module in `dump`
  (preferring names containing `module`)."""
  found = glob.glob(os.path.join(dump, "*buffer-assignment.txt"))
  if module:
    found = [p for p in found if module in os.path.basename(p)] or found
  if not found:
    raise FileNotFoundError(f"no *buffer-assignment.txt under {dump}")
  path = max(found, key=os.path.getsize)
  stem = path[: -len("buffer-assignment.txt")]
  out = {"buffer-assignment": path}
  if os.path.exists(stem + "live-range.txt"):
    out["live-range"] = stem + "live-range.txt"
  return out


def analyse(memory: dict, allocations: list[Allocation], live: LiveRanges, op_names: dict, top: int = 40,
            depth: int = 0) -> dict:
  """The report of one compiled step. memory: compiled.memory_analysis()'s byte counts (argument, output, temp,
  alias); op_names: HLO instruction name -> op_name metadata."""
  by_kind: dict[str, list] = {}
  for a in allocations:
    k = by_kind.setdefault(a.kind, [0, 0])
    k[0] += a.size
    k[1] += 1
  temp_bytes = live_bytes(allocations, live, ("temp",))
  peak_step = int(np.argmax(temp_bytes))
  temp_live = int(temp_bytes[peak_step])
  named = lambda pairs: [(v, added, op_names.get(v.instruction, "")) for v, added in pairs]  # noqa: E731
  at_peak = named(values_at(allocations, live, ("temp",), peak_step))
  last = len(temp_bytes) - 1
  arguments = named(values_at(allocations, live, ("parameter",), 0))
  outputs = named(values_at(allocations, live, ("output",), last))
  all_bytes = live_bytes(allocations, live, ("parameter", "output", "temp", "constant", "other"))
  analysed = memory["argument"] + memory["output"] + memory["temp"] - memory["alias"]
  # Temp values the schedule does not place cannot be counted at the peak: if they are large, the fragmentation
  # below is really them.
  unscheduled = [v for a in allocations if a.kind == "temp" for v in a.values if v.key not in live.ranges]
  instr = live.sequence[peak_step] if peak_step < len(live.sequence) else ""
  entry = lambda v, added, op: {"bytes": v.size, "added_bytes": added, "dtype": v.dtype, "shape": v.dims,  # noqa: E731
                                "instruction": v.key, "op_name": op}
  return {
      "memory_analysis": dict(memory, peak=analysed),
      "allocations": {k: {"bytes": b, "count": n} for k, (b, n) in sorted(by_kind.items())},
      "temp_peak": {"step": peak_step, "steps": len(temp_bytes), "instruction": instr,
                    "op_name": op_names.get(instr, ""), "live_bytes": temp_live,
                    "fragmentation_bytes": memory["temp"] - temp_live,
                    "unscheduled_values": len(unscheduled),
                    "unscheduled_largest_bytes": max((v.size for v in unscheduled), default=0)},
      "live_at_temp_peak": [entry(*t) for t in at_peak[:top]],
      "live_at_temp_peak_count": len(at_peak),
      "live_at_temp_peak_by_group": summarise_values(at_peak, depth),
      "arguments_bytes": sum(added for _, added, _ in arguments),
      "arguments_by_group": summarise_values(arguments, depth),
      "outputs_bytes": sum(added for _, added, _ in outputs),
      "outputs_by_group": summarise_values(outputs, depth),
      "whole_program_peak": {"step": int(np.argmax(all_bytes)), "bytes": int(np.max(all_bytes)),
                             "xla_step": live.xla_peak_step, "xla_bytes": sum(live.xla_peak.values())},
      "listed_bytes": memory["argument"] + memory["output"] - memory["alias"] + temp_live,
      "analysed_peak_bytes": analysed,
  }


def render(name: str, r: dict, top: int) -> str:
  """The text report of one `analyse` result (with `run`'s statistics when present)."""
  m, tp = r["memory_analysis"], r["temp_peak"]
  mib = lambda b: f"{b / MIB:10.1f}"  # noqa: E731
  lines = [f"== {name}",
           f"  compiled: args {m['argument'] / MIB:.1f} + out {m['output'] / MIB:.1f} + temp {m['temp'] / MIB:.1f}"
           f" - alias {m['alias'] / MIB:.1f} = {m['peak'] / MIB:.1f} MiB",
           "  allocations: " + ", ".join(f"{k} {v['bytes'] / MIB:.1f} MiB ({v['count']})"
                                         for k, v in r["allocations"].items()),
           f"  temp peak at step {tp['step']}/{tp['steps']} ({tp['instruction']}: {tp['op_name'][-100:]})",
           f"    live {tp['live_bytes'] / MIB:.1f} of the temp buffer's {m['temp'] / MIB:.1f} MiB "
           f"(fragmentation {tp['fragmentation_bytes'] / MIB:.1f}; {tp['unscheduled_values']} temp values outside the "
           f"schedule, largest {tp['unscheduled_largest_bytes'] / MIB:.1f})",
           f"  listed: args + out - alias + temp live = {r['listed_bytes'] / MIB:.1f} MiB vs analysed "
           f"{r['analysed_peak_bytes'] / MIB:.1f}",
           f"  live at the temp peak by op ({r['live_at_temp_peak_count']} values), MiB:"]
  lines += [f"    {mib(g['bytes'])}  {g['values']:5d}  {g['group']}" for g in r["live_at_temp_peak_by_group"]]
  lines.append(f"  largest {min(top, r['live_at_temp_peak_count'])} live at the temp peak, MiB:")
  lines += [f"    {mib(v['bytes'])}  {v['dtype']}{v['shape']:<18s} {v['instruction']:<32s} {v['op_name'][-110:]}"
            + ("" if v["added_bytes"] == v["bytes"] else f"  (shares memory: adds {v['added_bytes'] / MIB:.1f})")
            for v in r["live_at_temp_peak"]]
  for title, key in (("arguments", "arguments_by_group"), ("outputs", "outputs_by_group")):
    lines.append(f"  {title} by op (resident throughout), MiB:")
    lines += [f"    {mib(g['bytes'])}  {g['values']:5d}  {g['group']}" for g in r[key][:12]]
  w = r["whole_program_peak"]
  lines.append(f"  whole-program live peak (arguments, outputs defined so far, temps): step {w['step']}, "
               f"{w['bytes'] / MIB:.1f} MiB (the live-range dump's own peak: step {w['xla_step']}, "
               f"{w['xla_bytes'] / MIB:.1f} MiB, counted otherwise at instruction boundaries)")
  if "run" in r:
    lines.append("  run: " + ", ".join(f"{k} {v / MIB:.1f} MiB" if isinstance(v, int) else f"{k} {v}"
                                        for k, v in r["run"].items()))
  return "\n".join(lines)


def probe_step(network: str, size: str, dtype_name: str, mode: str, seed: int = 0, implementation=None,
               top: int = 40, depth: int = 0, run: bool = False, keep_dump: str | None = None) -> dict:
  """Builds the step as networks.bench_jsparse does, compiles it with a buffer-assignment dump, and analyses it."""
  import jax
  import jax.numpy as jnp
  from benchmarks import networks

  if mode not in networks.MODES:
    raise ValueError(f"mode: {mode!r} is not one of {networks.MODES}")
  if dtype_name not in networks.DTYPES:
    raise ValueError(f"dtype_name: {dtype_name!r} is not one of {list(networks.DTYPES)}")
  w = networks.workload(network, size)
  inp = networks.make_inputs(w, seed)
  dtype, precision = networks.DTYPES[dtype_name]
  params = networks.Params(seed)
  caps = networks.plan_capacities(networks.NETWORKS[network], inp, params, dtype, implementation, precision)
  p = {k: jnp.asarray(v) for k, v in params.arrays.items()}
  x = networks.jax_input(inp, dtype)
  inference, train = networks.jax_functions(networks.NETWORKS[network], inp, caps, dtype, implementation, precision)
  fn = {"inference": inference, "train": train}[mode]
  if keep_dump:
    os.makedirs(keep_dump, exist_ok=True)
  # One directory per compile, and the dump a compiler option of this compile only: nothing else is dumped.
  dump = tempfile.mkdtemp(prefix=f"{network}_{size}_{dtype_name}_{mode}_", dir=keep_dump)
  compiled = jax.jit(fn).lower(p, x).compile(compiler_options={
      "xla_dump_to": dump, "xla_dump_hlo_as_text": True, "xla_dump_buffer_assignment_analysis": True})
  files = dump_files(dump, f"jit_{mode}")
  if "live-range" not in files:
    raise FileNotFoundError(f"XLA wrote no live-range dump beside {files['buffer-assignment']} "
                            "(xla_dump_buffer_assignment_analysis was asked for)")
  m = compiled.memory_analysis()
  memory = {"argument": int(m.argument_size_in_bytes), "output": int(m.output_size_in_bytes),
            "temp": int(m.temp_size_in_bytes), "alias": int(getattr(m, "alias_size_in_bytes", 0))}
  report = analyse(memory, parse_buffer_assignment(files["buffer-assignment"]), parse_live_range(files["live-range"]),
                   networks.hlo_op_names(compiled.as_text()), top, depth)
  report.update(network=network, size=size, dtype=dtype_name, mode=mode, sites=int(len(inp.coords)),
                batch_size=w.batch_size, device=jax.devices()[0].device_kind, dump=files)
  if run:
    report["run"] = run_once(compiled, (p, x), memory["argument"])
  if not keep_dump:
    shutil.rmtree(dump, ignore_errors=True)
    report.pop("dump")
  return report


def run_once(compiled, call_args, argument_bytes: int) -> dict:
  """The device's memory statistics around one call. peak_bytes_in_use is the process's high-water mark: it is
  the step's only when it rose during the call (then step_peak = peak - in use before + the arguments, which
  were in use before)."""
  import jax
  dev = jax.devices()[0]
  before = dev.memory_stats()
  jax.block_until_ready(compiled(*call_args))
  after = dev.memory_stats()
  if not before or not after or "peak_bytes_in_use" not in after:
    return {"memory_stats": f"not reported by {dev.platform}"}
  out = {"peak_bytes_in_use_before": int(before.get("peak_bytes_in_use", 0)),
         "bytes_in_use_before": int(before.get("bytes_in_use", 0)),
         "peak_bytes_in_use": int(after["peak_bytes_in_use"])}
  if out["peak_bytes_in_use"] > out["peak_bytes_in_use_before"]:
    out["step_peak_bytes"] = out["peak_bytes_in_use"] - out["bytes_in_use_before"] + argument_bytes
  else:
    out["step_peak"] = "masked by an earlier high-water mark"
  return out


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  csv = lambda s: [t for t in s.split(",") if t]  # noqa: E731
  ap.add_argument("--networks", type=csv, default=["minkunet"])
  ap.add_argument("--sizes", type=csv, default=["large"], help="tiny | small | large")
  ap.add_argument("--dtypes", type=csv, default=["tf32"], help="fp16 | tf32 | fp32")
  ap.add_argument("--modes", type=csv, default=["train"], help="inference | train")
  ap.add_argument("--impl", default=None, help="jsparse implementation (None: pallas on a GPU, xla elsewhere)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--top", type=int, default=40, help="live values listed at the peak")
  ap.add_argument("--group-depth", type=int, default=0,
                  help="op_name components kept after the network op's (1: jvp(op:down)/jit(_compact))")
  ap.add_argument("--run", action="store_true", help="also run the step once and report peak_bytes_in_use")
  ap.add_argument("--keep-dump", default=None, help="write XLA's dumps here and keep them")
  ap.add_argument("--out", default=None, help="JSON file of the reports")
  args = ap.parse_args(argv)
  from benchmarks import networks, suite
  for n in args.networks:
    if n not in networks.NETWORKS:
      ap.error(f"unknown network {n!r}; have {list(networks.NETWORKS)}")
  reports = []
  for net in args.networks:
    for size in args.sizes:
      for dname in args.dtypes:
        for mode in args.modes:
          name = f"{net}/{size} {dname} {mode}"
          try:
            r = probe_step(net, size, dname, mode, args.seed, args.impl, args.top, args.group_depth, args.run,
                           args.keep_dump)
            print(render(f"{name}: {r['sites']} input sites, batch {r['batch_size']}, {r['device']}", r, args.top),
                  flush=True)
          except Exception as e:  # one failing cell must not stop the others
            r = {"network": net, "size": size, "dtype": dname, "mode": mode, "error": suite.short_error(e)}
            print(f"== {name}: {r['error']}", flush=True)
          reports.append(r)
          if args.out:
            with open(args.out, "w") as f:
              json.dump({"meta": suite.metadata(), "reports": reports}, f, indent=1, default=str)
  return 0 if all("error" not in r for r in reports) else 1


if __name__ == "__main__":
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before the backend starts, as networks.py runs
  sys.exit(main())
