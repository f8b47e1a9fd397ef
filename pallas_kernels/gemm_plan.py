"""Work plans for the sparse GEMMs, built from a neighbour map (jit-friendly, static shapes).

- `masked_plan`: rows sorted by the Gray-code rank of their neighbour bitmask, so that a block of
  consecutive sorted rows uses few kernel offsets, and for each block the list of offsets at least one of
  its rows uses. The gather-GEMM then loops over those offsets only. Submanifold maps are symmetric
  (offset v of row i <-> offset V-1-v of its neighbour), so the input gradient, which reads the same map,
  reuses the same plan.
- `pair_lists`: for every offset, the rows that have a neighbour there, packed to the front. The weight
  gradient walks these instead of all rows.

Both also store the gathered row indices the kernels read (`MaskedPlan.block_rows`, `PairLists.sources`), so
that inside a kernel's loop every data load is one indirection away from the loop counter. Triton's software
pipeliner splits its stages over the chain of dependent loads (offset -> neighbour row -> features): with the
chain cut to one level the feature and weight tiles get twice the prefetch depth (docs/perf_notes.md).

The masked plan is an XLA sort followed by one Pallas kernel (`_block_plan_kernel`, a program per block): it
gathers the block's map rows, finds the offsets they use, and writes them used-first with their row indices
transposed to [offset, lane]. In XLA that step was a transpose, an any-reduction and a take_along_axis over the
whole [rows, V] map, together several times the plan's memory traffic (docs/perf_notes.md);
`masked_plan_reference` keeps that XLA form as the tests' reference.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.out_struct import out_struct, same_vma

# Bitmask keys are int32: sort by the first 31 offsets' bits when V is larger (the per-block offset lists
# stay exact; only the grouping is coarser).
_MASK_BITS = 31


class MaskedPlan(NamedTuple):
  order: jax.Array  # int32 [capacity]: rows in processing order (valid rows first)
  block_offsets: jax.Array  # int32 [num_blocks, V]: per block, the offsets used, then the unused ones
  block_counts: jax.Array  # int32 [num_blocks]: how many of block_offsets[b] are used
  # int32 [num_blocks, V, block_m]: block_rows[b, j, l] = nbr[order[b * block_m + l], block_offsets[b, j]]
  # (-1: no neighbour, or a lane past the valid rows)
  block_rows: jax.Array


class PairLists(NamedTuple):
  """The (row, source) pairs of every offset. Mirrored lists (`pair_lists(nbr, mirrored=True)`, for a
  submanifold map, which pairs (i, j) at offset v exactly when it pairs (j, i) at offset V-1-v) store the
  first (V+1)//2 offsets only: offset v > V//2 reads offset V-1-v's lists with rows and sources swapped.
  That halves the largest arrays a training step keeps per coordinate set."""

  rows: jax.Array  # int32 [L, capacity]: rows[v, :counts[v]] are the rows i with nbr[i, v] >= 0
  counts: jax.Array  # int32 [V]
  sources: jax.Array  # int32 [L, capacity]: sources[v, p] = nbr[rows[v, p], v] (-1 past counts[v])

  @property
  def mirrored(self) -> bool:
    return self.rows.shape[0] != self.counts.shape[0]


def default_block_m(num_rows: int) -> int:
  """Rows per block that the GEMMs use unless configured otherwise (plans are built for it)."""
  return 128 if num_rows >= 2048 else 64


def gray_rank(mask: jax.Array) -> jax.Array:
  """The n with gray(n) = n ^ (n >> 1) == mask: sorting by it walks masks in Gray-code order."""
  n = mask
  for shift in (1, 2, 4, 8, 16):
    n = n ^ jax.lax.shift_right_logical(n, jnp.asarray(shift, n.dtype))
  return n


def _row_order(nbr: jax.Array, num: jax.Array) -> jax.Array:
  """int32 [capacity]: the valid rows by the Gray-code rank of their neighbour bitmask, then the others."""
  cap, v = nbr.shape
  valid = jnp.arange(cap) < num
  has = (nbr >= 0) & valid[:, None]
  bits = min(v, _MASK_BITS)
  weights = jnp.left_shift(jnp.int32(1), jnp.arange(bits, dtype=jnp.int32))
  mask = jnp.sum(jnp.where(has[:, :bits], weights[None, :], 0), axis=1, dtype=jnp.int32)
  key = jnp.where(valid, gray_rank(mask), jnp.iinfo(jnp.int32).max)
  return jnp.argsort(key, stable=True).astype(jnp.int32)


# Warps of a block-plan program: its work is one [block_m, V] tile of loads and stores.
BLOCK_PLAN_WARPS = 4


def masked_plan(nbr: jax.Array, num: jax.Array, block_m: int, *, interpret: bool = False) -> MaskedPlan:
  """The MaskedPlan of map `nbr` (int32 [capacity, V]) with `num` (int32 [1]) valid rows, in blocks of block_m
  rows: the row order by XLA's sort, each block's offsets and rows by `_block_plan_kernel`."""
  cap, v = nbr.shape
  num = jnp.asarray(num, jnp.int32).reshape(1)
  order = _row_order(nbr, num)
  num_blocks = -(-cap // block_m)
  if cap == 0:  # no rows: nothing to trace a kernel over
    return MaskedPlan(order, jnp.zeros((0, v), jnp.int32), jnp.zeros((0,), jnp.int32),
                      jnp.zeros((0, v, block_m), jnp.int32))
  width = max(2, pl.next_power_of_2(v))
  order, nbr, num = same_vma(order, nbr, num)
  offsets, counts, rows = pl.pallas_call(
      functools.partial(_block_plan_kernel, block_m=block_m, num_offsets=v, width=width),
      out_shape=(out_struct((num_blocks, v), jnp.int32, nbr), out_struct((num_blocks,), jnp.int32, nbr),
                 out_struct((num_blocks, v, block_m), jnp.int32, nbr)),
      grid=(num_blocks,),
      compiler_params=plgpu.CompilerParams(num_warps=BLOCK_PLAN_WARPS, num_stages=1),
      interpret=interpret,
      name="masked_plan_blocks",
  )(order, nbr, num)
  return MaskedPlan(order, offsets, counts, rows)


def _block_plan_kernel(order_ref, nbr_ref, num_ref, offsets_ref, counts_ref, rows_ref, *, block_m: int,
                       num_offsets: int, width: int):
  """Block b: its rows' map entries tile[l, v] = nbr[order[b * block_m + l], v] (-1 past the valid rows), the
  offsets some lane uses, stored used-first (a stable partition), and the tile's rows in that offset order."""
  b = pl.program_id(0)
  cap = nbr_ref.shape[0]
  lanes = jnp.arange(block_m, dtype=jnp.int32)
  positions = b * block_m + lanes
  valid = positions < num_ref[0]  # valid rows come first in `order` (and num <= capacity)
  rows = plgpu.load(order_ref.at[positions], mask=positions < cap, other=0)
  cols = jnp.arange(width, dtype=jnp.int32)
  col_ok = cols < num_offsets
  # Loaded [lane, offset] (each map row read whole, contiguously), stored transposed [offset, lane] (each
  # offset's lanes written contiguously): the transpose runs through shared memory.
  tile = plgpu.load(nbr_ref.at[rows[:, None], cols[None, :]], mask=valid[:, None] & col_ok[None, :], other=-1)
  used = (jnp.max(tile, axis=0) >= 0).astype(jnp.int32)  # padding offsets hold -1 only
  count = jnp.sum(used)
  # Where offset v goes: after the used offsets before it, or after all used ones and the unused before it.
  used_before = jnp.sum(jnp.where(cols[None, :] < cols[:, None], used[None, :], 0), axis=1)
  slot = jnp.where(used > 0, used_before, count + cols - used_before)
  plgpu.store(offsets_ref.at[b, slot], cols, mask=col_ok)
  plgpu.store(counts_ref.at[b], count)
  plgpu.store(rows_ref.at[b, slot[:, None], lanes[None, :]], tile.T, mask=col_ok[:, None])


def masked_plan_reference(nbr: jax.Array, num: jax.Array, block_m: int) -> MaskedPlan:
  """`masked_plan` in plain XLA ops (the tests' reference)."""
  cap, v = nbr.shape
  valid = jnp.arange(cap) < num
  order = _row_order(nbr, num)
  num_blocks = -(-cap // block_m)
  padded = num_blocks * block_m
  # Whole rows are gathered in processing order (contiguous V-int rows), then each block picks its used
  # offsets among its own rows: a gather of single ints at (random row, offset) reads 8x the bytes it uses.
  # Padding by jnp.pad, not `zeros(padded).at[:cap].set(...)`: inside a 2-device shard_map that full-range
  # scatter (padded == cap) crashes XLA's Shardy canonicalizer (jax 0.11.2; segfault, seen on CPU and GPU).
  sorted_rows = jnp.where(valid[:, None], nbr[order], -1)  # valid rows come first in `order`
  sorted_rows = jnp.pad(sorted_rows, ((0, padded - cap), (0, 0)), constant_values=-1)
  lanes_last = jnp.transpose(sorted_rows.reshape(num_blocks, block_m, v), (0, 2, 1))  # [block, offset, lane]
  used = jnp.any(lanes_last >= 0, axis=2)
  counts = jnp.sum(used, axis=1, dtype=jnp.int32)
  offsets = _used_first(used)
  block_rows = jnp.take_along_axis(lanes_last, offsets[:, :, None], axis=1)
  return MaskedPlan(order, offsets, counts, block_rows)


def _used_first(used: jax.Array) -> jax.Array:
  """int32 [blocks, V]: per block the offsets with used[b, v] first, then the others, each ascending (a stable
  partition, by prefix sums and a one-hot select instead of a sort)."""
  v = used.shape[1]
  counts = jnp.sum(used, axis=1, keepdims=True, dtype=jnp.int32)
  position = jnp.where(used, jnp.cumsum(used, axis=1, dtype=jnp.int32) - 1,
                       counts + jnp.cumsum(~used, axis=1, dtype=jnp.int32) - 1)  # where offset v goes
  slots = jnp.arange(v, dtype=jnp.int32)
  return jnp.sum(jnp.where(position[:, None, :] == slots[None, :, None], slots[None, None, :], 0), axis=2,
                 dtype=jnp.int32)


def pair_lists(nbr: jax.Array, mirrored: bool = False) -> PairLists:
  """PairLists of `nbr`; mirrored=True (only for a submanifold map: see PairLists) stores half the offsets."""
  cap, num_offsets = nbr.shape
  v = (num_offsets + 1) // 2 if mirrored and num_offsets > 1 else num_offsets
  # Offset-major, so that consecutive updates of the scatters below write consecutive slots.
  by_offset = nbr[:, :v].T  # [v, cap]
  has = by_offset >= 0
  rows = jnp.broadcast_to(jnp.arange(cap, dtype=jnp.int32)[None, :], (v, cap))
  # Slot of row i in offset v's list; rows without a neighbour go to distinct slots past the end and are
  # dropped: unique indices, plain stores.
  slot = jnp.where(has, jnp.cumsum(has, axis=1, dtype=jnp.int32) - 1, cap + rows)
  index = (jnp.broadcast_to(jnp.arange(v)[:, None], (v, cap)), slot)
  empty = jnp.full((v, cap), -1, jnp.int32)
  lists = empty.at[index].set(rows, mode="drop", unique_indices=True)
  # The sources are scattered with the same indices rather than gathered back through `lists` (a gather of
  # single ints at random rows).
  sources = empty.at[index].set(by_offset, mode="drop", unique_indices=True)
  counts = jnp.sum(has, axis=1, dtype=jnp.int32)
  if v < num_offsets:  # offset V-1-u has as many pairs as offset u
    counts = jnp.concatenate([counts, jnp.flip(counts[: num_offsets - v])])
  return PairLists(lists, counts, sources)
