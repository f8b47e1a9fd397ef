"""Tiles of the gather-GEMM (forward and input gradient): the default, the tuner's candidates, the weight-read rules.

The measurements behind these numbers are in docs/perf_notes.md ("gather-GEMM defaults and candidates").
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.gemm_plan import default_block_m
from pallas_kernels.tiling import TileConfig, clamp_pow2, gpu_num_sms, is_half, next_pow2
from pallas_kernels.weight_layout import WeightLayout


def default_config(num_rows: int, k: int, n: int, dtype) -> TileConfig:
  """Tiles used without a tuned config: 5 stages, a row block's column blocks launched side by side, and
  the block shape that ran fastest per precision (half: 128x256x64 with 8 warps once N >= 256)."""
  half = is_half(dtype)
  block_m = default_block_m(num_rows)
  block_n = clamp_pow2(n, 16, 256 if half and block_m == 128 else 128)
  block_k = clamp_pow2(k, 16, 64 if half else 32)
  warps = 8 if half and block_m * block_n >= 128 * 128 else 4
  return TileConfig(block_m, block_n, block_k, num_warps=warps, num_stages=5, columns_fastest=True)


def default_split(num_rows: int, k: int, n: int, num_offsets: int, tiles: TileConfig, *, require: bool,
                  allow: bool) -> int:
  """Split-K factor: split the reduction when the output tiles alone leave the GPU idle (`allow`), at least 2
  when `require`d, else 1."""
  sms = gpu_num_sms()
  programs = -(-num_rows // tiles.block_m) * -(-n // tiles.block_n)
  steps = num_offsets * -(-k // tiles.block_k)
  if not (require or (allow and programs < sms)):
    return 1
  want = -(-2 * sms // max(programs, 1))
  return max(2 if require else 1, min(want, max(1, steps // 8), 16))


def stored_n_contiguous(forward: bool, weight_layout: WeightLayout) -> bool:
  """Whether a pass finds its weight tile N-contiguous in memory: the forward of a DHWIO weight, the input
  gradient of an ODHWI one."""
  return forward != WeightLayout.of(weight_layout).cout_major


def reads_weight_k_major(num_rows: int, config: TileConfig, dtype) -> bool:
  """Whether a pass whose weight is stored N-contiguous reads it through a K-contiguous copy
  (`config.weight_k_major`, or this rule): tensor cores want K-contiguous tiles, which Hopper's TF32 MMA
  cannot do without (float32 always copies), and half precision gains once enough row blocks re-read it."""
  if config.weight_k_major is not None:
    return config.weight_k_major
  return jnp.dtype(dtype) == jnp.float32 or -(-num_rows // config.block_m) >= 16


def swaps_operands(config: TileConfig, dtype, k_contiguous: bool) -> bool:
  """Whether the kernel accumulates the transposed product W^T x^T (`config.swap_operands`, or this rule):
  faster for float32 reading a K-contiguous weight in column tiles of 64 or more (the swapped product's row
  side), slower everywhere else (narrower tiles underfill the MMA's 64 rows: 2x slower at 32)."""
  if config.swap_operands is not None:
    return config.swap_operands
  return jnp.dtype(dtype) == jnp.float32 and k_contiguous and config.block_n >= 64


def candidates(num_rows: int, k: int, n: int, num_offsets: int, dtype, *, n_contiguous: bool) -> list[TileConfig]:
  """Tiles the tuner times for a masked pass: the default and a few ranked shapes, each with and without
  split-K; where the weight is stored N-contiguous (`n_contiguous`) also its straight read, and for float32
  the default shape also unswapped."""
  base = default_config(num_rows, k, n, dtype)
  n_cap, k_cap = max(16, next_pow2(n)), max(16, next_pow2(k))
  half = is_half(dtype)
  # (block_m, block_n, block_k, warps, stages, columns_fastest)
  if half:
    shapes = [(128, 256, 64, 8, 7, True), (128, 128, 64, 8, 5, True), (128, 128, 64, 4, 4, False),
              (64, 256, 64, 4, 7, True), (64, 128, 64, 4, 5, True)]
  else:
    shapes = [(128, 256, 32, 8, 5, True), (64, 256, 32, 4, 5, True), (128, 64, 32, 4, 5, True),
              (64, 128, 32, 4, 5, True)]
  few_rows = num_rows <= 4096
  if few_rows and not half:  # latency-bound reductions: deeper chunks halve the steps
    shapes += [(32, 128, 64, 4, 4, True), (64, 128, 64, 4, 3, True)]
    if n_contiguous:  # 32-row blocks reading the weight straight
      shapes += [(32, 256, 32, 8, 5, True), (32, 128, 32, 4, 5, True)]

  def weight_reads(block_m: int) -> tuple:
    if not n_contiguous:
      return (None,)
    if half:
      return (None, False) if reads_weight_k_major(num_rows, TileConfig(block_m), dtype) else (None,)
    return (None, False) if few_rows and block_m == 32 else (None,)

  out, seen = [], set()
  base_shape = (base.block_m, base.block_n, base.block_k, base.num_warps, base.num_stages, base.columns_fastest)
  sms = gpu_num_sms()
  for bm, bn, bk, warps, stages, cf in [base_shape] + shapes:
    bn, bk = min(bn, n_cap), min(bk, k_cap)
    programs = -(-num_rows // bm) * -(-n // bn)
    steps = num_offsets * -(-k // bk)
    splits = {1}
    if programs < sms:
      want = min(-(-2 * sms // programs), max(1, steps // 8), 16)
      splits |= {max(1, want // 2), want}
      if few_rows:  # very few output tiles: deeper splits spread the weight stream over every SM
        splits.add(max(1, min(2 * want, 32, steps // 8)))
    swaps = (None, False) if not half and (bm, bn, bk, warps, stages, cf) == base_shape else (None,)
    for split in sorted(splits):
      for k_major in weight_reads(bm):
        for swap in swaps:
          cfg = TileConfig(bm, bn, bk, warps, stages, split, columns_fastest=cf, weight_k_major=k_major,
                           swap_operands=swap)
          if cfg not in seen:
            seen.add(cfg)
            out.append(cfg)
  return out
