"""Tiles of the weight-gradient GEMM: the default and the tuner's candidates.

The measurements behind these numbers are in docs/perf_notes.md ("weight-gradient defaults and candidates").
"""
from __future__ import annotations

import jax.numpy as jnp

from pallas_kernels.tiling import TileConfig, clamp_pow2, gpu_num_sms, next_pow2


# Channels (per side) up to which the split aims at NARROW_PROGRAMS_PER_SM programs per SM rather than 8.
NARROW_CHANNELS = 64
NARROW_PROGRAMS_PER_SM = 16


def programs_per_sm(cin: int, cout: int) -> int:
  """Programs per SM the default split aims at: 16 for narrow layers, whose few (offset, tile) programs are each
  a long walk over the sites, else 8 (wider layers have more tiles, and their float32 partial sums grow with the
  split). Measurements: docs/perf_notes.md, "weight-gradient defaults and candidates"."""
  return NARROW_PROGRAMS_PER_SM if max(cin, cout) <= NARROW_CHANNELS else 8


def default_config(num_rows: int, cin: int, cout: int, num_offsets: int, dtype) -> TileConfig:
  """Tiles used without a tuned config: 128x128 (Cin x Cout) tiles, 4 warps, 5 stages and a split over sites
  that gives `programs_per_sm` programs per SM; float32 runs as bf16 hi/lo products, two tiles per operand, so
  half the reduction chunk."""
  block_m = clamp_pow2(cin, 16, 128)
  block_n = clamp_pow2(cout, 16, 128)
  block_k = 32 if jnp.dtype(dtype) == jnp.float32 else 64
  tiles = num_offsets * -(-cin // block_m) * -(-cout // block_n)
  want = max(1, -(-programs_per_sm(cin, cout) * gpu_num_sms() // tiles))
  split = max(1, min(want, num_rows // (8 * block_k)))  # at least ~8 row chunks per program
  return TileConfig(block_m, block_n, block_k, num_warps=4, num_stages=5, split=split)


def candidates(num_rows: int, cin: int, cout: int, num_offsets: int, dtype) -> list[TileConfig]:
  """Tiles the tuner times (every dtype takes the same tiles: float32 runs as bf16 products). Each shape
  that splits the sites also comes balanced (`TileConfig.balanced`) at the smaller split."""
  base = default_config(num_rows, cin, cout, num_offsets, dtype)
  out, seen = [], set()
  shapes = [(base.block_m, base.block_n, base.block_k, base.num_warps, base.num_stages),
            (128, 128, 64, 4, 4), (64, 128, 64, 4, 5), (128, 128, 32, 4, 5)]
  for bm, bn, bk, warps, stages in shapes:
    bm = min(bm, max(16, next_pow2(cin)))
    bn = min(bn, max(16, next_pow2(cout)))
    tiles = num_offsets * -(-cin // bm) * -(-cout // bn)
    want = max(1, min(-(-programs_per_sm(cin, cout) * gpu_num_sms() // tiles), max(1, num_rows // (8 * bk))))
    splits = sorted({want, 2 * want} if num_rows >= 64 * bk else {1})
    variants = [(split, False) for split in splits]
    if num_offsets > 1 and splits != [1]:
      variants.append((splits[0], True))
    for split, balanced in variants:
      cfg = TileConfig(bm, bn, bk, warps, stages, split, balanced=balanced)
      if cfg not in seen:
        seen.add(cfg)
        out.append(cfg)
  return out
