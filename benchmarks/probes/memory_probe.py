"""What is live at the peak of a suite workload: XLA's memory analysis and buffer assignment, per weight layout.

    python -m benchmarks.memory_probe --rows 1,2,4,5 --dtypes fp16,tf32 --layouts DHWIO,ODHWI [--modes inference]

For each (row, dtype, mode, layout) it compiles the suite's jsparse function (benchmarks.suite.jsparse_fns, not
run) and prints argument / output / temp bytes (the suite's "peak" is their sum) and, from the buffer
assignment XLA dumps, the largest allocations with the largest values they hold, so an excess over FlexGEMM's
peak can be traced to the arrays behind it. Needs a GPU for meaningful numbers (it runs anywhere).
"""
from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile

import jax
import jax.numpy as jnp

import jsparse
from benchmarks import suite, workloads

_ALLOC = re.compile(r"^allocation (\d+): size (\d+)(.*)$")
_VALUE = re.compile(r"^\s+value: <\d+ (\S+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")


def newest_buffer_assignment(dump: str, before: set[str]) -> str | None:
  files = set(glob.glob(os.path.join(dump, "*buffer-assignment.txt"))) - before
  return max(files, key=os.path.getmtime) if files else None


def summarise(path: str, top: int = 3, values: int = 12) -> list[str]:
  """The `top` largest allocations other than the arguments and, in each, the `values` largest values (name,
  size, offset, shape): values at overlapping offsets are not live together."""
  allocs, current = [], None
  with open(path) as f:
    for line in f:
      m = _ALLOC.match(line)
      if m:
        current = [int(m.group(2)), f"allocation {m.group(1)}{m.group(3)[:60]}", []]
        allocs.append(current)
        continue
      m = _VALUE.match(line)
      if m and current is not None:
        current[2].append((int(m.group(2)), m.group(1), m.group(4)[:60], int(m.group(3))))
  out = []
  temps = [a for a in allocs if "parameter" not in a[1]]  # the arguments are the weights and inputs, known
  for size, name, vals in sorted(temps, key=lambda a: -a[0])[:top]:
    out.append(f"  {size / 1e6:9.1f} MB  {name}")
    for vsize, vname, shape, offset in sorted(vals, key=lambda v: -v[0])[:values]:
      out.append(f"      {vsize / 1e6:9.1f} MB @{offset / 1e6:8.1f}  {vname}  {shape}")
  return out


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--rows", default="1,2,4,5")
  ap.add_argument("--dtypes", default="fp16,tf32")
  ap.add_argument("--modes", default="inference")
  ap.add_argument("--layouts", default="DHWIO,ODHWI")
  ap.add_argument("--input-grad", action="store_true",
                  help="train: also layer 0's input-feature gradient (the suite's --input-grad; off, as the suite)")
  ap.add_argument("--tuned", default=None, help="a ConfigTable JSON (default: the shipped table for this GPU)")
  args = ap.parse_args(argv)
  # Before the first computation initialises the backend: XLA then writes each compiled module's buffer
  # assignment into `dump` (the flag is read once, at start-up).
  dump = tempfile.mkdtemp(prefix="jsparse_xla_dump_")
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump} "
                             "--xla_dump_hlo_module_re=.*(inference|train).*").strip()
  os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  table = jsparse.ConfigTable.load(args.tuned) if args.tuned else jsparse.ConfigTable()
  print(f"device: {jax.devices()[0].device_kind}; dump {dump}", flush=True)
  with table:
    for i in (int(r) for r in args.rows.split(",")):
      row = workloads.SUITE[i]
      coords, feats, wb = suite.row_inputs(row)
      for dtype_name in args.dtypes.split(","):
        jdtype, precision, _ = suite.DTYPES[dtype_name]
        x = jsparse.SparseTensor.from_coords(coords, jnp.asarray(feats, jdtype), (row.res,) * 3, 1, capacity="exact")
        for mode in args.modes.split(","):
          for layout in args.layouts.split(","):
            params = [(jnp.asarray(suite.jsparse_weight(w, layout), jdtype), jnp.asarray(b, jdtype)) for w, b in wb]
            fn = suite.jsparse_fns(None, precision, "auto", layout, args.input_grad)[mode]
            before = set(glob.glob(os.path.join(dump, "*buffer-assignment.txt")))
            compiled = jax.jit(fn).lower(x, params).compile()
            m = compiled.memory_analysis()
            arg, out, tmp = m.argument_size_in_bytes, m.output_size_in_bytes, m.temp_size_in_bytes
            alias = getattr(m, "alias_size_in_bytes", 0)
            print(f"\n{row.name} {dtype_name} {mode} {layout}: peak {(arg + out + tmp - alias) / 1e6:.1f} MB = "
                  f"args {arg / 1e6:.1f} + out {out / 1e6:.1f} + temp {tmp / 1e6:.1f} - alias {alias / 1e6:.1f}",
                  flush=True)
            path = newest_buffer_assignment(dump, before)
            print("\n".join(summarise(path)) if path else "  (no buffer assignment dumped)", flush=True)
            del params, compiled
  return 0


if __name__ == "__main__":
  sys.exit(main())
