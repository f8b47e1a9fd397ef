"""Runs a notebook's code cells as a plain script, for machines without Jupyter (the GPU machines).

    python notebooks/run_as_script.py notebooks/02_generation.ipynb --out DIR

Code cells run in order in one namespace; IPython magics (`%...`, `!...`) are skipped. A cell whose last
line is an expression that gives a matplotlib Figure (the notebooks' `fig`) has it saved as
DIR/<notebook>_cell<k>.png. Each cell's wall time is printed. Exits non-zero at the first failing cell.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import sys
import time


def main() -> int:
  ap = argparse.ArgumentParser()
  ap.add_argument("notebook")
  ap.add_argument("--out", default=os.environ.get("OUT") or "/tmp/notebook_out")
  ap.add_argument("--dpi", type=int, default=70)
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  os.environ.setdefault("MPLBACKEND", "Agg")
  sys.path.insert(0, os.getcwd())
  name = os.path.splitext(os.path.basename(args.notebook))[0]
  with open(args.notebook) as f:
    cells = [c for c in json.load(f)["cells"] if c["cell_type"] == "code"]
  namespace = {"__name__": "__main__"}
  t_start = time.time()
  for k, cell in enumerate(cells):
    src = "".join(cell["source"])
    src = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith(("%", "!")))
    tree = ast.parse(src)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    t0 = time.time()
    print(f"=== cell {k} ===", flush=True)
    exec(compile(tree, f"<{name} cell {k}>", "exec"), namespace)
    if last is not None:
      value = eval(compile(ast.Expression(last.value), f"<{name} cell {k}>", "eval"), namespace)
      if hasattr(value, "savefig"):
        path = os.path.join(args.out, f"{name}_cell{k}.png")
        value.savefig(path, dpi=args.dpi)
        print(f"[figure saved: {path}]")
      elif value is not None:
        print(repr(value)[:2000])
    print(f"=== cell {k}: {time.time() - t0:.1f}s (total {time.time() - t_start:.1f}s) ===", flush=True)
  return 0


if __name__ == "__main__":
  sys.exit(main())
