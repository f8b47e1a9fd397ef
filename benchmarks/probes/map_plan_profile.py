"""Probe: where the neighbour map + forward plan's time goes, kernel by kernel (FlexGEMM item 5's comparison).

    python -m benchmarks.probes.map_plan_profile --res 256,512 [--calls 20] [--top 25]

For each RES it builds the sphere shell of `benchmarks.kernels --sections neighbor_map`, compiles what that
section times as "map + forward plan" (the neighbour map and the forward's masked plan, as FlexGEMM's cache
holds), traces `--calls` calls and prints ms per call of the top kernels with their HLO op names.
"""
import argparse
import tempfile

import jax
import numpy as np

import jsparse
from benchmarks import kernels, networks, workloads


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--res", default="256,512")
  ap.add_argument("--calls", type=int, default=20)
  ap.add_argument("--top", type=int, default=25)
  args = ap.parse_args(argv)
  for res in [int(r) for r in args.res.split(",")]:
    coords = workloads.sphere_shell_coords(res)
    x = kernels.sparse_tensor(res, coords, np.zeros((len(coords), 1), np.float32))

    def map_and_forward_plan(t):
      cache = jsparse.neighbor_map(t, 3, 1)
      return cache.nbr, cache.plans

    compiled = jax.jit(map_and_forward_plan).lower(x).compile()
    prof = networks.profile_jax(compiled, (x,), args.calls, tempfile.mkdtemp())
    total = sum(prof["ms"].values())
    print(f"== RES {res}: {len(coords):,} sites, {prof['kernels']} kernels, {total:.4f} ms of kernels per call, "
          f"{prof['span_ms']:.4f} ms from first kernel start to last kernel end")
    for name, ms in list(prof["top_kernels"].items())[:args.top]:
      print(f"  {ms:8.4f}  {name}")


if __name__ == "__main__":
  main()
