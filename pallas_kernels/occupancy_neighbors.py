"""Submanifold neighbour map of sites ranked in an occupancy map (Pallas -> Triton), no hash table.

Arrays in, arrays out: this module does not import ``jsparse``. A strided convolution (or pool) whose output sites
came from ``occupancy_sites`` has its output rows in rank order: row i is the i-th set bit of the packed
occupancy words of its grid. A submanifold map on those rows then needs no table at all: the neighbour of row i
at offset v is the rank of site coords[i] + offset v when that site's bit is set (and the rank is a row, below
``num``), else -1. Each (row, offset) lane reads one word and its prefix count, both near its row's own word
in the grid (the offsets of a 3^3 kernel span a few words per x-slice), where the hash table's query probes 27
unrelated slots and its build and fill pass over a table first (docs/perf_notes.md, fourteenth session).

One kernel, ``occupancy_query``: a program owns a tile of consecutive rows by the offsets padded to a power of two,
so its stores of ``nbr`` are contiguous and every (row, offset) stores (its map entry or -1): ``nbr`` needs no
fill. The tile also gives each row's neighbour bitmask, a sum across its offsets, which the kernel stores too
(``neighbor_map_and_masks``): the masked plan sorts rows by it, and would otherwise read the whole map back to
build it (docs/perf_notes.md, fortieth session).

Rows in any order (a network's input, whose rows nothing ranked): ``rows_occupancy`` sets the bits of the rows'
own sites in the packed words directly (``occupancy_mark_bits``: ``atomic_or``, which lowers to Triton's integer
OR, where occupancy_sites.py's strided search stores a byte per site and packs the bytes), occupancy_prefix.py
adds the prefix counts, and one more kernel, ``occupancy_rank_rows``, stores each valid row at its site's rank,
``rows_by_rank``; the query then answers ``rows_by_rank[rank]``. The words and prefix counts take a quarter of a byte
per grid site, so it serves grids of at most ``4 * BYTES_PER_OFFSET * V`` sites per row (``rows_fit``); sparser
grids keep the hash table. Interpret mode has no atomics on arrays: the mark then runs one lane per program with a
plain load, OR and store (grid steps run one after another, so that is exact), as hash_table.py's build does.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gemm_plan import MASK_BITS
from pallas_kernels.hash_table import MAX_PAIRS, linear_key
from pallas_kernels.occupancy_prefix import prefix_counts, prefix_counts_reference
from pallas_kernels.occupancy_sites import WORD_BITS, Occupancy, site_rank
from pallas_kernels.out_struct import out_struct, same_vma

__all__ = ["neighbor_map_and_masks", "neighbor_map_from_occupancy", "neighbor_map_from_occupancy_reference", "rows_fit",
           "rows_occupancy", "rows_occupancy_reference"]

# Lanes per program and its warps: a lane does a handful of loads and one store, no loop.
BLOCK_PAIRS = 1024
NUM_WARPS = 4
# Bytes of occupancy map (words and prefix counts, a quarter of a byte per grid site) allowed per row and kernel
# offset for rows in any order: 8, so the map stays within twice the int32 [capacity, V] map it is built for (a
# 1M-row sphere shell on a 512^3 grid needs 33 bytes a row, a 1M-site LiDAR batch of four 41 x 1600 x 1408 grids
# about 90, against the 3^3 map's 108; SECOND's 108k-site "100k" scan on one such grid, 213, is just within the
# bound of 216, and 100k rows would not be).
BYTES_PER_OFFSET = 8


def _grid_words(spatial_shape, batch_size: int) -> tuple[int, int]:
  """(sites, words) of the grid over the batch, after checking that int32 keys and word indices name them."""
  sites = int(batch_size) * int(np.prod(spatial_shape))
  if not 0 < sites < 2**31 - WORD_BITS:
    raise ValueError(f"the grid over the batch must have 1 to 2**31 - 33 sites, got {sites}")
  return sites, -(-sites // WORD_BITS)


def _check(coords, occupancy: Occupancy, spatial_shape, batch_size: int, offsets) -> tuple[int, int]:
  """(capacity, V) after checking that the words cover the grid and the flat lane index fits int32."""
  if coords.ndim != 2 or coords.shape[1] != 4:
    raise ValueError(f"coords must be [capacity, 4], got {coords.shape}")
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  sites, words = _grid_words(spatial_shape, batch_size)
  if occupancy.words.shape != (words,) or occupancy.prefix.shape != (words,):
    raise ValueError(f"occupancy must hold {words} words for a grid of {sites} sites, got words "
                     f"{occupancy.words.shape} and prefix {occupancy.prefix.shape}")
  capacity, nv = int(coords.shape[0]), len(offsets)
  if capacity * nv > MAX_PAIRS:
    raise ValueError(f"capacity * len(offsets) must be at most {MAX_PAIRS} (flat int32 lane index), got "
                     f"{capacity} * {nv}")
  return capacity, nv


def _query_kernel(num_ref, coords_ref, offs_ref, words_ref, prefix_ref, *refs, rows, width, capacity, nv, shape,
                  batch_size, spare):
  rows_ref, nbr_ref, masks_ref = refs if len(refs) == 3 else (None, *refs)  # rows_by_rank, for unranked rows
  i = pl.program_id(0) * rows + jnp.arange(rows, dtype=jnp.int32)
  v = jnp.arange(width, dtype=jnp.int32)
  row_in, col_ok = i < capacity, v < nv
  num = num_ref[0]
  (b, *own), inside = _site_of_row(num, coords_ref, i, row_in, shape=shape, batch_size=batch_size)
  site, inside = [b[:, None]], inside[:, None] & col_ok[None, :]
  for axis, extent in enumerate(shape):
    n = own[axis][:, None] + plgpu.load(offs_ref.at[v * 3 + axis], mask=col_ok, other=0)[None, :]
    inside = inside & (n >= 0) & (n < extent)
    site.append(n)
  rank, hit = site_rank(words_ref, prefix_ref, linear_key(site, shape), inside)
  hit = hit & (rank < num)
  if rows_ref is not None:
    rank = plgpu.load(rows_ref.at[rank], mask=hit, other=-1)
  stored = row_in[:, None] & col_ok[None, :]
  # Masked lanes (columns past V, rows past capacity) point at the spare slot: in interpret mode a masked store
  # writes back what it read, which at a real lane's slot could undo that lane's store.
  p = jnp.where(stored, i[:, None] * nv + v[None, :], capacity * nv * spare)
  plgpu.store(nbr_ref.at[p], jnp.where(hit, rank, -1), mask=stored)
  # The row's neighbour bitmask (the masked plan's sort key), its first MASK_BITS offsets.
  weights = jnp.where(v < MASK_BITS, jnp.left_shift(jnp.int32(1), jnp.minimum(v, MASK_BITS - 1)), 0)
  masks = jnp.sum(jnp.where(hit, weights[None, :], 0), axis=1, dtype=jnp.int32)
  plgpu.store(masks_ref.at[jnp.where(row_in, i, capacity * spare)], masks, mask=row_in)


def _site_of_row(num, coords_ref, i, in_range, *, shape, batch_size):
  """(site, inside) of rows i: their (batch, x, y, z) and whether it is a valid row's site inside the grid."""
  row_ok = in_range & (i < num)
  b = plgpu.load(coords_ref.at[i * 4], mask=row_ok, other=0)
  site, inside = [b], row_ok & (b >= 0) & (b < batch_size)
  for axis, extent in enumerate(shape):
    c = plgpu.load(coords_ref.at[i * 4 + 1 + axis], mask=row_ok, other=0)
    inside = inside & (c >= 0) & (c < extent)
    site.append(c)
  return site, inside


def _rank_rows_kernel(num_ref, coords_ref, words_ref, prefix_ref, rows_ref, *, block, capacity, shape, batch_size,
                      spare):
  i = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
  site, inside = _site_of_row(num_ref[0], coords_ref, i, i < capacity, shape=shape, batch_size=batch_size)
  rank, hit = site_rank(words_ref, prefix_ref, linear_key(site, shape), inside)
  plgpu.store(rows_ref.at[jnp.where(hit, rank, spare)], i, mask=hit)


def neighbor_map_from_occupancy(coords, num, occupancy: Occupancy, *, spatial_shape, batch_size: int, offsets,
                                rows_by_rank=None, interpret: bool = False) -> jax.Array:
  """nbr int32 [capacity, V]: nbr[i, v] = the rank of site coords[i] + (0, *offsets[v]) in `occupancy` (or, with
  rows_by_rank, the row of that rank) when that site is occupied and its rank is below num, else -1 (also for
  rows i >= num, rows whose own site lies outside the grid or the batch, and sites outside the grid).

  coords: int32 [capacity, 4] (batch, x, y, z), rows >= num are padding (any contents); for the result to be
    the submanifold map of these rows, valid row i must be the site of rank i (as occupied_sites leaves them),
    or rows_by_rank must be given.
  num: int32 scalar (may be traced); occupancy: ``mark_occupancy``'s result on a grid of `spatial_shape` (X, Y,
    Z) over `batch_size` items (static); offsets: static V (dx, dy, dz) tuples.
  rows_by_rank: None, or int32 [capacity] (``rows_occupancy``'s): the row whose site has each rank, for rows in
    any order.
  """
  return neighbor_map_and_masks(coords, num, occupancy, spatial_shape=spatial_shape, batch_size=batch_size,
                                offsets=offsets, rows_by_rank=rows_by_rank, interpret=interpret)[0]


def neighbor_map_and_masks(coords, num, occupancy: Occupancy, *, spatial_shape, batch_size: int, offsets,
                           rows_by_rank=None, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """(nbr, masks): `neighbor_map_from_occupancy`'s map and int32 [capacity] each row's neighbour bitmask, bit v
  set where nbr[i, v] >= 0 for the first MASK_BITS offsets (0 for rows >= num): the key the masked plan sorts rows
  by (gemm_plan.row_order), written by the same kernel, so the plan need not read the map back for it."""
  return _neighbor_map(coords, num, occupancy, rows_by_rank, spatial_shape=tuple(int(s) for s in spatial_shape),
                       batch_size=int(batch_size), offsets=tuple(tuple(int(d) for d in o) for o in offsets),
                       interpret=bool(interpret))


def rows_fit(capacity: int, num_offsets: int, spatial_shape, batch_size: int) -> bool:
  """Whether `rows_occupancy` should serve a map of V = num_offsets offsets over `capacity` rows: int32 keys, and
  at most BYTES_PER_OFFSET * V bytes of occupancy map (4 * BYTES_PER_OFFSET * V grid sites) per row."""
  sites = int(batch_size) * int(np.prod(spatial_shape))
  return 0 < sites < 2**31 - WORD_BITS and sites <= 4 * BYTES_PER_OFFSET * max(1, num_offsets) * capacity


def _mark_bits_kernel(num_ref, coords_ref, words_in_ref, words_ref, *, block, capacity, shape, batch_size,
                      interpret):
  del words_in_ref  # aliased with words_ref
  i = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
  site, inside = _site_of_row(num_ref[0], coords_ref, i, i < capacity, shape=shape, batch_size=batch_size)
  key = linear_key(site, shape)
  word = jnp.where(inside, lax.shift_right_logical(key, jnp.int32(5)), 0)
  bit = jnp.left_shift(jnp.int32(1), key & (WORD_BITS - 1))
  if interpret:  # one lane per program: a plain read-modify-write is exact
    old = plgpu.load(words_ref.at[word], mask=inside, other=0)
    plgpu.store(words_ref.at[word], old | bit, mask=inside)
  else:
    plgpu.atomic_or(words_ref, (word,), bit, mask=inside)


def rows_occupancy(coords, num, *, spatial_shape, batch_size: int, interpret: bool = False):
  """(occupancy, rows_by_rank) of rows in any order: the occupancy map of the valid rows' own sites and int32
  [capacity], the row at each rank (entries from occupancy.count up are never written: no occupied site has
  such a rank). coords, num: as for ``neighbor_map_from_occupancy``, sites distinct (a repeated site's rank
  gets one of its rows)."""
  return _rows_occupancy(coords, num, spatial_shape=tuple(int(s) for s in spatial_shape),
                         batch_size=int(batch_size), interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("spatial_shape", "batch_size", "interpret"))
def _rows_occupancy(coords, num, *, spatial_shape, batch_size, interpret):
  coords = jnp.asarray(coords, jnp.int32)
  capacity = int(coords.shape[0])
  words = jnp.zeros((_grid_words(spatial_shape, batch_size)[1],), jnp.int32)
  num = jnp.reshape(jnp.asarray(num, jnp.int32), (1,))
  if capacity:
    block = 1 if interpret else BLOCK_PAIRS
    words = pl.pallas_call(
        functools.partial(_mark_bits_kernel, block=block, capacity=capacity, shape=spatial_shape,
                          batch_size=batch_size, interpret=interpret),
        out_shape=out_struct(words.shape, jnp.int32, num, coords),
        grid=(pl.cdiv(capacity, block),),
        input_output_aliases={2: 0},
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret,
        name="occupancy_mark_bits",
    )(*same_vma(num, coords.reshape(-1), words))
  occupancy = Occupancy(words, *prefix_counts(words, interpret=interpret))
  if capacity == 0:
    return occupancy, jnp.zeros((0,), jnp.int32)
  spare = int(interpret)  # interpret mode: masked lanes point at one extra slot (see occupancy_sites._spare)
  operands = (num, coords.reshape(-1), occupancy.words, occupancy.prefix)
  rows = pl.pallas_call(
      functools.partial(_rank_rows_kernel, block=BLOCK_PAIRS, capacity=capacity, shape=spatial_shape,
                        batch_size=batch_size, spare=capacity * spare),
      out_shape=out_struct((capacity + spare,), jnp.int32, *operands),
      grid=(pl.cdiv(capacity, BLOCK_PAIRS),),
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="occupancy_rank_rows",
  )(*same_vma(*operands))
  return occupancy, rows[:capacity]


@functools.partial(jax.jit, static_argnames=("spatial_shape", "batch_size", "offsets", "interpret"))
def _neighbor_map(coords, num, occupancy, rows_by_rank, *, spatial_shape, batch_size, offsets, interpret):
  coords = jnp.asarray(coords, jnp.int32)
  capacity, nv = _check(coords, occupancy, spatial_shape, batch_size, offsets)
  if rows_by_rank is not None and jnp.shape(rows_by_rank) != (capacity,):
    raise ValueError(f"rows_by_rank must have shape ({capacity},), one row per rank, got {jnp.shape(rows_by_rank)}")
  if capacity * nv == 0:
    return jnp.full((capacity, nv), -1, jnp.int32), jnp.zeros((capacity,), jnp.int32)
  operands = (jnp.reshape(jnp.asarray(num, jnp.int32), (1,)), coords.reshape(-1),
              jnp.asarray(np.asarray(offsets, np.int32).reshape(-1)), occupancy.words, occupancy.prefix)
  if rows_by_rank is not None:
    operands += (jnp.asarray(rows_by_rank, jnp.int32),)
  width = max(2, pl.next_power_of_2(nv))
  rows = max(1, BLOCK_PAIRS // width)
  spare = int(interpret)  # one extra slot of each output for masked lanes (see _query_kernel)
  nbr, masks = pl.pallas_call(
      functools.partial(_query_kernel, rows=rows, width=width, capacity=capacity, nv=nv, shape=spatial_shape,
                        batch_size=batch_size, spare=spare),
      out_shape=(out_struct((capacity * nv + spare,), jnp.int32, *operands),
                 out_struct((capacity + spare,), jnp.int32, *operands)),
      grid=(pl.cdiv(capacity, rows),),
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="occupancy_query",
  )(*same_vma(*operands))
  return nbr[:capacity * nv].reshape(capacity, nv), masks[:capacity]


def neighbor_map_from_occupancy_reference(coords, num, occupancy: Occupancy, *, spatial_shape, batch_size: int,
                                          offsets, rows_by_rank=None) -> jax.Array:
  """`neighbor_map_from_occupancy` in plain XLA ops (the tests' reference of the kernel's arithmetic)."""
  coords = jnp.asarray(coords, jnp.int32)
  capacity, nv = _check(coords, occupancy, spatial_shape, batch_size, offsets)
  site = coords[:, None, 1:] + jnp.asarray(np.asarray(offsets, np.int32).reshape(nv, 3))[None]
  inside = jnp.all((site >= 0) & (site < jnp.asarray(spatial_shape, jnp.int32)), axis=-1)
  b = coords[:, :1]
  own = coords[:, None, 1:]
  inside &= (b >= 0) & (b < batch_size) & (jnp.arange(capacity)[:, None] < num)
  inside &= jnp.all((own >= 0) & (own < jnp.asarray(spatial_shape, jnp.int32)), axis=-1)
  key = b
  for axis, extent in enumerate(spatial_shape):
    key = key * extent + site[..., axis]
  key = jnp.where(inside, key, 0)
  word = occupancy.words[key >> 5]
  bit = key & (WORD_BITS - 1)
  rank = occupancy.prefix[key >> 5] + lax.population_count(word & (jnp.left_shift(1, bit) - 1))
  hit = inside & ((lax.shift_right_logical(word, bit) & 1) == 1) & (rank < num)
  if rows_by_rank is not None:
    rank = jnp.asarray(rows_by_rank, jnp.int32)[jnp.where(hit, rank, 0)]
  return jnp.where(hit, rank, -1).astype(jnp.int32)


def rows_occupancy_reference(coords, num, *, spatial_shape, batch_size: int):
  """`rows_occupancy` in plain XLA ops (the tests' reference): the words and prefix counts of the valid rows'
  sites inside the grid, and rows_by_rank with -1 from occupancy.count up."""
  coords = jnp.asarray(coords, jnp.int32)
  capacity = coords.shape[0]
  shape = jnp.asarray((batch_size,) + tuple(spatial_shape), jnp.int32)
  inside = jnp.all((coords >= 0) & (coords < shape), axis=1) & (jnp.arange(capacity) < num)
  key = coords[:, 0]
  for axis, extent in enumerate(spatial_shape):
    key = key * extent + coords[:, 1 + axis]
  num_words = _grid_words(spatial_shape, batch_size)[1]
  occupied = jnp.zeros((num_words * WORD_BITS,), bool).at[jnp.where(inside, key, num_words * WORD_BITS)].set(
      True, mode="drop")
  bits = occupied.reshape(num_words, WORD_BITS).astype(jnp.uint32) << jnp.arange(WORD_BITS, dtype=jnp.uint32)
  words = lax.bitcast_convert_type(jnp.sum(bits, axis=1, dtype=jnp.uint32), jnp.int32)
  prefix, count = prefix_counts_reference(words)
  rank = prefix[key >> 5] + lax.population_count(words[key >> 5] & (jnp.left_shift(1, key & 31) - 1))
  rows = jnp.full((capacity,), -1, jnp.int32).at[jnp.where(inside, rank, capacity)].set(
      jnp.arange(capacity, dtype=jnp.int32), mode="drop")
  return Occupancy(words, prefix, count), rows

