"""What the kernel probes (tf32_probe, triton_ir_probe) share: a log that prints and appends to a file, and
one submanifold layer on a sphere shell (random float32 features and weight, the neighbour map)."""
from __future__ import annotations

import os
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

import jsparse
from benchmarks.workloads import sphere_shell_coords


def open_log(out_dir: str, name: str) -> Callable[[str], None]:
  os.makedirs(out_dir, exist_ok=True)
  logf = open(os.path.join(out_dir, name), "a")

  def log(msg: str) -> None:
    print(msg, flush=True)
    logf.write(msg + "\n")
    logf.flush()

  return log


class ShellLayer(NamedTuple):
  x: jsparse.SparseTensor  # float32 features
  w32: jax.Array  # [27, C, C] float32
  cache: jsparse.NeighborCache
  flops: int  # useful FLOPs of one pass: 2 x pairs x C^2


def shell_layer(res: int, channels: int, seed: int = 0) -> ShellLayer:
  coords = sphere_shell_coords(res)
  rng = np.random.default_rng(seed)
  feats = jnp.asarray(rng.standard_normal((len(coords), channels)), jnp.float32)
  x = jsparse.SparseTensor.from_coords(coords, feats, (res,) * 3, capacity="exact")
  w32 = jnp.asarray(rng.standard_normal((27, channels, channels)) / np.sqrt(27 * channels), jnp.float32)
  cache = jsparse.neighbor_map(x, 3)
  return ShellLayer(x, w32, cache, 2 * int(cache.num_pairs()) * channels * channels)
