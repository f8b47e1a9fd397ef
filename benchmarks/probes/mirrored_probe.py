"""Probe: training steps with mirrored submanifold pair lists (the default) against full ones, A/B in one process.

`python -m benchmarks.probes.mirrored_probe [networks.py arguments]` runs the networks benchmark twice: as
shipped, then with submanifold maps' pair lists built full (PairLists for all V offsets, read from the plan as
`ConvMaps.pair_lists` reads them). Prints both tables.
"""
import sys

from benchmarks import networks
from pallas_kernels import gemm_plan


def main(argv):
  print("== mirrored pair lists (default)", flush=True)
  networks.main(argv + ["--out", "/tmp/mirrored_a"])
  full = gemm_plan.pair_lists_from_plan
  gemm_plan.pair_lists_from_plan = lambda plan, mirrored=False, **kw: full(plan, False, **kw)  # probe only: full lists
  print("== full pair lists", flush=True)
  networks.main(argv + ["--out", "/tmp/mirrored_b"])


if __name__ == "__main__":
  main(sys.argv[1:])
