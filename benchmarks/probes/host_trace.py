"""Probe: wall time against GPU kernel time of one network call, with the trace kept for a look at the host.

A network small enough to be host-bound shows its dispatch overhead here and nowhere in the kernel profile:

  python -m benchmarks.probes.host_trace OUT_DIR --network second --size small --dtype fp16

writes OUT_DIR/trace.json.gz (perfetto), OUT_DIR/hlo.txt (the compiled program) and OUT_DIR/wall.json (per-call ms),
and prints the median wall time. Run it once per source tree (PYTHONPATH) for an A/B.
"""
import argparse
import glob
import json
import os
import shutil
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import networks


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("out")
  ap.add_argument("--network", default="second")
  ap.add_argument("--size", default="small")
  ap.add_argument("--dtype", default="fp16")
  ap.add_argument("--calls", type=int, default=60)
  args = ap.parse_args()
  os.makedirs(args.out, exist_ok=True)
  w = networks.workload(args.network, args.size)
  inp = networks.make_inputs(w)
  params = networks.Params(0)
  dtype, precision = networks.DTYPES[args.dtype]
  net = networks.NETWORKS[args.network]
  caps = networks.plan_capacities(net, inp, params, dtype, None, precision)
  p = {k: jnp.asarray(v) for k, v in params.arrays.items()}
  x = networks.jax_input(inp, dtype)
  inference, _ = networks.jax_functions(net, inp, caps, dtype, None, precision)
  compiled = jax.jit(inference).lower(p, x).compile()
  with open(os.path.join(args.out, "hlo.txt"), "w") as f:
    f.write(compiled.as_text())
  times = []
  for _ in range(args.calls):
    t0 = time.perf_counter()
    jax.block_until_ready(compiled(p, x))
    times.append(time.perf_counter() - t0)
  trace_dir = tempfile.mkdtemp()
  jax.profiler.start_trace(trace_dir, create_perfetto_trace=True)
  for _ in range(5):
    out = compiled(p, x)
  jax.block_until_ready(out)
  jax.profiler.stop_trace()
  for path in glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True):
    shutil.copy(path, os.path.join(args.out, "trace.json.gz"))
  with open(os.path.join(args.out, "wall.json"), "w") as f:
    json.dump({"ms": [t * 1e3 for t in times]}, f)
  print(args.out, "median ms", np.median(times[10:]) * 1e3)


if __name__ == "__main__":
  main()
