"""Output sites of a strided sparse convolution, deduplicated with the GPU hash table (Pallas -> Triton).

Arrays in, arrays out: this module does not import ``jsparse``. It reuses hash_table.py's table (murmur
``fmix32`` home slot, linear probing, ``atomic_xchg`` as the only atomic) and its probe loops.

Problem. Every valid input row ``j`` proposes, for every kernel offset ``v``, the output site it feeds
(``o = (position + padding - offset) / stride``, where that is integral and inside the output grid, in the
row's batch item, which must lie in [0, batch_size): a row outside the batch proposes nothing). The
output sites are the distinct proposals, sorted by linear key; ``inv[j, v]`` is the output row of proposal
``(j, v)`` or -1. The XLA path sorts all ``capacity * V`` proposals; here only the distinct ones are sorted.

Two stages (the caller may read ``count`` on the host in between, to choose ``out_capacity``):

1. ``dedupe_proposals`` (two kernels):
   * ``unique_insert``: flat over pairs ``p = j*V + v``, each valid proposal is inserted into a key table
     (proposal keys are computed in the kernel from the coordinates: no ``capacity * V`` array in memory)
     with ``hash_table.insert_absent_loop``: a lane walks the key's probe run reading, stops at its own
     key, and swaps only into a slot it read EMPTY (the last-come-first-served ``insert_loop`` would give
     a key a second copy whenever it is already stored past its home slot, which duplicates make common).
     Equal keys so collapse onto one slot, but races can still leave a second copy: a lane reads EMPTY,
     another lane fills the slot first, the swap hands back that key, and carrying it on can put it past
     a copy placed meanwhile. Every copy still lies in the unbroken occupied run that starts at the key's
     home slot (EMPTY is never written; keys only move forward), so
   * ``unique_mark``: flat over slots, an occupied slot keeps its key iff it holds the FIRST copy of that
     key along its probe run; the other copies become EMPTY in ``unique``. ``count`` = kept slots = the
     number of distinct output sites, exactly.
2. ``output_sites``:
   * XLA: the ``out_capacity`` smallest kept keys, ascending, and their slots: the kept slots are
     compacted (cumsum) into ``out_capacity`` entries and only those are sorted. On overflow
     (``count > out_capacity``) only keys up to the ``out_capacity``-th smallest are kept, found on the
     device by ``kth_smallest.py`` (no host wait; zero passes without overflow). Then ``slot_rows[slot]`` =
     output row.
   * ``unique_lookup``: flat over pairs, each valid proposal probes to the first copy of its key and reads
     ``slot_rows`` there: ``inv`` (-1 for sites beyond ``out_capacity``).

Table size ``T``: a power of two >= 1.5 * B, B = min(capacity * P, batch_size * |output grid|), P the most
offsets one input site can send to outputs (offsets congruent to (position + padding) modulo the stride
on every axis: 1 for kernel == stride, 8 for a 3^3 kernel with stride 2). Occupied slots never exceed
the number of valid proposals (a lane fills at most one EMPTY slot), at most capacity * P, so when that
is the smaller bound the table stays at most 2/3 full (the bound is loose: a LiDAR scan's proposals fill
a few percent, and the table is the largest buffer of a strided convolution's site search) and no probe
loop (bounded by ``max_probes``, default ``T``) can run out. When the output grid is the smaller bound,
filling the table would need more racing second copies than distinct sites; either way an exhausted bound only
sets ``overflow``.

Wide grids (``wide_keys=True``, output grid of 2**31 sites or more): the table holds proposal indices
``p = j*V + v`` instead of keys, and the same three kernels compare the sites the indices propose (recomputed
from the coordinates and offsets, ``proposal_site``): the probe loops run over hash_table's ``SiteRefs``
instead of ``KeySlots``. A proposal's site never changes, so the insertion and first-copy arguments above hold
with "key" read as "site of p": copies still lie in the unbroken run from their site's home slot, and the
mark keeps exactly the first reference to each site. ``output_sites`` then sorts the kept sites by their four
coordinates (lexicographic = linear order) and returns them instead of int32 keys.

Interpret mode (CPU): atomics on arrays are not supported there, so the insertion runs one lane per
program with a plain load+store swap (grid steps run one after another: exact, and no key gets a second
copy; tests build such copies by hand for the mark kernel). The mark and lookup kernels only load from
the table and store contiguously, so they keep their blocks.
"""
from __future__ import annotations

import collections
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.distinct_stores import store_distinct
from pallas_kernels.hash_table import (EMPTY, MAX_BLOCK, MAX_PAIRS, KeySlots, SiteRefs, check_table_size,
                                      insert_absent_loop, linear_key, probe_loop, table_size_for)
from pallas_kernels.kth_smallest import kth_smallest_if_over
from pallas_kernels.out_struct import out_struct, same_vma

__all__ = ["ProposalGeometry", "ProposalTable", "check_coords", "dedupe_proposals", "output_sites", "proposal_site",
           "proposal_site_at", "proposal_operands", "offsets_by_residue", "proposals_per_site", "default_table_size"]

BIG = int(np.iinfo(np.int32).max)  # sort key of an empty entry (site keys are < 2**31 - 1)


class ProposalGeometry(NamedTuple):
  """Static description of a strided convolution's proposals (hashable: a jit static argument).

  offsets: V (dx, dy, dz) kernel offsets (times the dilation); stride, padding: per axis;
  out_shape: the output grid (X, Y, Z). Proposal of input position c at offset d, per axis:
  o = (c + padding - d) / stride, kept where that is an integer with 0 <= o < out_shape.
  in_shape: None, or the grid the input positions lie on: a position outside [0, in_shape) on any axis then
  proposes nothing (a row outside the grid, which only a directly built tensor can hold).
  """

  offsets: tuple[tuple[int, int, int], ...]
  stride: tuple[int, int, int]
  padding: tuple[int, int, int]
  out_shape: tuple[int, int, int]
  in_shape: tuple[int, int, int] | None = None


class ProposalTable(NamedTuple):
  """Result of ``dedupe_proposals`` (a pytree of arrays: it can cross a jit boundary).

  table: int32 [T] the hash table of proposal keys (EMPTY where unused), for lookups.
  unique: int32 [T] the same with every key kept once (first copy along its probe run), EMPTY elsewhere.
  count: int32 scalar, number of distinct proposals (output sites).
  overflow: bool scalar, True if a probe loop ran past its bound (then the rest is unreliable).
  """

  table: jax.Array
  unique: jax.Array
  count: jax.Array
  overflow: jax.Array


def offsets_by_residue(geometry: ProposalGeometry) -> dict[tuple[int, int, int], list[int]]:
  """{residue: offset indices}: an input proposes at offset d only when d is congruent to (position + padding)
  modulo the stride on every axis, so the offsets an input can use are one residue's group."""
  groups = collections.defaultdict(list)
  for v, off in enumerate(geometry.offsets):
    groups[tuple(d % s for d, s in zip(off, geometry.stride))].append(v)
  return groups


def proposals_per_site(geometry: ProposalGeometry) -> int:
  """Most offsets whose proposals from one input site are valid (the largest residue group)."""
  return max((len(g) for g in offsets_by_residue(geometry).values()), default=0)


def default_table_size(capacity: int, geometry: ProposalGeometry, batch_size: int) -> int:
  """Smallest power of two >= 1.5 * min(capacity * proposals_per_site, batch_size * |output grid|)."""
  bound = min(capacity * proposals_per_site(geometry), batch_size * math.prod(geometry.out_shape))
  return table_size_for(bound, factor=1.5)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


def proposal_site(num, coords_ref, offs_ref, p, in_range, *, nv: int, geometry: ProposalGeometry, batch_size: int):
  """Output site (batch, ox, oy, oz) fed by input row j = p // V at offset v = p % V, and whether it exists
  (``proposal_site_at``)."""
  j = lax.div(p, jnp.int32(nv))
  return proposal_site_at(num, coords_ref, offs_ref, j, p - j * nv, in_range, geometry=geometry,
                          batch_size=batch_size)


def proposal_site_at(num, coords_ref, offs_ref, j, v, in_range, *, geometry: ProposalGeometry, batch_size: int):
  """Output site (batch, ox, oy, oz) fed by input row j at offset v, and whether it exists (as the XLA path's
  sparse_conv._proposals: a row whose batch lies outside [0, batch_size), or a position outside
  geometry.in_shape, proposes nothing, so that no key leaves the grid). coords flattened [capacity*4], offsets
  [V*3]; lanes outside in_range read nothing."""
  exists = in_range & (j < num)
  base = j * 4
  batch = plgpu.load(coords_ref.at[base], mask=exists, other=0)
  exists = exists & (batch >= 0) & (batch < batch_size)
  site = [batch]
  for axis in range(3):
    pos = plgpu.load(coords_ref.at[base + 1 + axis], mask=exists, other=0)
    if geometry.in_shape is not None:
      exists = exists & (pos >= 0) & (pos < geometry.in_shape[axis])
    off = plgpu.load(offs_ref.at[v * 3 + axis], mask=in_range, other=0)
    shifted = pos + geometry.padding[axis] - off  # = o * stride for a valid proposal
    stride = geometry.stride[axis]
    nonneg = jnp.maximum(shifted, 0)  # lax.div needs non-negative operands to floor
    o = nonneg if stride == 1 else lax.div(nonneg, jnp.int32(stride))
    exists = exists & (shifted >= 0) & (nonneg == o * stride) & (o < geometry.out_shape[axis])
    site.append(o)
  return tuple(site), exists


def _proposals(num, coords_ref, offs_ref, p, in_range, *, nv: int, geometry: ProposalGeometry, batch_size: int,
               wide: bool):
  """(slots, entry, key, exists) of pairs p: under KeySlots the proposed site's int32 linear key (grids of
  fewer than 2**31 sites) as both entry and key, under SiteRefs the proposal index p and its site."""
  site, exists = proposal_site(num, coords_ref, offs_ref, p, in_range, nv=nv, geometry=geometry,
                               batch_size=batch_size)
  if wide:
    return _proposal_refs(num, coords_ref, offs_ref, nv=nv, geometry=geometry, batch_size=batch_size), p, site, exists
  key = linear_key(site, geometry.out_shape)
  return KeySlots(), key, key, exists


def _proposal_refs(num, coords_ref, offs_ref, *, nv: int, geometry: ProposalGeometry, batch_size: int) -> SiteRefs:
  """Slots holding proposal indices p, compared by the site they propose (wide grids)."""
  site_of = lambda refs, mask: proposal_site(num, coords_ref, offs_ref, refs, mask, nv=nv, geometry=geometry,
                                             batch_size=batch_size)[0]
  return SiteRefs(site_of, geometry.out_shape)


def _insert_kernel(num_ref, coords_ref, offs_ref, table_in_ref, table_ref, ovf_ref, *, block,
                   num_pairs, nv, geometry, batch_size, tmask, max_probes, interpret, wide):
  del table_in_ref  # aliased with table_ref
  pid = pl.program_id(0)
  p = pid * block + jnp.arange(block, dtype=jnp.int32)
  slots, entry, key, exists = _proposals(num_ref[0], coords_ref, offs_ref, p, p < num_pairs, nv=nv,
                                         geometry=geometry, batch_size=batch_size, wide=wide)
  carrying = insert_absent_loop(table_ref, entry, key, exists, slots=slots, tmask=tmask, max_probes=max_probes,
                                interpret=interpret)
  plgpu.store(ovf_ref.at[pid], jnp.max(carrying.astype(jnp.int32)))


def _mark_kernel(*refs, block, nv, geometry, batch_size, tmask, max_probes, wide):
  # Wide tables come after the (num, coords, offsets) operands their sites are computed from.
  *site_refs, table_ref, unique_ref, ovf_ref = refs
  pid = pl.program_id(0)
  slots = (_proposal_refs(site_refs[0][0], *site_refs[1:], nv=nv, geometry=geometry, batch_size=batch_size)
           if wide else KeySlots())
  slot_ids = pid * block + jnp.arange(block, dtype=jnp.int32)  # block divides T: all in range
  entry = plgpu.load(table_ref.at[slot_ids])
  occupied = entry != EMPTY
  first, found, searching = probe_loop(table_ref, slots.key_of(entry, occupied), occupied, slots=slots,
                                       tmask=tmask, max_probes=max_probes)
  plgpu.store(unique_ref.at[slot_ids], jnp.where(found & (first == slot_ids), entry, EMPTY))
  lost = searching | (occupied & jnp.logical_not(found))  # the second cannot happen
  plgpu.store(ovf_ref.at[pid], jnp.max(lost.astype(jnp.int32)))


def _lookup_kernel(num_ref, coords_ref, offs_ref, table_ref, slot_rows_ref, inv_ref, ovf_ref, *, block,
                   num_pairs, nv, geometry, batch_size, tmask, max_probes, wide):
  pid = pl.program_id(0)
  p = pid * block + jnp.arange(block, dtype=jnp.int32)
  in_range = p < num_pairs
  slots, _, key, exists = _proposals(num_ref[0], coords_ref, offs_ref, p, in_range, nv=nv,
                                     geometry=geometry, batch_size=batch_size, wide=wide)
  first, found, searching = probe_loop(table_ref, key, exists, slots=slots, tmask=tmask, max_probes=max_probes)
  row = plgpu.load(slot_rows_ref.at[first], mask=found, other=-1)
  plgpu.store(inv_ref.at[p], row, mask=in_range)  # contiguous: pairs are row-major [capacity, V]
  lost = searching | (exists & jnp.logical_not(found))  # the second cannot happen
  plgpu.store(ovf_ref.at[pid], jnp.max(lost.astype(jnp.int32)))



# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------


def check_coords(coords, geometry: ProposalGeometry, batch_size: int, **blocks: int) -> tuple[int, int]:
  """(capacity, V) after validating what every site search's entry point shares (here and in
  occupancy_sites.py): coords [capacity, 4], a positive batch_size, blocks (keyword: name=size) powers of two, and
  an int32 flat pair index."""
  if coords.ndim != 2 or coords.shape[1] != 4:
    raise ValueError(f"coords must be [capacity, 4], got {coords.shape}")
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  for name, block in blocks.items():
    if block < 1 or block & (block - 1) or block > MAX_BLOCK:
      raise ValueError(f"{name} must be a power of two up to {MAX_BLOCK}, got {block}")
  capacity, nv = int(coords.shape[0]), len(geometry.offsets)
  if capacity * nv > MAX_PAIRS:
    raise ValueError(f"capacity * len(offsets) must be at most {MAX_PAIRS} (flat int32 pair index), got "
                     f"{capacity} * {nv}")
  return capacity, nv


def proposal_operands(coords, num, geometry: ProposalGeometry):
  """(num int32 [1], coords int32 [capacity*4], offsets int32 [V*3]): what `proposal_site` reads, as the kernels
  of both site searches take them."""
  return (jnp.reshape(jnp.asarray(num, jnp.int32), (1,)), jnp.asarray(coords, jnp.int32).reshape(-1),
          jnp.asarray(np.asarray(geometry.offsets, np.int32).reshape(-1)))


def _flags(n: int, *like):
  return out_struct((n,), jnp.int32, *like)


def _geometry(geometry) -> ProposalGeometry:
  g = ProposalGeometry(*geometry)
  return ProposalGeometry(tuple(tuple(int(d) for d in o) for o in g.offsets),
                          *(tuple(int(a) for a in t) for t in (g.stride, g.padding, g.out_shape)),
                          None if g.in_shape is None else tuple(int(a) for a in g.in_shape))


def dedupe_proposals(coords, num, *, geometry: ProposalGeometry, batch_size: int, interpret=False,
                     block_pairs=256, num_warps=4, block_slots=256, max_probes=None,
                     table_size=None, wide_keys=False) -> ProposalTable:
  """Stage 1: insert every valid proposal into a hash table; keep each distinct key once.

  Args:
    coords: int32 [capacity, 4] input rows (batch, x, y, z); rows >= num are padding (any contents).
    num: int32 scalar (may be traced): valid rows. A valid row whose batch lies outside [0, batch_size)
      proposes nothing; unless wide_keys, batch_size * |output grid| < 2**31 (so keys are non-negative int32
      below 2**31 - 1).
    geometry: the static ProposalGeometry; batch_size: static, the batch items (and the default table size).
    interpret: Pallas interpret mode (CPU tests): the insertion then runs one lane per program.
    block_pairs / num_warps: (row, offset) pairs per program and Triton warps of the insertion;
      block_slots: slots per program of the mark kernel (powers of two).
    max_probes: bound on every probe loop (default T); an exhausted bound sets ``overflow``.
    table_size: slots T, a power of two >= default_table_size(...) (the default).
    wide_keys: the output grid has 2**31 sites or more (batch_size * |output grid| < 2**62, extents
      < 2**21): the table then holds proposal indices p = j*V + v, compared by the site they propose.

  Returns:
    ProposalTable(table, unique, count, overflow) (with wide_keys, table and unique hold proposal indices).
  """
  return _dedupe_proposals(
      coords, num, geometry=_geometry(geometry), batch_size=int(batch_size), interpret=bool(interpret),
      block_pairs=int(block_pairs), num_warps=int(num_warps), block_slots=int(block_slots),
      max_probes=None if max_probes is None else int(max_probes),
      table_size=None if table_size is None else int(table_size), wide_keys=bool(wide_keys))


@functools.partial(jax.jit, static_argnames=("geometry", "batch_size", "interpret", "block_pairs",
                                             "num_warps", "block_slots", "max_probes", "table_size",
                                             "wide_keys"))
def _dedupe_proposals(coords, num, *, geometry, batch_size, interpret, block_pairs, num_warps,
                      block_slots, max_probes, table_size, wide_keys):
  coords = jnp.asarray(coords, jnp.int32)
  capacity, nv = check_coords(coords, geometry, batch_size, block_pairs=block_pairs, block_slots=block_slots)
  smallest = default_table_size(capacity, geometry, batch_size)
  tsize = smallest if table_size is None else table_size
  if tsize & (tsize - 1) or tsize < smallest:
    raise ValueError(f"table_size must be a power of two >= {smallest}, got {tsize}")
  check_table_size(tsize, f"the output-site search of x.capacity={capacity} rows x {proposals_per_site(geometry)} "
                   "kernel offsets")
  if max_probes is not None and max_probes < 1:
    raise ValueError(f"max_probes must be >= 1, got {max_probes}")
  probes = tsize if max_probes is None else max_probes
  empty_table = jnp.full((tsize,), EMPTY, jnp.int32)
  num_pairs = capacity * nv
  if num_pairs == 0:
    return ProposalTable(empty_table, empty_table, jnp.int32(0), jnp.asarray(False))

  num_arr, coords_flat, offs_flat = proposal_operands(coords, num, geometry)
  insert_block = 1 if interpret else block_pairs
  grid_i = pl.cdiv(num_pairs, insert_block)
  table, ovf_insert = pl.pallas_call(
      functools.partial(_insert_kernel, block=insert_block, num_pairs=num_pairs, nv=nv, geometry=geometry,
                        batch_size=batch_size, tmask=tsize - 1, max_probes=probes, interpret=interpret,
                        wide=wide_keys),
      out_shape=(out_struct((tsize,), jnp.int32, num_arr, coords), _flags(grid_i, num_arr, coords)),
      grid=(grid_i,),
      input_output_aliases={3: 0},
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="unique_insert_wide" if wide_keys else "unique_insert",
  )(*same_vma(num_arr, coords_flat, offs_flat, empty_table))

  unique, mark_overflow = _keep_first(table, (num_arr, coords_flat, offs_flat) if wide_keys else (),
                                     block=block_slots, num_warps=num_warps, max_probes=probes, geometry=geometry,
                                     batch_size=batch_size, interpret=interpret)
  count = jnp.sum(unique != EMPTY, dtype=jnp.int32)
  return ProposalTable(table, unique, count, (jnp.max(ovf_insert) > 0) | mark_overflow)


def _keep_first(table, site_operands=(), *, block: int, num_warps: int, max_probes: int,
                geometry: ProposalGeometry | None = None, batch_size: int | None = None, interpret: bool):
  """(unique, overflow): the table with every key kept only at its first copy along its probe run. A wide
  table (of proposal indices) comes with site_operands (`proposal_operands`), from which the mark kernel computes
  the sites it compares, the geometry and the batch size."""
  if site_operands and (geometry is None or batch_size is None):
    raise ValueError("a wide table's mark needs the geometry and the batch_size of its proposals")
  tsize = int(table.shape[0])
  block = min(block, tsize)  # both powers of two: block divides T
  grid = tsize // block
  wide = bool(site_operands)
  unique, ovf = pl.pallas_call(
      functools.partial(_mark_kernel, block=block, nv=len(geometry.offsets) if wide else 0, geometry=geometry,
                        batch_size=batch_size, tmask=tsize - 1, max_probes=max_probes, wide=wide),
      out_shape=(out_struct((tsize,), jnp.int32, table), _flags(grid, table)),
      grid=(grid,),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="unique_mark_wide" if wide else "unique_mark",
  )(*same_vma(*site_operands, table) if wide else (table,))
  return unique, jnp.max(ovf) > 0



def _compact_sorted(kept, words, size: int):
  """The kept entries of `words` (int32 [T] each) and their slots, moved to the front of [size] arrays and
  sorted by the words (BIG words and slot T after them). Kept entries must number at most `size`.

  Compaction by a prefix sum and a scatter to distinct positions, then a sort of `size` entries, not T
  (jnp.nonzero's scatter-add of ones collides on every target and was the slowest kernel of a strided
  convolution's site search; sorting the whole table held a sort scratch of T pairs)."""
  tsize = kept.shape[0]
  position = jnp.cumsum(kept, dtype=jnp.int32) - 1
  slots = store_distinct(jnp.full((size,), tsize, jnp.int32), position, jnp.arange(tsize, dtype=jnp.int32), kept)
  packed = [store_distinct(jnp.full((size,), BIG, jnp.int32), position, w, kept) for w in words]
  *packed, slots = lax.sort((*packed, slots), num_keys=len(words))
  return tuple(packed), slots


def _pad_sorted(words, slots, out_capacity: int, tsize: int):
  """Sorted (words, slots) of at most T entries, padded to out_capacity with BIG words and slot T."""
  spare = out_capacity - slots.shape[0]
  return (tuple(jnp.concatenate([w, jnp.full((spare,), BIG, jnp.int32)]) for w in words),
          jnp.concatenate([slots, jnp.full((spare,), tsize, jnp.int32)]))


def _smallest_sorted(unique, count, out_capacity: int, *, interpret: bool):
  """(keys, slots) [out_capacity]: the out_capacity smallest kept keys ascending (BIG after them) and
  their slots (T after them)."""
  tsize = unique.shape[0]
  size = min(out_capacity, tsize)  # at most T keys are kept
  if out_capacity >= tsize or size == 0:  # count <= T: no overflow possible (or nothing to keep)
    kept = unique != EMPTY
  else:  # on overflow keep the keys up to the size-th smallest (kept keys are distinct): exactly `size` of them
    kept = (unique != EMPTY) & (unique <= kth_smallest_if_over(unique, count, k=size, limit=out_capacity,
                                                               interpret=interpret))
  (keys,), slots = _compact_sorted(kept, (unique,), size)
  (keys,), slots = _pad_sorted((keys,), slots, out_capacity, tsize)
  return keys, slots


def _smallest_sorted_sites(words, kept, count, out_capacity: int):
  """_smallest_sorted for wide grids, whose kept entries are sites compared as 4 int32 words (batch, x, y, z:
  lexicographic order is the linear order). kept: bool [T]. Returns (words, slots), BIG words and slot T
  after the kept sites. On overflow the whole table is sorted (a scratch of T entries: kth_smallest_if_over
  needs one int32 key), which only wide grids that overflow pay; the ``lax.cond`` costs these grids a host
  wait per strided convolution."""
  tsize = kept.shape[0]
  size = min(out_capacity, tsize)  # at most T keys are kept

  def sort_everything():  # overflow: only the smallest out_capacity sites are kept
    masked = [jnp.where(kept, w, BIG) for w in words]
    *masked, slots = lax.sort((*masked, jnp.arange(tsize, dtype=jnp.int32)), num_keys=len(words))
    masked = [w[:size] for w in masked]
    # The last word (z < 2**21) is BIG only where nothing was kept.
    return tuple(masked), jnp.where(masked[-1] == BIG, tsize, slots[:size])

  if out_capacity >= tsize:  # count <= T: no overflow possible
    words, slots = _compact_sorted(kept, words, size)
  else:
    words, slots = lax.cond(count <= out_capacity, lambda: _compact_sorted(kept, words, size), sort_everything)
  return _pad_sorted(words, slots, out_capacity, tsize)


def proposal_sites(coords, refs, *, geometry: ProposalGeometry):
  """(batch, ox, oy, oz) int32 [...] each: the output site of proposal index refs (p = j*V + v; XLA ops, as
  proposal_site), garbage where refs is EMPTY."""
  nv = len(geometry.offsets)
  r = jnp.maximum(refs, 0)
  j, v = r // nv, r % nv
  shifted = (coords[j, 1:] + jnp.asarray(geometry.padding, jnp.int32)
             - jnp.asarray(np.asarray(geometry.offsets, np.int32).reshape(-1, 3))[v])
  o = shifted // jnp.asarray(geometry.stride, jnp.int32)
  return (coords[j, 0], o[..., 0], o[..., 1], o[..., 2])


def output_sites(coords, num, proposals: ProposalTable, out_capacity: int, *,
                 geometry: ProposalGeometry, batch_size: int, interpret=False, block_pairs=128, num_warps=1,
                 max_probes=None, wide_keys=False):
  """Stage 2: the sorted output sites and, for every proposal, its output row.

  Args:
    coords, num, geometry, batch_size, interpret: as given to ``dedupe_proposals``.
    proposals: its result. out_capacity: static number of output rows.
    block_pairs / num_warps: pairs per program and Triton warps of the lookup kernel (a lookup block
      runs as long as its slowest lane: small blocks, as in hash_table.py's query).
    max_probes: bound on the lookup probe loops (default T).

  Returns:
    (out_keys, inv, overflow): out_keys int32 [out_capacity], the min(count, out_capacity) smallest
    distinct proposal keys ascending, then int32 max; inv int32 [capacity, V], the position in out_keys
    of proposal (j, v) or -1 (no proposal, or a site beyond out_capacity); overflow: bool scalar, True if
    a lookup ran past its bound (``proposals.overflow`` is not included).
    With wide_keys (as given to dedupe_proposals) out_keys is replaced by out_sites int32 [out_capacity, 4],
    the sites (batch, x, y, z) in linear order, -1 rows after them: there is no int32 key to return.
  """
  return _output_sites(
      coords, num, proposals, out_capacity=int(out_capacity), geometry=_geometry(geometry),
      batch_size=int(batch_size), interpret=bool(interpret), block_pairs=int(block_pairs), num_warps=int(num_warps),
      max_probes=None if max_probes is None else int(max_probes), wide_keys=bool(wide_keys))


@functools.partial(jax.jit, static_argnames=("out_capacity", "geometry", "batch_size", "interpret", "block_pairs",
                                             "num_warps", "max_probes", "wide_keys"))
def _output_sites(coords, num, proposals, *, out_capacity, geometry, batch_size, interpret, block_pairs, num_warps,
                  max_probes, wide_keys):
  coords = jnp.asarray(coords, jnp.int32)
  capacity, nv = check_coords(coords, geometry, batch_size, block_pairs=block_pairs)
  if out_capacity < 0:
    raise ValueError(f"out_capacity must be >= 0, got {out_capacity}")
  if max_probes is not None and max_probes < 1:
    raise ValueError(f"max_probes must be >= 1, got {max_probes}")
  tsize = int(proposals.table.shape[0])
  probes = tsize if max_probes is None else max_probes
  if wide_keys:
    # Sorted by (batch, x, y, z), the linear order, as 4 words: no two-word key arithmetic needed here.
    kept = proposals.unique != EMPTY
    words, out_slots = _smallest_sorted_sites(proposal_sites(coords, proposals.unique, geometry=geometry), kept,
                                              proposals.count, out_capacity)
    out_keys = jnp.where((out_slots < tsize)[:, None], jnp.stack(words, axis=-1), -1)
  else:
    out_keys, out_slots = _smallest_sorted(proposals.unique, proposals.count, out_capacity, interpret=interpret)
  num_pairs = capacity * nv
  if num_pairs == 0:
    return out_keys, jnp.full((capacity, nv), -1, jnp.int32), jnp.asarray(False)
  # Output row of each kept slot (-1 elsewhere; the padding entries, slot T, store nothing).
  slot_rows = store_distinct(jnp.full((tsize,), -1, jnp.int32), out_slots,
                             jnp.arange(out_capacity, dtype=jnp.int32), out_slots < tsize)

  grid = pl.cdiv(num_pairs, block_pairs)
  inv, ovf = pl.pallas_call(
      functools.partial(_lookup_kernel, block=block_pairs, num_pairs=num_pairs, nv=nv, geometry=geometry,
                        batch_size=batch_size, tmask=tsize - 1, max_probes=probes, wide=wide_keys),
      out_shape=(out_struct((num_pairs,), jnp.int32, coords, proposals.table, slot_rows),
                 _flags(grid, coords, proposals.table, slot_rows)),
      grid=(grid,),
      compiler_params=None if interpret else plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="unique_lookup_wide" if wide_keys else "unique_lookup",
  )(*same_vma(*proposal_operands(coords, num, geometry), proposals.table, slot_rows))
  return out_keys, inv.reshape(capacity, nv), jnp.max(ovf) > 0
