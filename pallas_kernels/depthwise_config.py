"""Tiles of the depthwise gather-multiply-accumulate (pallas_kernels/depthwise.py), and its config class.

`Depthwise` is the registry's "depthwise" algorithm (jsparse/pass_config.py): what `algorithm="auto"` runs for
feature groups narrower than a tensor-core tile (`suits`).
"""
from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from pallas_kernels.tiling import TileConfig, clamp_pow2, gpu_num_sms

# Below this many channels per group a tensor-core tile (K or N >= 16) would mostly multiply padding.
MIN_GEMM_GROUP_WIDTH = 16


def suits(cin: int, cout: int, groups: int) -> bool:
  """Whether a grouped convolution's groups are too narrow for the gather-GEMM (Cin/G or Cout/G < 16)."""
  return groups > 1 and min(cin // groups, cout // groups) < MIN_GEMM_GROUP_WIDTH


def _widths(pass_name: str, cin: int, cout: int, groups: int) -> tuple[int, int]:
  """(reduction channels per group R, output channels N) of a pass."""
  if pass_name == "input_grad":
    return cout // groups, cin
  return cin // groups, cout


def default_config(pass_name: str, num_rows: int, cin: int, cout: int, num_offsets: int, groups: int, dtype,
                   split: str = "auto") -> TileConfig:
  """Tiles used without a tuned config: up to 64 channels by 64 rows (more rows for fewer channels), so a
  program's float32 accumulator stays at 4096 values, 4 warps. split "none" (1), "auto" (the forward's offsets
  split where the row x channel blocks leave the GPU idle; the weight gradient's rows cut into about 8 programs
  per SM, at least 8 row blocks each) or "require" (at least 2)."""
  r, n = _widths(pass_name, cin, cout, groups)
  block_n = clamp_pow2(n, 16, 64)
  block_m = 4096 // block_n
  sms = gpu_num_sms()
  if pass_name == "weight_grad":  # programs per (offset, reduction channel, channel block); the rows are split
    block_m = 64
    programs = max(1, num_offsets * r * -(-n // block_n))
    want = min(-(-8 * sms // programs), max(1, num_rows // (8 * block_m)))
  else:
    programs = max(1, -(-num_rows // block_m) * -(-n // block_n))
    want = min(-(-2 * sms // programs), num_offsets) if programs < sms else 1
  factor = {"none": 1, "auto": max(1, want), "require": max(2, want)}[split]
  del dtype  # the same tiles for every dtype: the products are float32 either way
  return TileConfig(block_m, block_n, 16, num_warps=4, num_stages=2, split=factor)


def candidates(pass_name: str, num_rows: int, cin: int, cout: int, num_offsets: int, groups: int,
               dtype) -> list[TileConfig]:
  """Tiles the tuner times: the default, and channel blocks of 32 and 128 (rows to match), each at the default
  split and unsplit."""
  base = default_config(pass_name, num_rows, cin, cout, num_offsets, groups, dtype)
  out = []
  for block_n in (base.block_n, 32, 128):
    block_m = base.block_m if block_n == base.block_n else (64 if pass_name == "weight_grad" else 4096 // block_n)
    for split in sorted({1, base.split}):
      cfg = dataclasses.replace(base, block_m=block_m, block_n=block_n, split=split)
      if cfg not in out:
        out.append(cfg)
  return out


@dataclasses.dataclass(frozen=True)
class Depthwise:
  """The depthwise gather-multiply-accumulate for every pass (any feature groups; meant for narrow ones)."""

  tiles: TileConfig
  kind: ClassVar[str] = "depthwise"
  uses_plan: ClassVar[bool] = False

  def __post_init__(self):
    if not isinstance(self.tiles, TileConfig):
      raise TypeError(f"{type(self).__name__}.tiles must be a TileConfig, got {self.tiles!r}")

  @classmethod
  def default(cls, pass_name, num_rows, cin, cout, num_offsets, dtype, *, split: str = "none",
              groups: int = 1) -> "Depthwise":
    return cls(default_config(pass_name, num_rows, cin, cout, num_offsets, groups, jnp.dtype(dtype), split))

  @classmethod
  def candidates(cls, pass_name, num_rows, cin, cout, num_offsets, dtype, weight_layout, groups: int = 1) -> list:
    """Only for groups too narrow for the GEMMs (elsewhere it is never the fastest)."""
    if not suits(cin, cout, groups):
      return []
    return [cls(t) for t in candidates(pass_name, num_rows, cin, cout, num_offsets, groups, dtype)]

  def run(self, pass_name: str, p, o):
    """One pass (p: pass_config.PassInputs, o: pass_config.RunOptions) on the depthwise kernels."""
    from pallas_kernels import depthwise  # the kernel module imports this one for its defaults

    kw = dict(config=self.tiles, interpret=o.interpret, weight_layout=o.weight_layout, groups=o.groups)
    if pass_name == "forward":
      return depthwise.conv_forward(p.lhs, p.rhs, p.nbr, p.num, p.bias, **kw)
    if pass_name == "input_grad":
      return depthwise.conv_input_grad(p.lhs, p.rhs, p.nbr, p.num, flip_offsets=o.input_grad_flips, **kw)
    return depthwise.weight_grad(p.lhs, p.rhs, p.nbr, p.num, out_dtype=p.lhs.dtype, **kw)
