"""Output sites of a strided sparse convolution from an occupancy map of the output grid (Pallas -> Triton).

Arrays in, arrays out: this module does not import ``jsparse``. It solves the problem of unique_keys.py (the
distinct proposals of every valid input row and kernel offset, sorted by linear key, and each proposal's
output row) without a hash table and without a sort, where the output grid is small enough to hold one byte
per site: a LiDAR backbone's grids have tens of millions of output sites for about a million inputs, so the
map costs a few tens of bytes per input row (``fits``), and the sorted order of the sites is just their order in
it.

Both kernels run over lanes (j, t), ``per_row`` lanes an input row j (``Lanes``): an input proposes only at the
offsets congruent to its position plus padding modulo the stride (its class), so lane t serves the t-th offset
of row j's class. A 3^3 kernel of stride 2 needs 8 lanes a row instead of 27, a 2^3 kernel of stride 2 one
instead of 8.

1. ``mark_occupancy``:
   * ``occupancy_mark``: every valid proposal stores 1 into the byte of its site (int8 [G], G = batch_size *
     |output grid|, zeroed first). All writers of a byte store the same value, so plain stores in any order
     give the same map: no atomics.
   * XLA: the bytes packed 32 to an int32 word; occupancy_prefix.py: the exclusive prefix sum of the words' bit
     counts. The rank of site k among the occupied sites, which is its output row, is then
     ``prefix[k >> 5] + popcount(word[k >> 5] & ((1 << (k & 31)) - 1))``; ``count`` is the total.
2. ``occupied_sites``, ``occupancy_lookup``: each valid proposal (j, v) computes its site's rank and
   stores ``inv[j, v]`` (the rest of inv is -1 from the start), ``out_keys[rank] = key`` (every proposal of a
   site stores the same key) and ``nbr[rank, v] = j`` (an output reads at most one input per offset). Ranks
   past ``out_capacity`` are dropped, which keeps exactly the out_capacity smallest sites, as the other paths
   do on overflow.

Nothing here can overflow except ``out_capacity`` (the caller compares ``count`` with it), and the result
equals unique_keys.py's and the XLA sort's exactly.
"""
from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.hash_table import linear_key
from pallas_kernels.occupancy_prefix import prefix_counts
from pallas_kernels.out_struct import out_struct, same_vma
from pallas_kernels.unique_keys import (BIG, ProposalGeometry, check_coords, offsets_by_residue, proposal_operands,
                                        proposal_site_at)

__all__ = ["Lanes", "Occupancy", "fits", "lanes_for", "mark_occupancy", "occupied_sites", "site_rank"]

# Bytes of occupancy map allowed per input row: the map is a transient of the forward pass, and at 96 bytes a
# row it stays below the [capacity, V] int32 inverse map the search writes anyway for a 3^3 kernel (108 bytes a
# row), and within a small factor of the hash table it replaces (2 int32 tables of 1.5-3 slots per possible
# proposal: 12-24 bytes per proposal, up to 8 proposals a row for a 3^3 kernel of stride 2).
BYTES_PER_ROW = 96
WORD_BITS = 32
# Lanes per program of both kernels and their warps: each lane does a few loads and stores, no loop.
BLOCK_PAIRS = 1024
NUM_WARPS = 4
# Largest class table (classes x offsets per class) the kernels take; strides with more classes use one class.
MAX_CLASS_TABLE = 4096


class Lanes(NamedTuple):
  """Static: how lanes map to proposals. Lane p serves input row j = p // per_row and offset
  ``table[c * per_row + p % per_row]`` (-1: none), c being row j's class, its position plus padding modulo
  ``class_stride`` per axis, numbered (rx * sy + ry) * sz + rz."""

  class_stride: tuple[int, int, int]
  per_row: int
  table: tuple[int, ...]


def lanes_for(geometry: ProposalGeometry) -> Lanes:
  """The offsets grouped by their residue modulo the stride (an input proposes only at its class's offsets);
  one class holding every offset where the strides make more than MAX_CLASS_TABLE entries."""
  nv = len(geometry.offsets)
  groups = offsets_by_residue(geometry)
  per_row = max((len(g) for g in groups.values()), default=0)
  if math.prod(geometry.stride) * per_row > MAX_CLASS_TABLE:
    return Lanes((1, 1, 1), nv, tuple(range(nv)))
  table = []
  for residue in itertools.product(*(range(s) for s in geometry.stride)):
    offsets = groups.get(residue, [])
    table += offsets + [-1] * (per_row - len(offsets))
  return Lanes(tuple(geometry.stride), per_row, tuple(table))


class Occupancy(NamedTuple):
  """Result of ``mark_occupancy`` (a pytree of arrays: it can cross a jit boundary).

  words: int32 [W], bit b of words[w] set iff output site 32*w + b is proposed.
  prefix: int32 [W], the number of proposed sites before site 32*w.
  count: int32 scalar, the number of proposed (distinct) sites.
  """

  words: jax.Array
  prefix: jax.Array
  count: jax.Array


def grid_sites(geometry: ProposalGeometry, batch_size: int) -> int:
  """G: the sites of the output grid over the batch (one byte of occupancy map each)."""
  return int(batch_size) * math.prod(geometry.out_shape)


def fits(capacity: int, geometry: ProposalGeometry, batch_size: int) -> bool:
  """Whether the occupancy map should serve this search: int32 keys, and at most BYTES_PER_ROW bytes of map per
  input row."""
  sites = grid_sites(geometry, batch_size)
  return 0 < sites < 2**31 - WORD_BITS and sites <= BYTES_PER_ROW * capacity


def _lane_proposal(num, coords_ref, offs_ref, table_ref, p, in_range, *, lanes: Lanes, geometry, batch_size):
  """(j, v, key, ok) of lanes p: input row, offset (0 where none), the linear key of the proposed site, and
  whether that proposal exists (a row outside the batch proposes nothing, as in unique_keys.py, so no key
  addresses outside the map)."""
  j = lax.div(p, jnp.int32(lanes.per_row))
  row_ok = in_range & (j < num)
  cls = jnp.zeros_like(p)
  for axis, s in enumerate(lanes.class_stride):
    if s > 1:
      pos = plgpu.load(coords_ref.at[j * 4 + 1 + axis], mask=row_ok, other=0)
      r = lax.rem(pos + geometry.padding[axis], jnp.int32(s))
      cls = cls * s + jnp.where(r < 0, r + s, r)
  v = plgpu.load(table_ref.at[cls * lanes.per_row + (p - j * lanes.per_row)], mask=row_ok, other=-1)
  has_offset = row_ok & (v >= 0)
  v = jnp.maximum(v, 0)
  site, ok = proposal_site_at(num, coords_ref, offs_ref, j, v, has_offset, geometry=geometry,
                              batch_size=batch_size)
  return j, v, linear_key(site, geometry.out_shape), ok


def _mark_kernel(num_ref, coords_ref, offs_ref, table_ref, occ_in_ref, occ_ref, *, block, num_lanes, lanes,
                 geometry, batch_size, spare):
  del occ_in_ref  # aliased with occ_ref
  p = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
  _, _, key, ok = _lane_proposal(num_ref[0], coords_ref, offs_ref, table_ref, p, p < num_lanes, lanes=lanes,
                                 geometry=geometry, batch_size=batch_size)
  plgpu.store(occ_ref.at[jnp.where(ok, key, spare)], jnp.ones((block,), jnp.int8), mask=ok)


def site_rank(words_ref, prefix_ref, key, ok):
  """(rank, occupied) of the sites with linear `key` on lanes `ok`: the number of occupied sites of smaller key,
  and whether the site's own bit is set (False off `ok`)."""
  word_index = jnp.where(ok, lax.shift_right_logical(key, jnp.int32(5)), 0)
  word = plgpu.load(words_ref.at[word_index], mask=ok, other=0)
  bit = key & (WORD_BITS - 1)
  below = word & (jnp.left_shift(jnp.int32(1), bit) - 1)  # the bits of smaller sites
  rank = plgpu.load(prefix_ref.at[word_index], mask=ok, other=0) + lax.population_count(below)
  return rank, ok & ((lax.shift_right_logical(word, bit) & 1) == 1)


def _lookup_kernel(num_ref, coords_ref, offs_ref, table_ref, words_ref, prefix_ref, inv_in_ref, keys_in_ref,
                   nbr_in_ref, inv_ref, keys_ref, nbr_ref, *, block, num_lanes, nv, lanes, geometry, batch_size,
                   out_capacity, spare_inv, spare_keys):
  del inv_in_ref, keys_in_ref, nbr_in_ref  # aliased with inv_ref, keys_ref, nbr_ref
  p = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
  j, v, key, ok = _lane_proposal(num_ref[0], coords_ref, offs_ref, table_ref, p, p < num_lanes, lanes=lanes,
                                 geometry=geometry, batch_size=batch_size)
  rank, _ = site_rank(words_ref, prefix_ref, key, ok)  # every proposed site is occupied
  kept = ok & (rank < out_capacity)
  plgpu.store(inv_ref.at[jnp.where(kept, j * nv + v, spare_inv)], rank, mask=kept)
  plgpu.store(keys_ref.at[jnp.where(kept, rank, spare_keys)], key, mask=kept)
  plgpu.store(nbr_ref.at[jnp.where(kept, rank * nv + v, spare_keys * nv)], j, mask=kept)


def _bytes_of(quads: jax.Array) -> jax.Array:
  """int8 [4n]: the bytes of int32 [n], in memory order (little-endian on the CPU and the GPU)."""
  return lax.bitcast_convert_type(quads, jnp.int8).reshape(-1)


def _zero_bytes(num_quads: int) -> jax.Array:
  """int8 [4 num_quads] zeros, filled as int32: XLA fills int8 arrays far below bandwidth (docs/perf_notes.md,
  thirteenth session). The zero comes through a barrier so that XLA cannot merge this fill with another int32
  zero fill of the same shape: the multi-output fusion of an int32 array and its int8 view crashes XLA's GPU
  emitter (computation_partitioner.cc "operand_maps.size() == 1", openxla/xla#47373)."""
  zero = lax.optimization_barrier(jnp.zeros((), jnp.int32))
  return _bytes_of(jnp.broadcast_to(zero, (num_quads,)))


def _pack_words(occupied: jax.Array) -> jax.Array:
  """int32 [W]: the 0/1 bytes int8 [32 W] packed, byte b of each group of 32 into bit b. Read as int32 [W, 8]
  quads, which XLA reduces faster than 32 bytes a word; a quad's four 0/1 bytes (at bits 0, 8, 16, 24) fold into
  its low four bits."""
  quads = lax.bitcast_convert_type(occupied.reshape(-1, WORD_BITS // 4, 4), jnp.int32)
  nibbles = (quads | (quads >> 7) | (quads >> 14) | (quads >> 21)) & 0xF
  # Distinct bits: their int32 sum is their bitwise or (bit 31 included, in two's complement).
  return jnp.sum(jnp.left_shift(nibbles, 4 * jnp.arange(WORD_BITS // 4, dtype=jnp.int32)), axis=1,
                 dtype=jnp.int32)


def _lane_operands(coords, num, geometry: ProposalGeometry, lanes: Lanes):
  """proposal_operands plus the class table (int32 [classes * per_row])."""
  return (*proposal_operands(coords, num, geometry), jnp.asarray(lanes.table, jnp.int32))


def _spare(interpret: bool) -> int:
  """Extra trailing elements of the stored arrays: one in interpret mode, where a masked store writes the old
  value back at its masked lanes' index (a scatter in which it could undo a real store to the same index), so
  masked lanes point there; none on the GPU, where masked lanes store nothing (they point at element 0)."""
  return int(interpret)


def _check(coords, geometry: ProposalGeometry, batch_size: int) -> tuple[int, int]:
  """(capacity, V): unique_keys.check_coords, and an output grid whose bytes and words int32 can index."""
  capacity, nv = check_coords(coords, geometry, batch_size)
  sites = grid_sites(geometry, batch_size)
  if not 0 < sites < 2**31 - WORD_BITS:
    raise ValueError(f"the output grid over the batch must have 1 to 2**31 - 33 sites, got {sites}")
  return capacity, nv


@functools.partial(jax.jit, static_argnames=("geometry", "batch_size", "interpret"))
def mark_occupancy(coords, num, *, geometry: ProposalGeometry, batch_size: int,
                   interpret: bool = False) -> Occupancy:
  """Stage 1: which output sites are proposed, packed, with the prefix counts that rank them.

  coords: int32 [capacity, 4] input rows (batch, x, y, z); rows >= num are padding (any contents).
  num: int32 scalar (may be traced): valid rows (one whose batch lies outside [0, batch_size) proposes nothing).
  geometry: the static ProposalGeometry; batch_size: static.
  """
  coords = jnp.asarray(coords, jnp.int32)
  capacity, nv = _check(coords, geometry, batch_size)
  num_words = -(-grid_sites(geometry, batch_size) // WORD_BITS)
  occupied = _zero_bytes(num_words * WORD_BITS // 4 + _spare(interpret))  # the spare byte padded to four
  lanes = lanes_for(geometry)
  num_lanes = capacity * lanes.per_row
  if num_lanes:
    operands = _lane_operands(coords, num, geometry, lanes)
    occupied = pl.pallas_call(
        functools.partial(_mark_kernel, block=BLOCK_PAIRS, num_lanes=num_lanes, lanes=lanes, geometry=geometry,
                          batch_size=batch_size, spare=num_words * WORD_BITS * _spare(interpret)),
        out_shape=out_struct(occupied.shape, jnp.int8, *operands),
        grid=(pl.cdiv(num_lanes, BLOCK_PAIRS),),
        input_output_aliases={4: 0},
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="occupancy_mark",
    )(*same_vma(*operands, occupied))
  words = _pack_words(occupied[:num_words * WORD_BITS])
  return Occupancy(words, *prefix_counts(words, interpret=interpret))


@functools.partial(jax.jit, static_argnames=("out_capacity", "geometry", "batch_size", "interpret"))
def occupied_sites(coords, num, occupancy: Occupancy, *, out_capacity: int, geometry: ProposalGeometry,
                   batch_size: int, interpret: bool = False):
  """Stage 2: the sorted output sites and both maps.

  coords, num, geometry, batch_size, interpret: as given to ``mark_occupancy``; occupancy: its result;
  out_capacity: static output rows.

  Returns (out_keys, inv, nbr): out_keys int32 [out_capacity], the min(count, out_capacity) smallest proposed
  sites' linear keys ascending, then int32 max; inv int32 [capacity, V], the output row of proposal (j, v) or
  -1 (no proposal, or a site beyond out_capacity); nbr int32 [out_capacity, V], the input row read by output i
  at offset v, or -1.
  """
  coords = jnp.asarray(coords, jnp.int32)
  capacity, nv = _check(coords, geometry, batch_size)
  if out_capacity < 0:
    raise ValueError(f"out_capacity must be >= 0, got {out_capacity}")
  if out_capacity * nv >= 2**31:
    raise ValueError("out_capacity * len(offsets) must be < 2**31 (flat int32 map index)")
  spare = _spare(interpret)
  out_keys = jnp.full((out_capacity + spare,), BIG, jnp.int32)
  nbr = jnp.full(((out_capacity + spare) * nv,), -1, jnp.int32)
  inv = jnp.full((capacity * nv + spare,), -1, jnp.int32)  # the lanes store only the proposals that exist
  lanes = lanes_for(geometry)
  num_lanes = capacity * lanes.per_row
  if num_lanes == 0 or out_capacity == 0:
    return (out_keys[:out_capacity], inv[:capacity * nv].reshape(capacity, nv),
            nbr[:out_capacity * nv].reshape(out_capacity, nv))
  operands = (*_lane_operands(coords, num, geometry, lanes), occupancy.words, occupancy.prefix, inv, out_keys, nbr)
  inv, out_keys, nbr = pl.pallas_call(
      functools.partial(_lookup_kernel, block=BLOCK_PAIRS, num_lanes=num_lanes, nv=nv, lanes=lanes,
                        geometry=geometry, batch_size=batch_size, out_capacity=out_capacity,
                        spare_inv=capacity * nv * spare, spare_keys=out_capacity * spare),
      out_shape=tuple(out_struct(a.shape, jnp.int32, *operands) for a in (inv, out_keys, nbr)),
      grid=(pl.cdiv(num_lanes, BLOCK_PAIRS),),
      input_output_aliases={6: 0, 7: 1, 8: 2},
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="occupancy_lookup",
  )(*same_vma(*operands))
  return (out_keys[:out_capacity], inv[:capacity * nv].reshape(capacity, nv),
          nbr[:out_capacity * nv].reshape(out_capacity, nv))
