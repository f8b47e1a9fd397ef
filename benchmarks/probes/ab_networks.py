"""Probe: A/B of two source trees on the networks benchmark, in one device call, alternating.

Machines of one pool differ by several percent, so a change is measured against its parent in the same call:

  git archive <base-commit> | (mkdir -p .ab/base && tar -x -C .ab/base)      # here; .ab/ is gitignored
  python -m benchmarks.probes.ab_networks .ab/base . --rounds 2 -- \
      --networks second --sizes large --dtypes fp16 --anchors ''

Each round runs `benchmarks.networks` once per tree in a fresh process (PYTHONPATH pointing at the tree), base
first in even rounds and head first in odd ones, and the table at the end gives each cell's median over rounds
for both trees and their ratio. Use an even number of rounds.

`--base-env` / `--head-env NAME=VALUE` (repeatable) set environment variables for one side only, so one tree can
be compared with itself under other XLA flags. Both processes read one set of inputs (`--inputs-cache`, where
the tree's networks.py has it):

  python -m benchmarks.probes.ab_networks . . --head-env XLA_FLAGS=--xla_gpu_graph_min_graph_size=1 -- \
      --networks second,decoder --sizes small --dtypes fp16 --anchors ''
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def env_pairs(items: list[str]) -> dict[str, str]:
  """{"NAME": "VALUE"} of NAME=VALUE strings (the value may hold '=')."""
  out = {}
  for item in items:
    name, sep, value = item.partition("=")
    if not sep or not name:
      raise ValueError(f"expected NAME=VALUE, got {item!r}")
    out[name] = value
  return out


def with_inputs_cache(tree: str, argv: list[str], cache_dir: str) -> list[str]:
  """argv plus --inputs-cache cache_dir where the tree's networks.py has that option and argv names none, so
  every process of the A/B reads the inputs the first one drew (ray-casting the large scans takes ~20 s)."""
  with open(os.path.join(tree, "benchmarks", "networks.py")) as f:
    supported = '"--inputs-cache"' in f.read()
  return argv + ["--inputs-cache", cache_dir] if supported and "--inputs-cache" not in argv else argv


def run_tree(tree: str, argv: list[str], out_dir: str, extra_env: dict[str, str] | None = None) -> dict:
  env = {**os.environ, "PYTHONPATH": os.path.abspath(tree), **(extra_env or {})}
  cmd = [sys.executable, "-m", "benchmarks.networks", *argv, "--out", out_dir]
  subprocess.run(cmd, cwd=os.path.abspath(tree), env=env, check=True)
  with open(os.path.join(out_dir, "networks.json")) as f:
    data = json.load(f)
  cells = {}
  for r in data["results"]:
    for mode in ("inference", "train"):
      res = r["jsparse"].get(mode, {})
      if "median_ms" in res:
        cells[(r["network"], r["size"], r["dtype"], mode)] = (res["median_ms"], res.get("peak_bytes", 0))
  return cells


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("base")
  ap.add_argument("head")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--base-env", action="append", default=[], metavar="NAME=VALUE", help="environment, base only")
  ap.add_argument("--head-env", action="append", default=[], metavar="NAME=VALUE", help="environment, head only")
  own, argv = (sys.argv[1:], []) if "--" not in sys.argv else (
      sys.argv[1:sys.argv.index("--")], sys.argv[sys.argv.index("--") + 1:])
  args = ap.parse_args(own)
  times = {"base": {}, "head": {}}
  envs = {"base": env_pairs(args.base_env), "head": env_pairs(args.head_env)}
  inputs_cache = tempfile.mkdtemp()
  sides = [("base", args.base), ("head", args.head)]
  for r in range(args.rounds):
    # The later process of a pair has measured 1-3% slower (docs/perf_notes.md, twenty-ninth session): alternate.
    for name, tree in sides if r % 2 == 0 else sides[::-1]:
      tree_argv = with_inputs_cache(tree, argv, inputs_cache)
      for cell, value in run_tree(tree, tree_argv, tempfile.mkdtemp(), envs[name]).items():
        times[name].setdefault(cell, []).append(value)
  print("| cell | base ms | head ms | head / base | base MB | head MB |\n|---|---|---|---|---|---|")
  for cell in sorted(set(times["base"]) & set(times["head"])):
    b = statistics.median(t for t, _ in times["base"][cell])
    h = statistics.median(t for t, _ in times["head"][cell])
    mb = [times[n][cell][0][1] / 2**20 for n in ("base", "head")]
    print(f"| {' '.join(cell)} | {b:.2f} | {h:.2f} | {h / b:.3f} | {mb[0]:.0f} | {mb[1]:.0f} |")


if __name__ == "__main__":
  main()
