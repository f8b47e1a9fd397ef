"""The k-th smallest non-negative int32 key of an array, found only when a count says it is needed (Pallas -> Triton).

Arrays in, arrays out. A strided convolution's site search keeps the `out_capacity` smallest of its distinct output
keys; it needs the cut-off key only when they overflow. A ``lax.cond`` on the count would make XLA copy the
predicate to the host and wait for the GPU at every strided convolution, so the test and the search run on the
device: one program whose search loop runs zero passes in the normal case.

Search: a 16-way radix-style narrowing of [lo, hi] (4 bits of the key range per pass, at most 8 passes over the
keys); each pass counts, block by block, the keys at or below 15 thresholds. One program reads the whole array per
pass: slow for a table of millions of slots, and only ever run on overflow.
"""
from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.out_struct import out_struct, same_vma

WAYS = 16  # thresholds per pass (the last one is hi itself)
NO_CUT = int(jnp.iinfo(jnp.int32).max)  # the result when nothing needs cutting: every key is kept


def _count_at_or_below(keys_ref, thresholds, *, size: int, block: int):
  """int32 [WAYS]: how many non-negative keys of keys_ref [size] are <= each threshold."""

  def count_block(b, counts):
    keys = keys_ref[pl.ds(pl.multiple_of(b * block, block), block)]
    below = (keys[:, None] >= 0) & (keys[:, None] <= thresholds[None, :])
    return counts + jnp.sum(below.astype(jnp.int32), axis=0, dtype=jnp.int32)

  return lax.fori_loop(jnp.int32(0), jnp.int32(size // block), count_block, jnp.zeros((WAYS,), jnp.int32))


def _kth_smallest_kernel(count_ref, keys_ref, out_ref, *, k: int, limit: int, size: int, block: int):
  ways = jnp.arange(WAYS, dtype=jnp.int32)

  def narrow(bounds):
    lo, hi = bounds
    step = (hi - lo) // WAYS + 1  # 15 * step cannot pass 2**31
    thresholds = jnp.where(ways < WAYS - 1, lo + jnp.minimum((ways + 1) * step - 1, hi - lo), hi)
    enough = _count_at_or_below(keys_ref, thresholds, size=size, block=block) >= k
    # Counts grow with the threshold; the last has enough.
    first = WAYS - jnp.sum(enough.astype(jnp.int32), dtype=jnp.int32)
    new_hi = jnp.sum(jnp.where(ways == first, thresholds, 0), dtype=jnp.int32)
    below = jnp.sum(jnp.where(ways == first - 1, thresholds, 0), dtype=jnp.int32)
    return jnp.where(first > 0, below + 1, lo), new_hi

  overflowing = count_ref[0] > limit
  lo, _ = lax.while_loop(lambda b: overflowing & (b[0] < b[1]), narrow, (jnp.int32(0), jnp.int32(NO_CUT)))
  out_ref[0] = jnp.where(overflowing, lo, NO_CUT)


def kth_smallest_if_over(keys, count, *, k: int, limit: int, interpret: bool = False, block: int = 1024,
                         num_warps: int = 4):
  """int32 scalar: the k-th smallest (1-based) non-negative key of ``keys`` if ``count > limit``, else int32 max.

  Args:
    keys: int32 [T], T a multiple of ``block`` (or smaller than it); negative entries are empty. Non-negative
      keys must be distinct and, when ``count > limit``, number at least k.
    count: int32 scalar, compared with ``limit`` on the device.
    k, limit: static ints, k >= 1.
    interpret: run in Pallas interpret mode (CPU). block / num_warps: keys per step and Triton warps.
  """
  size = int(keys.shape[0])
  if k < 1:
    raise ValueError(f"k must be >= 1, got {k}")
  if block < 1 or block & (block - 1):
    raise ValueError(f"block must be a power of two, got {block}")
  block = min(block, size)
  if size % block:
    raise ValueError(f"keys ({size}) must be a multiple of block ({block})")
  keys = jnp.asarray(keys, jnp.int32)
  count = jnp.reshape(jnp.asarray(count, jnp.int32), (1,))
  out = pl.pallas_call(
      functools.partial(_kth_smallest_kernel, k=int(k), limit=int(limit), size=size, block=block),
      out_shape=out_struct((1,), jnp.int32, keys, count),
      grid=(1,),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="unique_kth_smallest",
  )(*same_vma(count, keys))
  return out[0]
