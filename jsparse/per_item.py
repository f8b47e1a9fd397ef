"""Reductions per batch item of a SparseTensor's rows, and their broadcast back to the rows.

Sums are products with a one-hot [capacity, batch_size] matrix rather than `jax.ops.segment_sum`, and no
gradient here is the automatic one of `table[item]`: on a GPU both lower to scatter-adds whose hundreds of
thousands of rows all add into batch_size x C slots, and the atomics on so few addresses serialise (group norm
went from seconds to about a millisecond: docs/perf_notes.md, found with benchmarks/probes/profile_layers.py).
The products are exact sums of float32 values
(precision HIGHEST; the one-hot entries are 0 or 1) and deterministic. The broadcast back (`per_row`) is a
gather from the small [batch_size, ...] table, which is cheap; the two have custom gradients that are each
other (a sum's gradient is a broadcast and vice versa), so no scatter-add appears in the backward pass.

Batch items stay independent when values are not finite, as in a dense GroupNorm. A plain product would
multiply an inf of item 1 by item 0's one-hot zero, and 0 * inf = NaN would reach item 0 (padding rows, whose
one-hot rows are all zero, would poison every item the same way). So the product runs over the values with
their non-finite entries zeroed, next to one flag column in the same product (the one-hot is read once) whose
per-chunk sums count each item's "+inf or NaN" and "-inf or NaN" entries (see _sum_rows); adding +inf, -inf or
NaN back where the counts say so gives what a sum over the item's own rows gives. The product's operand is thus
twice the values' width. The gradients keep the items apart the same way (a non-finite cotangent of item 1
does not reach item 0's rows).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from jsparse.sparse_tensor import SparseTensor


def item_one_hot(x: SparseTensor) -> jax.Array:
  """float32 [capacity, batch_size]: row i's batch item as a one-hot row; all zeros for padding rows."""
  item = jnp.where(x.valid_mask(), x.coords[:, 0], -1)
  return jax.nn.one_hot(item, x.batch_size, dtype=jnp.float32)  # index -1: a zero row


def valid_rows(one_hot: jax.Array) -> jax.Array:
  """bool [capacity]: the valid rows of a one-hot from item_one_hot (a padding row's one-hot row is zero)."""
  return jnp.sum(one_hot, axis=1) > 0


# Rows per chunk in the first stage of the per-item sums (see _sum_rows).
SUM_CHUNK_ROWS = 512
# Weight of a "-inf or NaN" entry in the flag column ("+inf or NaN" weighs 1): a chunk's flag sum
# n_up + FLAG_DOWN * n_down is exact in float32 and decodes uniquely while a chunk has fewer than FLAG_DOWN rows,
# and a NaN's flag (FLAG_DOWN + 1) stays exact even where a product rounds its operands to TF32 (11 bits).
FLAG_DOWN = 1024.0


def _in_chunks(a: jax.Array, rows: int) -> jax.Array:
  """[capacity, ...] as [chunks, rows, ...], zero rows appended to fill the last chunk."""
  pad = -a.shape[0] % rows
  if pad:
    a = jnp.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1))
  return a.reshape((a.shape[0] // rows, rows) + a.shape[1:])


def _sum_rows(one_hot: jax.Array, values: jax.Array) -> jax.Array:
  """[batch_size, ...]: per item, the float32 sum of its rows of values; a non-finite value reaches only its
  own item's sum (see the module docstring).

  Two stages: per chunk of SUM_CHUNK_ROWS rows, then over the chunks. As one product over all rows XLA
  reduces hundreds of thousands of rows into batch_size x (a few dozen) outputs with little parallelism:
  42-89 GB/s on an H200, most of group norm's time in the generative decoder (docs/perf_notes.md).
  """
  cap, tail, batch_size = values.shape[0], values.shape[1:], one_hot.shape[1]
  width = math.prod(tail)
  flat = values.reshape(cap, width)  # not -1: a capacity of 0 leaves it undetermined
  nan = jnp.isnan(flat)
  flags = ((flat == jnp.inf) | nan).astype(jnp.float32) + FLAG_DOWN * ((flat == -jnp.inf) | nan).astype(jnp.float32)
  # One product over [finite values | flags]: the one-hot is read once.
  operand = jnp.concatenate([jnp.where(jnp.isfinite(flat), flat, 0), flags], axis=1)
  rows = max(1, min(SUM_CHUNK_ROWS, cap))
  partial = jnp.einsum("krb,krx->kbx", _in_chunks(one_hot, rows), _in_chunks(operand, rows),
                       precision=lax.Precision.HIGHEST)
  # The barrier keeps the two stages apart whatever XLA's simplifier does with a reduce of a reduce (a safeguard;
  # the variant without it was not measured).
  partial = lax.optimization_barrier(partial)
  finite = jnp.sum(partial[..., :width], axis=0)
  flag_sums = partial[..., width:]  # per chunk: the counts decode exactly there, not after summing the chunks
  down = jnp.any(flag_sums >= FLAG_DOWN, axis=0)
  up = jnp.any(jnp.mod(flag_sums, FLAG_DOWN) > 0, axis=0)
  non_finite = jnp.where(up & down, jnp.nan, jnp.where(up, jnp.inf, jnp.where(down, -jnp.inf, 0.0)))
  return (finite + non_finite).reshape((batch_size,) + tail)


# Bits of the low word of a row's item in _gather_rows (int32 batch indices leave 19 for the high word).
_ITEM_BITS = 12


def _gather_rows(one_hot: jax.Array, table: jax.Array) -> jax.Array:
  """[capacity, ...]: each row's entry of table, zeros for padding rows; a gather from the small table (only
  its gradient would scatter-add, and the custom gradient below is a one-hot product instead)."""
  batch_size = one_hot.shape[1]
  # The row's item as two words (item >> 12 and its low 12 bits) and a third that is 1 for valid rows, 0 for padding
  # rows (a one-hot row of zeros): each below 2**24, so exact in the float32 product. The item itself is not exact
  # there past 2**24 (a batch_size above 2**24): it rounded to another item's, or past the table, whose fill gave NaN.
  items = jnp.arange(batch_size, dtype=jnp.int32)
  words = jnp.stack([items >> _ITEM_BITS, items & (2**_ITEM_BITS - 1), jnp.ones_like(items)], axis=1)
  high, low, valid = jnp.dot(one_hot, words.astype(jnp.float32), precision=lax.Precision.HIGHEST).astype(jnp.int32).T
  rows = jnp.take(table, (high << _ITEM_BITS) | low, axis=0)  # item 0 for padding rows, zeroed below
  return jnp.where((valid > 0).reshape((-1,) + (1,) * (table.ndim - 1)), rows, 0)


@jax.custom_vjp
def _sum_per_item(one_hot: jax.Array, values: jax.Array) -> jax.Array:
  return _sum_rows(one_hot, values)


@jax.custom_vjp
def _per_row(one_hot: jax.Array, table: jax.Array) -> jax.Array:
  return _gather_rows(one_hot, table)


def _sum_per_item_fwd(one_hot, values):
  return _sum_per_item(one_hot, values), one_hot


def _sum_per_item_bwd(one_hot, g):
  return jnp.zeros_like(one_hot), _per_row(one_hot, g)  # the coordinates' one-hot takes no gradient


def _per_row_fwd(one_hot, table):
  return _per_row(one_hot, table), one_hot


def _per_row_bwd(one_hot, g):
  return jnp.zeros_like(one_hot), _sum_per_item(one_hot, g)


_sum_per_item.defvjp(_sum_per_item_fwd, _sum_per_item_bwd)
_per_row.defvjp(_per_row_fwd, _per_row_bwd)


def sum_per_item(one_hot: jax.Array, values: jax.Array) -> jax.Array:
  """[batch_size, ...]: the sum of values [capacity, ...] over each item's rows (float32).

  A non-finite value affects only its own item's sum (padding rows none): items stay independent.
  """
  return _sum_per_item(one_hot, values.astype(jnp.float32))


def per_row(one_hot: jax.Array, table: jax.Array) -> jax.Array:
  """[capacity, ...]: each row's entry of table [batch_size, ...] (zeros for padding rows).

  A non-finite table entry reaches only its own item's rows.
  """
  return _per_row(one_hot, table.astype(jnp.float32))


def count_per_item(one_hot: jax.Array) -> jax.Array:
  """float32 [batch_size]: the number of valid rows of each item (two stages, as in _sum_rows)."""
  rows = max(1, min(SUM_CHUNK_ROWS, one_hot.shape[0]))
  return jnp.sum(lax.optimization_barrier(jnp.sum(_in_chunks(one_hot, rows), axis=1)), axis=0)
