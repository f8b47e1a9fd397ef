"""Probe: every candidate config of one submanifold layer's passes, timed on a sphere shell (what the tuner sees).

    python -m benchmarks.probes.tune_layer --res 512 --channels 32 --dtype tf32 [--passes forward,input_grad]
                                           [--extra-tiles 128,128,64,8,3;128,256,32,8,4,0;64,128,32,4,5,1,22,0]

Prints each candidate's time and the best per pass; used to find where `pass_config.heuristic` is far from the
best config (e.g. a tile shape that is slow for one dtype only).
"""
from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from benchmarks.workloads import sphere_shell_coords
from jsparse.autotuning import tune_call
from jsparse.map_gemm import recording
from pallas_kernels.tiling import TileConfig


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--res", type=int, default=512)
  ap.add_argument("--channels", type=int, default=32)
  ap.add_argument("--dtype", default="tf32", choices=("fp16", "bf16", "tf32"))
  ap.add_argument("--passes", default="forward,input_grad,weight_grad")
  ap.add_argument("--weight-layout", default="ODHWI")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--extra-tiles", default="", metavar="M,N,K,WARPS,STAGES[,COLUMNS_FASTEST[,SPLIT[,SWAP]]][;...]",
                  help="tile shapes to time beside the candidates (forward and input gradient, masked); a sixth "
                       "field 0 launches row blocks fastest (default 1: a row block's columns side by side), a "
                       "seventh splits the reduction (default 1: no split), an eighth swaps the operands (1), "
                       "keeps them (0) or leaves it to the rule (-1, the default)")
  args = ap.parse_args(argv)
  extra = [extra_tile(t) for t in args.extra_tiles.split(";") if t]
  dtype = {"fp16": jnp.float16, "bf16": jnp.bfloat16, "tf32": jnp.float32}[args.dtype]
  coords = sphere_shell_coords(args.res, 1)
  c = args.channels
  feats = jnp.asarray(np.random.default_rng(0).standard_normal((len(coords), c)), dtype)
  x = jsparse.SparseTensor.from_coords(coords, feats, (args.res,) * 3, 1)
  w = jnp.zeros((c, 3, 3, 3, c) if args.weight_layout == "ODHWI" else (3, 3, 3, c, c), dtype)
  calls = []
  with recording(calls), jax.disable_jit():
    jax.block_until_ready(jsparse.submconv3d(x, w, weight_layout=args.weight_layout).feats)
  print(f"RES {args.res} C {c} {args.dtype}: {len(coords)} sites", flush=True)
  best = tune_call(calls[0], tuple(args.passes.split(",")), repeats=args.repeats, log=lambda s: print(s, flush=True),
                   extra_tiles=extra)
  for key, cfg in best.items():
    print("BEST", key, cfg)


def extra_tile(text: str) -> TileConfig:
  """TileConfig of "M,N,K,WARPS,STAGES[,COLUMNS_FASTEST[,SPLIT[,SWAP]]]"."""
  fields = [int(f) for f in text.split(",")]
  if len(fields) not in (5, 6, 7, 8):
    raise ValueError(f"--extra-tiles: want M,N,K,WARPS,STAGES[,COLUMNS_FASTEST[,SPLIT[,SWAP]]], got {text!r}")
  columns_fastest = bool(fields[5]) if len(fields) > 5 else True
  split = fields[6] if len(fields) > 6 else 1
  swap = None if len(fields) < 8 or fields[7] < 0 else bool(fields[7])
  return TileConfig(*fields[:5], split=split, columns_fastest=columns_fastest, swap_operands=swap)


if __name__ == "__main__":
  main()
