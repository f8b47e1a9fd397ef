"""Work plans for the sparse GEMMs, built from a neighbour map (jit-friendly, static shapes).

- `masked_plan`: rows sorted by the Gray-code rank of their neighbour bitmask, so that a block of
  consecutive sorted rows uses few kernel offsets, and for each block the list of offsets at least one of
  its rows uses. The gather-GEMM then loops over those offsets only. Submanifold maps are symmetric
  (offset v of row i <-> offset V-1-v of its neighbour), so the input gradient, which reads the same map,
  reuses the same plan.
- `pair_lists`: for every offset, the rows that have a neighbour there, packed to the front. The weight
  gradient walks these instead of all rows. `pair_lists_from_plan` reads the same lists from a plan, so that a
  training step keeping the plan need not keep the map as well.

Both also store the gathered row indices the kernels read (`MaskedPlan.block_rows`, `PairLists.sources`), so
that inside a kernel's loop every data load is one indirection away from the loop counter. Triton's software
pipeliner splits its stages over the chain of dependent loads (offset -> neighbour row -> features): with the
chain cut to one level the feature and weight tiles get twice the prefetch depth (docs/perf_notes.md).

The masked plan is an XLA sort followed by one Pallas kernel (`_block_plan_kernel`, a program per block): it
gathers the block's map rows, finds the offsets they use, and writes them used-first with their row indices
transposed to [offset, lane]. In XLA that step was a transpose, an any-reduction and a take_along_axis over the
whole [rows, V] map, together several times the plan's memory traffic (docs/perf_notes.md);
`masked_plan_reference` keeps that XLA form as the tests' reference.

The pair lists are two Pallas kernels over chunks of rows (a map's, or a plan's blocks): one counts each chunk's
rows with a neighbour per offset, the other (after an XLA scan of those counts) writes every list slot once as a
stable partition. In XLA (`pair_lists_reference`) they were a transpose of the map, a cumsum and two scatters.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.distinct_stores import store_distinct
from pallas_kernels.out_struct import out_struct, same_vma

# Bitmask keys are int32: sort by the first 31 offsets' bits when V is larger (the per-block offset lists
# stay exact; only the grouping is coarser).
MASK_BITS = 31


class MaskedPlan(NamedTuple):
  order: jax.Array  # int32 [capacity]: rows in processing order (valid rows first)
  block_offsets: jax.Array  # int32 [num_blocks, V]: per block, the offsets used, then the unused ones
  block_counts: jax.Array  # int32 [num_blocks]: how many of block_offsets[b] are used
  # int32 [num_blocks, V, block_m]: block_rows[b, j, l] = nbr[order[b * block_m + l], block_offsets[b, j]]
  # (-1: no neighbour, or a lane past the valid rows) for j < block_counts[b]. The slots of unused offsets
  # (j >= block_counts[b], all -1 by definition) are not written, so they hold whatever the buffer held: the
  # GEMMs never read them, and `used_rows()` gives the array with them set to -1.
  block_rows: jax.Array

  def used_rows(self) -> jax.Array:
    """block_rows with the unused offsets' slots set to -1 (what a plan's consumer may read, made comparable)."""
    j = jnp.arange(self.block_rows.shape[1], dtype=jnp.int32)
    return jnp.where(j[None, :, None] < self.block_counts[:, None, None], self.block_rows, -1)

  def comparable(self) -> "MaskedPlan":
    """This plan with `used_rows()` for block_rows: two plans of one map compare equal field by field."""
    return self._replace(block_rows=self.used_rows())


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


# Row classes (`masked_plan(row_classes=...)`) are uint8 ids below this; padding rows sort after every class.
MAX_ROW_CLASSES = 255


def row_order(nbr: jax.Array, num: jax.Array, row_classes: jax.Array | None = None,
              row_masks: jax.Array | None = None) -> jax.Array:
  """int32 [capacity]: the valid rows by the Gray-code rank of their neighbour bitmask (or by their class, when
  the classes are given), then the others. row_masks: None, or int32 [capacity] the valid rows' bitmasks (bit v
  set where nbr[i, v] >= 0, v < MASK_BITS; occupancy_neighbors.neighbor_map_and_masks writes them with the map),
  so that the map is not read for them."""
  cap, v = nbr.shape
  valid = jnp.arange(cap, dtype=jnp.int32) < num
  if row_classes is not None:  # an 8-bit key: one radix pass of the sort instead of four, no read of the map
    if jnp.shape(row_classes) != (cap,):  # broadcasting would give every row one class, or a 2-D order
      raise ValueError(f"row_classes must have shape ({cap},), one class per map row, got {jnp.shape(row_classes)}")
    key = jnp.where(valid, row_classes.astype(jnp.uint8), jnp.uint8(MAX_ROW_CLASSES))
    return jnp.argsort(key, stable=True).astype(jnp.int32)
  if row_masks is not None:
    if jnp.shape(row_masks) != (cap,):
      raise ValueError(f"row_masks must have shape ({cap},), one bitmask per map row, got {jnp.shape(row_masks)}")
    mask = jnp.asarray(row_masks, jnp.int32)
  else:
    has = (nbr >= 0) & valid[:, None]
    bits = min(v, MASK_BITS)
    weights = jnp.left_shift(jnp.int32(1), jnp.arange(bits, dtype=jnp.int32))
    mask = jnp.sum(jnp.where(has[:, :bits], weights[None, :], 0), axis=1, dtype=jnp.int32)
  key = jnp.where(valid, gray_rank(mask), jnp.iinfo(jnp.int32).max)
  return jnp.argsort(key, stable=True).astype(jnp.int32)


# Warps of a block-plan program: its work is one [block_m, V] tile of loads and stores.
BLOCK_PLAN_WARPS = 4


def masked_plan(nbr: jax.Array, num: jax.Array, block_m: int, *, row_classes: jax.Array | None = None,
                row_masks: jax.Array | None = None, order: jax.Array | None = None,
                num_warps: int = BLOCK_PLAN_WARPS, interpret: bool = False) -> MaskedPlan:
  """The MaskedPlan of map `nbr` (int32 [capacity, V]) with `num` (int32 [1]) valid rows, in blocks of block_m
  rows: the row order by XLA's sort, each block's offsets and rows by `_block_plan_kernel`.

  row_classes: None, or an integer [capacity] class per row (0 <= class < MAX_ROW_CLASSES) where rows of one
    class use the same offsets but for a few (a strided convolution's transposed map: an input row's offsets
    follow from its position modulo the stride). Rows are then ordered by class instead of by their masks.
    Any classes give a correct plan; good ones only make it as tight as the masks' order.
  row_masks: None, or the rows' neighbour bitmasks as the map's kernel wrote them (see row_order): the same plan,
    without a pass over the map for them.
  order: None, or the row order of another plan of this map and classes (`MaskedPlan.order`, which does not
    depend on block_m): the same plan, without sorting the rows again.
  num_warps: warps of each block-plan program (a tuning knob; the plan is the same).
  """
  cap, v = nbr.shape
  num = jnp.asarray(num, jnp.int32).reshape(1)
  if order is None:
    order = row_order(nbr, num, row_classes, row_masks)
  elif jnp.shape(order) != (cap,):
    raise ValueError(f"order must have shape ({cap},), one row per map row, got {jnp.shape(order)}")
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
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
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
  count = jnp.sum(used, dtype=jnp.int32)
  # Where offset v goes: after the used offsets before it, or after all used ones and the unused before it.
  used_before = jnp.sum(jnp.where(cols[None, :] < cols[:, None], used[None, :], 0), axis=1, dtype=jnp.int32)
  slot = jnp.where(used > 0, used_before, count + cols - used_before)
  plgpu.store(offsets_ref.at[b, slot], cols, mask=col_ok)
  plgpu.store(counts_ref.at[b], count)
  # Only the used offsets' rows: an unused offset's are all -1 and no GEMM reads them, and on a plan whose blocks
  # use few of the V offsets (class-ordered transposed maps above all) most of the kernel's writes went there.
  plgpu.store(rows_ref.at[b, slot[:, None], lanes[None, :]], tile.T, mask=(used > 0)[:, None])


def masked_plan_reference(nbr: jax.Array, num: jax.Array, block_m: int,
                          row_classes: jax.Array | None = None) -> MaskedPlan:
  """`masked_plan` in plain XLA ops (the tests' reference)."""
  cap, v = nbr.shape
  valid = jnp.arange(cap, dtype=jnp.int32) < num
  order = row_order(nbr, num, row_classes)
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


# Map entries one pair-list program holds as a [rows, offsets] int32 tile: 2048, so V 27 gets 64-row chunks and
# a mirrored V 27 (14 lists) 128. Larger tiles ran slower on 1M-row maps (`benchmarks/probes/plan_kernels.py`,
# docs/perf_notes.md).
PAIR_LIST_TILE_ELEMENTS = 2048
# Warps of a pair-list program (one tile of loads, a column prefix sum, two transposed stores).
PAIR_LIST_WARPS = 4


def pair_list_chunk_rows(num_lists: int) -> int:
  """Rows per pair-list program for `num_lists` stored offsets (a power of two, 32 to 1024): the tile budget
  PAIR_LIST_TILE_ELEMENTS over the padded offset count, capped so that large maps still spread over the SMs."""
  width = max(2, pl.next_power_of_2(num_lists))
  return min(1024, max(32, PAIR_LIST_TILE_ELEMENTS // width))


def _checked_chunk_rows(num_lists: int, chunk_rows, op: str) -> int:
  """chunk_rows, or `pair_list_chunk_rows` for None; anything but a power of two is refused, naming `op`."""
  chunk = pair_list_chunk_rows(num_lists) if chunk_rows is None else chunk_rows
  if not isinstance(chunk, int) or chunk < 1 or chunk & (chunk - 1):
    raise ValueError(f"{op}: chunk_rows must be a power of two, got {chunk_rows!r}")
  return chunk


def _num_lists(num_offsets: int, mirrored: bool) -> int:
  return (num_offsets + 1) // 2 if mirrored and num_offsets > 1 else num_offsets


def _with_mirrored_counts(counts: jax.Array, num_offsets: int) -> jax.Array:
  """counts of the stored offsets, extended to all V: offset V-1-u has as many pairs as offset u."""
  v = counts.shape[0]
  if v < num_offsets:
    counts = jnp.concatenate([counts, jnp.flip(counts[: num_offsets - v])])
  return counts


def pair_lists(nbr: jax.Array, mirrored: bool = False, *, interpret: bool = False,
               chunk_rows: int | None = None, num_warps: int = PAIR_LIST_WARPS) -> PairLists:
  """PairLists of `nbr` (int32 [capacity, V]); mirrored=True (only for a submanifold map: see PairLists) stores
  half the offsets.

  Two Pallas kernels over chunks of `chunk_rows` rows (None: `pair_list_chunk_rows`; a power of two): the first
  counts each chunk's rows with a neighbour per offset, XLA turns those into each chunk's start in every list,
  and the second writes every slot of the lists once, as a stable partition (rows with a neighbour in row
  order, then the others as -1). `interpret=True` runs the kernels on the CPU. Equal, bit for bit, to
  `pair_lists_reference`. num_warps: warps of each program (a tuning knob; the lists are the same).
  """
  nbr = jnp.asarray(nbr)
  if nbr.ndim != 2:
    raise ValueError(f"pair_lists: nbr must be a 2-D [capacity, V] map, got shape {nbr.shape}")
  if not jnp.issubdtype(nbr.dtype, jnp.integer):
    raise TypeError(f"pair_lists: nbr must hold integers (int32 row indices), got {nbr.dtype}")
  nbr = nbr.astype(jnp.int32)
  cap, num_offsets = nbr.shape
  lists = _num_lists(num_offsets, mirrored)
  chunk = _checked_chunk_rows(lists, chunk_rows, "pair_lists")
  width = max(2, pl.next_power_of_2(lists))
  tile = functools.partial(_map_tile, chunk=chunk, num_lists=lists, width=width)
  return _partitioned_lists((nbr,), tile, cap, chunk, num_offsets, lists, width, interpret, num_warps)


def pair_lists_from_plan(plan: MaskedPlan, mirrored: bool = False, *, interpret: bool = False,
                         chunk_rows: int | None = None, num_warps: int = PAIR_LIST_WARPS) -> PairLists:
  """`pair_lists(nbr, mirrored)` of the map `plan` was built from (`masked_plan(nbr, num, ...)`, rows past num
  all -1 as in every map), read from the plan instead of the map: a training step that keeps the plan for its
  input gradient then need not keep the map too, for its weight gradient (the two hold the same row indices,
  and a map is as large as its plan).

  The same two kernels as `pair_lists`, over chunks of rows in row order: each row's entries are found at its
  position in the plan (the inverse of `plan.order`) and each offset's slot in that position's block (the
  inverse of `block_offsets`), both built by XLA first. The lists come out in row order, not the plan's: the
  weight gradient's two gathers then walk x and dy in step with their rows, which in the plan's order they did
  not (docs/perf_notes.md, run 97). mirrored=True only for a submanifold map's plan. Equal, bit for bit, to
  `pair_lists_from_plan_reference`.
  """
  num_blocks, num_offsets, block_m = plan.block_rows.shape
  cap = plan.order.shape[0]
  if num_blocks != -(-cap // block_m) or plan.block_offsets.shape != (num_blocks, num_offsets):
    raise ValueError(f"pair_lists_from_plan: plan arrays of mismatched shapes: order {plan.order.shape}, "
                     f"block_offsets {plan.block_offsets.shape}, block_rows {plan.block_rows.shape}")
  lists = _num_lists(num_offsets, mirrored)
  chunk = _checked_chunk_rows(lists, chunk_rows, "pair_lists_from_plan")
  width = max(2, pl.next_power_of_2(lists))
  tile = functools.partial(_plan_rows_tile, chunk=chunk, block_m=block_m, num_lists=lists, width=width)
  return _partitioned_lists((plan_positions(plan), offset_slots(plan), plan.block_rows), tile, cap, chunk,
                            num_offsets, lists, width, interpret, num_warps)


def plan_positions(plan: MaskedPlan) -> jax.Array:
  """int32 [capacity]: each row's position in the plan's processing order (`order` is a permutation)."""
  cap = plan.order.shape[0]
  return jnp.zeros((cap,), jnp.int32).at[plan.order].set(jnp.arange(cap, dtype=jnp.int32), unique_indices=True,
                                                           mode="promise_in_bounds")


def offset_slots(plan: MaskedPlan) -> jax.Array:
  """int32 [num_blocks, V]: where each offset's rows sit in each block's block_rows, -1 where the block does not
  use it (each block's `block_offsets` is a permutation of the V offsets, the used ones first)."""
  num_blocks, num_offsets = plan.block_offsets.shape
  slots = jnp.arange(num_offsets, dtype=jnp.int32)
  slot = jnp.where(slots[None, :] < plan.block_counts[:, None], slots[None, :], -1)
  block = jnp.arange(num_blocks, dtype=jnp.int32)[:, None]
  return jnp.zeros((num_blocks, num_offsets), jnp.int32).at[block, plan.block_offsets].set(
      slot, unique_indices=True, mode="promise_in_bounds")


def _partitioned_lists(map_refs: tuple, load_tile, cap: int, chunk: int, num_offsets: int, lists: int,
                       width: int, interpret: bool, num_warps: int) -> PairLists:
  """The two pair-list kernels over chunks of `chunk` map rows, which `load_tile(*map_refs)` loads (see
  `_map_tile`): a count per chunk and list, an XLA scan of those, then every slot of [lists, cap] written once."""
  if cap == 0 or lists == 0:  # nothing to trace a kernel over
    empty = jnp.zeros((lists, cap), jnp.int32)
    return PairLists(empty, jnp.zeros((num_offsets,), jnp.int32), empty)
  num_chunks = -(-cap // chunk)
  params = dict(load_tile=load_tile, num_lists=lists, width=width)
  compiler_params = plgpu.CompilerParams(num_warps=num_warps, num_stages=1)
  like = map_refs[0]
  chunk_counts = pl.pallas_call(
      functools.partial(_chunk_counts_kernel, **params),
      out_shape=out_struct((num_chunks, lists), jnp.int32, like),
      grid=(num_chunks,),
      compiler_params=compiler_params,
      interpret=interpret,
      name="pair_list_counts",
  )(*map_refs)
  # Where each chunk's rows start in every offset's list: a scan over num_chunks x L ints (capacity / chunk
  # rows), small next to the map.
  ends = jnp.cumsum(chunk_counts, axis=0, dtype=jnp.int32)
  starts = ends - chunk_counts
  counts = ends[-1]
  starts, counts, *map_refs = same_vma(starts, counts, *map_refs)
  rows, sources = pl.pallas_call(
      functools.partial(_pair_lists_kernel, chunk=chunk, **params),
      out_shape=(out_struct((lists, cap), jnp.int32, like), out_struct((lists, cap), jnp.int32, like)),
      grid=(num_chunks,),
      compiler_params=compiler_params,
      interpret=interpret,
      name="pair_lists",
  )(*map_refs, starts, counts)
  return PairLists(rows, _with_mirrored_counts(counts, num_offsets), sources)


def _map_tile(nbr_ref, *, chunk: int, num_lists: int, width: int):
  """Chunk c of a map: its rows (int32 [chunk]), which of them are real, and the tile [chunk, width] of their
  entries at the stored offsets (whole rows read contiguously; -1 past the capacity and the stored offsets)."""
  cap = nbr_ref.shape[0]
  rows = pl.program_id(0) * chunk + jnp.arange(chunk, dtype=jnp.int32)
  cols = jnp.arange(width, dtype=jnp.int32)
  row_ok = rows < cap
  tile = plgpu.load(nbr_ref.at[rows[:, None], cols[None, :]], mask=row_ok[:, None] & (cols < num_lists)[None, :],
                    other=-1)
  return rows, row_ok, tile


def _plan_rows_tile(positions_ref, slots_ref, block_rows_ref, *, chunk: int, block_m: int, num_lists: int,
                    width: int):
  """`_map_tile` read from a plan: chunk c's rows, each found at its plan position (block, lane), and their
  entries at the stored offsets from block_rows at that block's slot of each offset (-1 where it has none)."""
  cap = positions_ref.shape[0]
  rows = pl.program_id(0) * chunk + jnp.arange(chunk, dtype=jnp.int32)
  row_ok = rows < cap
  position = plgpu.load(positions_ref.at[rows], mask=row_ok, other=0)
  block, lane = position // block_m, position % block_m
  cols = jnp.arange(width, dtype=jnp.int32)
  slot = plgpu.load(slots_ref.at[block[:, None], cols[None, :]], mask=row_ok[:, None] & (cols < num_lists)[None, :],
                    other=-1)
  # Rows next to each other mostly share a mask, so sit next to each other in one block: these loads coalesce.
  tile = plgpu.load(block_rows_ref.at[block[:, None], slot, lane[:, None]], mask=slot >= 0, other=-1)
  return rows, row_ok, tile


def _chunk_counts_kernel(*refs, load_tile, num_lists: int, width: int):
  """counts[c, v]: the rows of chunk c with a neighbour at offset v."""
  *map_refs, counts_ref = refs
  _, _, tile = load_tile(*map_refs)
  cols = jnp.arange(width, dtype=jnp.int32)
  count = jnp.sum((tile >= 0).astype(jnp.int32), axis=0, dtype=jnp.int32)
  plgpu.store(counts_ref.at[pl.program_id(0), cols], count, mask=cols < num_lists)


def _pair_lists_kernel(*refs, load_tile, chunk: int, num_lists: int, width: int):
  """Chunk c's share of every list: a row with a neighbour at offset v goes to slot starts[c, v] + (rows with
  one before it in the chunk), a row without one to slot counts[v] + (rows without one before it in the map),
  so that the programs together write every slot of [L, capacity] exactly once."""
  *map_refs, starts_ref, counts_ref, rows_ref, sources_ref = refs
  c = pl.program_id(0)
  rows, row_ok, tile = load_tile(*map_refs)
  cols = jnp.arange(width, dtype=jnp.int32)
  col_ok = cols < num_lists
  # Loaded [row, offset] (whole map rows, contiguous), worked on and stored [offset, row] (each offset's slots
  # contiguous): the one transpose runs through shared memory, and the prefix sum runs along the last axis.
  sources = tile.T
  has = (sources >= 0).astype(jnp.int32)
  has_before = jnp.cumsum(has, axis=1, dtype=jnp.int32) - has  # in-chunk exclusive prefix, per offset
  start = plgpu.load(starts_ref.at[c, cols], mask=col_ok, other=0)
  count = plgpu.load(counts_ref.at[cols], mask=col_ok, other=0)
  lanes = jnp.arange(chunk, dtype=jnp.int32)
  # Rows without a neighbour before lane l: those of the earlier chunks (c * chunk - start; every chunk but the
  # last is whole) and of this one.
  without_before = (c * chunk - start)[:, None] + (lanes[None, :] - has_before)
  slot = jnp.where(has > 0, start[:, None] + has_before, count[:, None] + without_before)
  ok = col_ok[:, None] & row_ok[None, :]
  # Each offset's rows land in two contiguous runs (those with a neighbour, those without).
  plgpu.store(rows_ref.at[cols[:, None], slot], jnp.where(has > 0, rows[None, :], -1), mask=ok)
  plgpu.store(sources_ref.at[cols[:, None], slot], jnp.where(has > 0, sources, -1), mask=ok)


def pair_lists_reference(nbr: jax.Array, mirrored: bool = False) -> PairLists:
  """`pair_lists` in plain XLA ops (the tests' reference)."""
  return _lists_reference(jnp.arange(nbr.shape[0], dtype=jnp.int32), nbr, mirrored)


def pair_lists_from_plan_reference(plan: MaskedPlan, mirrored: bool = False) -> PairLists:
  """`pair_lists_from_plan` in plain XLA ops (the tests' reference): the map's rows rebuilt from block_rows,
  put back in row order by a sort of the plan's order, partitioned as `pair_lists_reference` partitions a map."""
  num_blocks, num_offsets, block_m = plan.block_rows.shape
  slots = jnp.arange(num_offsets, dtype=jnp.int32)
  used_offsets = jnp.where(slots[None, :] < plan.block_counts[:, None], plan.block_offsets, -1)
  hit = used_offsets[:, None, :] == slots[None, :, None]  # [block, offset, slot]
  slot = jnp.sum(jnp.where(hit, slots[None, None, :], 0), axis=2, dtype=jnp.int32)
  entries = jnp.take_along_axis(plan.block_rows, slot[:, :, None], axis=1)  # [block, offset, lane]
  entries = jnp.where(jnp.any(hit, axis=2)[:, :, None], entries, -1)
  entries = jnp.transpose(entries, (0, 2, 1)).reshape(num_blocks * block_m, num_offsets)
  cap = plan.order.shape[0]
  by_row = entries[jnp.argsort(plan.order)]
  return _lists_reference(jnp.arange(cap, dtype=jnp.int32), by_row, mirrored)


def _lists_reference(rows: jax.Array, entries: jax.Array, mirrored: bool) -> PairLists:
  """PairLists of map rows `rows` (int32 [cap]) with entries `entries` ([cap, V], in that order)."""
  cap, num_offsets = entries.shape
  v = _num_lists(num_offsets, mirrored)
  # Offset-major, so that consecutive updates of the scatters below write consecutive slots.
  by_offset = entries[:, :v].T  # [v, cap]
  has = by_offset >= 0
  rows = jnp.broadcast_to(rows[None, :], (v, cap))
  # Slot of each row in offset v's list, for the rows with a neighbour there (plain stores).
  slot = jnp.cumsum(has, axis=1, dtype=jnp.int32) - 1
  index = (jnp.arange(v, dtype=jnp.int32)[:, None], slot)
  empty = jnp.full((v, cap), -1, jnp.int32)
  lists = store_distinct(empty, index, rows, has, axis=1)
  # The sources are stored with the same indices rather than gathered back through `lists` (a gather of
  # single ints at random rows).
  sources = store_distinct(empty, index, by_offset, has, axis=1)
  counts = jnp.sum(has, axis=1, dtype=jnp.int32)
  return PairLists(lists, _with_mirrored_counts(counts, num_offsets), sources)
