"""Launch shape of the per-channel column reductions (pallas_kernels/channel_moments.py), and its defaults."""
from __future__ import annotations

import dataclasses

from pallas_kernels.tiling import clamp_pow2, gpu_num_sms

# Float32 values per accumulator and program: 4096 over 4 warps is 32 registers a thread for each of the two.
ACCUMULATOR_VALUES = 4096
# Widest channel block: the networks benchmarked have C 16-256 (one block each); wider arrays get more blocks.
MAX_BLOCK_CHANNELS = 256
# Row blocks a piece should walk at least, so a program's fixed cost (loads of shift / mean, the final
# reduction and store) stays small beside its streaming.
MIN_BLOCKS_PER_PIECE = 4
# Programs are equally long, so the last wave idles part of the GPU: many short ones keep that share small
# whatever number of programs fits on an SM at once.
PROGRAMS_PER_SM = 16


@dataclasses.dataclass(frozen=True)
class MomentsConfig:
  """One launch of a column reduction over a [rows, C] array.

  block_rows x block_c: the tile a program loads per step (powers of two; C is padded to block_c with masks).
  pieces: programs along the rows; each walks an equal share of the valid rows and writes one float32 partial
    sum per channel, and the [pieces, C] partials are added afterwards (no atomics).
  """

  block_rows: int = 32
  block_c: int = 128
  pieces: int = 256
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    for name in ("block_rows", "block_c"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1 or v & (v - 1):
        raise ValueError(f"MomentsConfig.{name} must be a power of two >= 1, got {v!r}")
    for name in ("pieces", "num_warps", "num_stages"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"MomentsConfig.{name} must be a positive int, got {v!r}")


def default_config(num_rows: int, channels: int, dtype=None) -> MomentsConfig:
  """All channels in one block up to 256 (C padded to a power of two), rows to fill 4096 accumulator values, and
  about 16 programs per SM over the rows (fewer where a piece would walk under 4 row blocks)."""
  del dtype  # the same tile for every dtype: the accumulators are float32 either way
  block_c = clamp_pow2(max(channels, 1), 1, MAX_BLOCK_CHANNELS)
  block_rows = max(1, ACCUMULATOR_VALUES // block_c)
  channel_blocks = -(-max(channels, 1) // block_c)
  want = max(1, PROGRAMS_PER_SM * gpu_num_sms() // channel_blocks)
  fits = max(1, -(-num_rows // (MIN_BLOCKS_PER_PIECE * block_rows)))
  return MomentsConfig(block_rows=block_rows, block_c=block_c, pieces=min(want, fits))


def candidates(num_rows: int, channels: int, dtype=None) -> list[MomentsConfig]:
  """Launch shapes a sweep times beside the default: half and twice the rows per tile, 8 warps (with the same
  and with twice the rows), and a quarter, half and twice the pieces."""
  base = default_config(num_rows, channels, dtype)
  out = [base]
  for change in (dict(block_rows=max(1, base.block_rows // 2)), dict(block_rows=base.block_rows * 2),
                 dict(num_warps=8), dict(num_warps=8, block_rows=base.block_rows * 2),
                 dict(pieces=max(1, base.pieces // 4)), dict(pieces=max(1, base.pieces // 2)),
                 dict(pieces=base.pieces * 2)):
    cfg = dataclasses.replace(base, **change)
    if cfg not in out:
      out.append(cfg)
  return out
