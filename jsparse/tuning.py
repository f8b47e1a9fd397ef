"""Per-pass algorithm and tile choices for the Pallas convolution.

Forward, input gradient and weight gradient are chosen independently (they have different shapes:
the input gradient swaps Cin and Cout, the weight gradient reduces over sites).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from pallas_kernels import gather_gemm, weight_grad
from pallas_kernels.tiling import TileConfig, gpu_num_sms

ALGORITHMS = ("explicit", "implicit", "implicit_splitk", "masked", "masked_splitk", "auto")
PASSES = ("forward", "input_grad", "weight_grad")


@dataclasses.dataclass(frozen=True)
class PassConfig:
  """How one pass runs: `algorithm` (one of ALGORITHMS but "auto") and its tiles (None for "explicit")."""

  algorithm: str
  tiles: TileConfig | None = None

  @property
  def masked(self) -> bool:
    return self.algorithm.startswith("masked")


def check_algorithm(algorithm: str) -> str:
  if algorithm not in ALGORITHMS:
    raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
  return algorithm


def _gemm_split(programs: int, steps: int, splitk: bool, auto: bool) -> int:
  """Split the reduction when the output tiles alone leave the GPU idle."""
  sms = gpu_num_sms()
  if not (splitk or (auto and programs < sms)):
    return 1
  want = -(-2 * sms // max(programs, 1))
  return max(2 if splitk else 1, min(want, max(1, steps // 8), 16))


def heuristic(pass_name: str, num_rows: int, cin: int, cout: int, num_offsets: int, dtype,
              algorithm: str = "auto") -> PassConfig:
  """A reasonable config without measurements."""
  check_algorithm(algorithm)
  if algorithm == "explicit":
    return PassConfig("explicit")
  auto = algorithm == "auto"
  splitk = algorithm.endswith("splitk")
  masked = algorithm.startswith("masked") or (auto and num_offsets > 1)
  if pass_name == "weight_grad":
    tiles = weight_grad.default_config(num_rows, cin, cout, num_offsets, dtype)
    name = ("masked" if masked else "implicit") + ("_splitk" if tiles.split > 1 else "")
    if not (splitk or auto):
      tiles = dataclasses.replace(tiles, split=1)
      name = "masked" if masked else "implicit"
    return PassConfig(name, tiles)
  k, n = (cin, cout) if pass_name == "forward" else (cout, cin)
  tiles = gather_gemm.default_config(num_rows, k, n, dtype)
  programs = -(-num_rows // tiles.block_m) * -(-n // tiles.block_n)
  steps = num_offsets * -(-k // tiles.block_k)
  split = _gemm_split(programs, steps, splitk, auto)
  tiles = dataclasses.replace(tiles, split=split)
  return PassConfig(("masked" if masked else "implicit") + ("_splitk" if split > 1 else ""), tiles)


def choose(pass_name: str, num_rows: int, cin: int, cout: int, num_offsets: int, dtype,
           algorithm: str = "auto") -> PassConfig:
  """The config for one pass: a tuned entry if one is active for this shape, else the heuristic."""
  if pass_name not in PASSES:
    raise ValueError(f"pass must be one of {PASSES}, got {pass_name!r}")
  return heuristic(pass_name, num_rows, cin, cout, num_offsets, jnp.dtype(dtype), algorithm)
