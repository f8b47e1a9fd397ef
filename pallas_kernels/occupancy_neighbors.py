"""Submanifold neighbour map of sites ranked in an occupancy map (Pallas -> Triton), no hash table.

Arrays in, arrays out: this module does not import ``jsparse``. A strided convolution (or pool) whose output sites
came from ``occupancy_sites`` has its output rows in rank order: row i is the i-th set bit of the packed
occupancy words of its grid. A submanifold map on those rows then needs no table at all: the neighbour of row i
at offset v is the rank of site coords[i] + offset v when that site's bit is set (and the rank is a row, below
``num``), else -1. Each (row, offset) lane reads one word and its prefix count, both near its row's own word
in the grid (the offsets of a 3^3 kernel span a few words per x-slice), where the hash table's query probes 27
unrelated slots and its build and fill pass over a table first (docs/perf_notes.md, fourteenth session).

One kernel, ``occupancy_query``: flat over lanes ``p = i*V + v``, a program owns a block of consecutive lanes, so
its stores of ``nbr`` are contiguous, and every lane stores (its map entry or -1), so ``nbr`` needs no fill.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.hash_table import MAX_PAIRS, linear_key
from pallas_kernels.occupancy_sites import WORD_BITS, Occupancy, site_rank
from pallas_kernels.out_struct import out_struct, same_vma

__all__ = ["neighbor_map_from_occupancy", "neighbor_map_from_occupancy_reference"]

# Lanes per program and its warps: a lane does a handful of loads and one store, no loop.
BLOCK_PAIRS = 1024
NUM_WARPS = 4


def _check(coords, occupancy: Occupancy, spatial_shape, batch_size: int, offsets) -> tuple[int, int]:
  """(capacity, V) after checking that the words cover the grid and the flat lane index fits int32."""
  if coords.ndim != 2 or coords.shape[1] != 4:
    raise ValueError(f"coords must be [capacity, 4], got {coords.shape}")
  if batch_size < 1:
    raise ValueError(f"batch_size must be >= 1, got {batch_size}")
  sites = batch_size * int(np.prod(spatial_shape))
  if not 0 < sites < 2**31 - WORD_BITS:
    raise ValueError(f"the grid over the batch must have 1 to 2**31 - 33 sites, got {sites}")
  words = -(-sites // WORD_BITS)
  if occupancy.words.shape != (words,) or occupancy.prefix.shape != (words,):
    raise ValueError(f"occupancy must hold {words} words for a grid of {sites} sites, got words "
                     f"{occupancy.words.shape} and prefix {occupancy.prefix.shape}")
  capacity, nv = int(coords.shape[0]), len(offsets)
  if capacity * nv > MAX_PAIRS:
    raise ValueError(f"capacity * len(offsets) must be at most {MAX_PAIRS} (flat int32 lane index), got "
                     f"{capacity} * {nv}")
  return capacity, nv


def _query_kernel(num_ref, coords_ref, offs_ref, words_ref, prefix_ref, nbr_ref, *, block, num_lanes, nv, shape,
                  batch_size):
  p = pl.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)
  in_range = p < num_lanes
  i = lax.div(p, jnp.int32(nv))
  v = p - i * nv
  num = num_ref[0]
  row_ok = in_range & (i < num)
  base = i * 4
  b = plgpu.load(coords_ref.at[base], mask=row_ok, other=0)
  site = [b]
  inside = row_ok & (b >= 0) & (b < batch_size)
  for axis, extent in enumerate(shape):
    c = plgpu.load(coords_ref.at[base + 1 + axis], mask=row_ok, other=0)
    n = c + plgpu.load(offs_ref.at[v * 3 + axis], mask=in_range, other=0)
    inside = inside & (n >= 0) & (n < extent)
    site.append(n)
  rank, hit = site_rank(words_ref, prefix_ref, linear_key(site, shape), inside)
  plgpu.store(nbr_ref.at[p], jnp.where(hit & (rank < num), rank, -1), mask=in_range)


def neighbor_map_from_occupancy(coords, num, occupancy: Occupancy, *, spatial_shape, batch_size: int, offsets,
                                interpret: bool = False) -> jax.Array:
  """nbr int32 [capacity, V]: nbr[i, v] = the rank of site coords[i] + (0, *offsets[v]) in `occupancy` when
  that site is occupied and its rank is below num, else -1 (also for rows i >= num and sites outside the grid).

  coords: int32 [capacity, 4] (batch, x, y, z), rows >= num are padding (any contents); for the result to be
    the submanifold map of these rows, valid row i must be the site of rank i (as occupied_sites leaves them).
  num: int32 scalar (may be traced); occupancy: ``mark_occupancy``'s result on a grid of `spatial_shape` (X, Y,
    Z) over `batch_size` items (static); offsets: static V (dx, dy, dz) tuples.
  """
  return _neighbor_map(coords, num, occupancy, spatial_shape=tuple(int(s) for s in spatial_shape),
                       batch_size=int(batch_size), offsets=tuple(tuple(int(d) for d in o) for o in offsets),
                       interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("spatial_shape", "batch_size", "offsets", "interpret"))
def _neighbor_map(coords, num, occupancy, *, spatial_shape, batch_size, offsets, interpret):
  coords = jnp.asarray(coords, jnp.int32)
  capacity, nv = _check(coords, occupancy, spatial_shape, batch_size, offsets)
  num_lanes = capacity * nv
  if num_lanes == 0:
    return jnp.full((capacity, nv), -1, jnp.int32)
  operands = (jnp.reshape(jnp.asarray(num, jnp.int32), (1,)), coords.reshape(-1),
              jnp.asarray(np.asarray(offsets, np.int32).reshape(-1)), occupancy.words, occupancy.prefix)
  nbr = pl.pallas_call(
      functools.partial(_query_kernel, block=BLOCK_PAIRS, num_lanes=num_lanes, nv=nv, shape=spatial_shape,
                        batch_size=batch_size),
      out_shape=out_struct((num_lanes,), jnp.int32, *operands),
      grid=(pl.cdiv(num_lanes, BLOCK_PAIRS),),
      compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
      interpret=interpret,
      name="occupancy_query",
  )(*same_vma(*operands))
  return nbr.reshape(capacity, nv)


def neighbor_map_from_occupancy_reference(coords, num, occupancy: Occupancy, *, spatial_shape, batch_size: int,
                                          offsets) -> jax.Array:
  """`neighbor_map_from_occupancy` in plain XLA ops (the tests' reference of the kernel's arithmetic)."""
  coords = jnp.asarray(coords, jnp.int32)
  capacity, nv = _check(coords, occupancy, spatial_shape, batch_size, offsets)
  site = coords[:, None, 1:] + jnp.asarray(np.asarray(offsets, np.int32).reshape(nv, 3))[None]
  inside = jnp.all((site >= 0) & (site < jnp.asarray(spatial_shape, jnp.int32)), axis=-1)
  b = coords[:, :1]
  inside &= (b >= 0) & (b < batch_size) & (jnp.arange(capacity)[:, None] < num)
  key = b
  for axis, extent in enumerate(spatial_shape):
    key = key * extent + site[..., axis]
  key = jnp.where(inside, key, 0)
  word = occupancy.words[key >> 5]
  bit = key & (WORD_BITS - 1)
  rank = occupancy.prefix[key >> 5] + lax.population_count(word & (jnp.left_shift(1, bit) - 1))
  hit = inside & ((lax.shift_right_logical(word, bit) & 1) == 1) & (rank < num)
  return jnp.where(hit, rank, -1).astype(jnp.int32)

