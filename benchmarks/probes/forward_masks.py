"""Which forward fusions of a compiled training step keep a 2-D mask for the backward, and what they compute.

    python -m benchmarks.probes.forward_masks --network minkunet --size large --dtype fp16 [--dump FILE.txt.gz]

Builds the step as benchmarks/networks.py does, compiles it without running it and, for every fusion that
`networks.forward_masks` flags, prints its output shape, its op_name metadata, the instructions that read it
and the fused computation's body, so that the op XLA moved into the forward can be named. `--dump` keeps the
whole optimised HLO. Runs anywhere; XLA's fusion choices, and so the answer, depend on the backend and sizes.
"""
from __future__ import annotations

import argparse
import gzip
import re

import jax
import jax.numpy as jnp

from benchmarks import networks


def describe(hlo_text: str, fusion: str, max_lines: int) -> str:
  line = re.search(rf"^\s*(?:ROOT )?%{re.escape(fusion)} = .*$", hlo_text, re.M).group(0).strip()
  called = re.search(r"calls=%([\w.\-]+)", line)
  users = [u.strip()[:200] for u in re.findall(rf"^.*%{re.escape(fusion)}\b[,)].*$", hlo_text, re.M)
           if not u.strip().startswith(f"%{fusion} =")]
  body = (networks.hlo_computation(hlo_text, called.group(1)) or "").splitlines() if called else []
  out = [f"== {fusion}", f"  {line[:600]}", f"  read by {len(users)}:"] + [f"    {u}" for u in users[:8]]
  out += [f"  body ({len(body)} lines):"] + [f"    {b.strip()[:300]}" for b in body[:max_lines]]
  return "\n".join(out)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--network", default="minkunet")
  ap.add_argument("--size", default="large")
  ap.add_argument("--dtype", default="fp16", choices=["fp16", "tf32"])
  ap.add_argument("--max-lines", type=int, default=40)
  ap.add_argument("--dump", default=None, metavar="FILE.txt.gz")
  args = ap.parse_args(argv)
  dtype = {"fp16": jnp.float16, "tf32": jnp.float32}[args.dtype]
  hlo = networks.train_step_hlo(args.network, args.size, dtype)
  if args.dump:
    with gzip.open(args.dump, "wt") as f:
      f.write(hlo)
  found = networks.forward_masks(hlo)
  print(f"{args.network} {args.size} {args.dtype} on {jax.devices()[0].device_kind}: {len(found)} forward masks")
  for name in found:
    print(describe(hlo, name, args.max_lines))


if __name__ == "__main__":
  main()
