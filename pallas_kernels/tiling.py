"""Tile configurations shared by the GEMM kernels, and the precision argument they take."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl


MAX_WARPS = 32  # 1024 threads, a CUDA block's limit


@dataclasses.dataclass(frozen=True)
class TileConfig:
  """Block sizes and launch parameters of one GEMM kernel launch.

  block_m: output rows per program; block_n: output columns per program; block_k: reduction chunk.
  split: how many programs share the reduction (partial sums are added afterwards); 1 = no split.
  columns_fastest (gather-GEMM only): launch the column blocks of a row block next to each other, so they
    read its gathered rows while those are still in L2 (else every column block re-gathers them from DRAM).
  weight_k_major (gather-GEMM pass whose weight is stored N-contiguous): read it through a K-contiguous copy
    (True), straight (False), or as `gather_gemm_config.reads_weight_k_major` decides (None).
  swap_operands (gather-GEMM only): accumulate the transposed product W^T x^T, True / False, or as
    `gather_gemm_config.swaps_operands` decides (None).
  balanced (weight gradient only, needs pair lists): cut all offsets' pairs together into about V * split
    equal chunks, one program per chunk, so offsets get programs in proportion to their pairs.
  """

  block_m: int = 64
  block_n: int = 64
  block_k: int = 32
  num_warps: int = 4
  num_stages: int = 2
  split: int = 1
  columns_fastest: bool = False
  balanced: bool = False
  weight_k_major: bool | None = None
  swap_operands: bool | None = None

  def __post_init__(self):
    for name in ("block_m", "block_n", "block_k"):
      v = getattr(self, name)
      if v < 16 or v & (v - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {v}")
    if self.split < 1:
      raise ValueError(f"split must be >= 1, got {self.split}")
    # Triton aborts the process on other warp counts (3: an LLVM fatal error; 64: an invalid CUDA launch).
    if self.num_warps < 1 or self.num_warps > MAX_WARPS or self.num_warps & (self.num_warps - 1):
      raise ValueError(f"num_warps must be a power of two in [1, {MAX_WARPS}], got {self.num_warps}")


def next_pow2(n: int) -> int:
  return 1 << max(int(n) - 1, 0).bit_length()


def clamp_pow2(n: int, lo: int, hi: int) -> int:
  return max(lo, min(hi, next_pow2(n)))


# Values of JAX's own setting (`jax.default_matmul_precision`, its flag or its context manager) that ask for more
# than the kernels' default; every other value (None, "default", "bfloat16", the one-pass presets) is TF32. The
# multi-pass presets map to the precision of the same accuracy (JAX's own "bfloat16_3x" is HIGH; six or nine
# bfloat16 passes or three TF32 passes are float32-accurate): read as TF32 they silently lost digits asked for.
_FROM_JAX_DEFAULT = {"highest": lax.Precision.HIGHEST, "float32": lax.Precision.HIGHEST,
                     "F32_F32_F32": lax.Precision.HIGHEST, "F64_F64_F64": lax.Precision.HIGHEST,
                     "BF16_BF16_F32_X6": lax.Precision.HIGHEST, "BF16_BF16_F32_X9": lax.Precision.HIGHEST,
                     "TF32_TF32_F32_X3": lax.Precision.HIGHEST,
                     "high": lax.Precision.HIGH, "tensorfloat32": lax.Precision.HIGH,
                     "BF16_BF16_F32_X3": lax.Precision.HIGH}


def dot_precision(precision, dtype) -> lax.Precision:
  """The `jnp.dot` precision for the kernels' matmuls.

  For float32 inputs DEFAULT lowers to TF32 on the GPU and HIGHEST to full-precision fp32; half-precision
  inputs ignore it. Accepts None, a lax.Precision, or "tf32" / "default" / "highest" / "float32". None follows
  JAX's `jax.default_matmul_precision` where it is set ("highest" / "float32" and the float32-accurate
  multi-pass presets give full fp32), as `jnp.dot` does; unset, it is DEFAULT. Read at trace time, like JAX's
  own setting, which is part of jit's cache key.
  """
  if precision is None:
    return _FROM_JAX_DEFAULT.get(jax.config.jax_default_matmul_precision, lax.Precision.DEFAULT)
  if isinstance(precision, str):
    table = {"default": lax.Precision.DEFAULT, "tf32": lax.Precision.DEFAULT, "high": lax.Precision.HIGH,
             "highest": lax.Precision.HIGHEST, "float32": lax.Precision.HIGHEST, "fp32": lax.Precision.HIGHEST}
    if precision.lower() not in table:
      raise ValueError(f"unknown precision {precision!r}; use one of {sorted(table)} or a lax.Precision")
    return table[precision.lower()]
  if isinstance(precision, tuple):
    precision = precision[0]
  if isinstance(precision, (lax.Precision, lax.DotAlgorithmPreset)):
    return precision
  raise TypeError(f"precision must be None, a string or a lax.Precision, got {precision!r}")


def is_half(dtype) -> bool:
  return jnp.dtype(dtype) in (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def gpu_num_sms(default: int = 132) -> int:
  """Streaming multiprocessors on the default GPU (132 on an H100/H200 SXM), for split heuristics."""
  try:
    dev = jax.devices()[0]
    return int(getattr(dev, "core_count", default) or default)
  except Exception:  # no device info: fall back to the H100/H200 count
    return default


def int32_cdiv(a, b):
  """ceil(a / b) for a >= 0, b > 0, either an int or an int32 value inside a kernel: two ints give an int, else an
  int32 whether or not jax_enable_x64 is on (pl.cdiv of a traced int32 and an int fails under x64, since lax.div
  then sees the int as int64)."""
  if isinstance(a, int) and isinstance(b, int):
    return -(-a // b)
  if isinstance(b, int):
    return lax.div(jnp.asarray(a, jnp.int32) + jnp.int32(b - 1), jnp.int32(b))
  a, b = jnp.asarray(a, jnp.int32), jnp.asarray(b, jnp.int32)
  return lax.div(a + (b - 1), b)


def split_share(total, split: int, axis: int = 2):
  """Inside a kernel: [start, stop) of the `total` reduction steps this program takes when `split` programs along
  grid axis `axis` share them in equal runs (all of them when split is 1)."""
  if split == 1:
    return 0, total
  per = int32_cdiv(total, split)
  start = pl.program_id(axis) * per
  return start, jnp.minimum(start + per, total)
