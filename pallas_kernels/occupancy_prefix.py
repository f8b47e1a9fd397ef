"""Prefix counts of packed occupancy words (Pallas -> Triton): the number of set bits before each word.

Arrays in, arrays out: this module does not import ``jsparse``. The occupancy maps (occupancy_sites.py,
occupancy_neighbors.py) rank a site by ``prefix[word] + popcount(the word's bits below it)``, so every map needs the
exclusive prefix sum of its words' bit counts. XLA's cumsum of the popcounts ran as five kernels, the slowest
0.11 ms for 11.5M words (a 1M-site LiDAR batch of four 41 x 1600 x 1408 grids, docs/perf_notes.md, fortieth
session); here it is two streaming passes:

1. ``occupancy_chunk_counts``: chunk c's bit count, a program per chunk of ``chunk`` words (tiles of TILE words).
2. ``occupancy_prefix``: chunk c's offset is the sum of the counts of the chunks before it (one masked load of all
   of them: there are at most MAX_CHUNKS), then each tile's exclusive in-tile prefix sum plus the running offset.

The chunk size grows with the words so that there are at most MAX_CHUNKS chunks, which keeps the second pass's
reads of the counts small.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.out_struct import out_struct, same_vma

__all__ = ["prefix_counts", "prefix_counts_reference"]

# Words per tile (one vector of loads, a popcount and a cumsum) and the most chunks (programs) of a pass.
TILE = 4096
MAX_CHUNKS = 1024
NUM_WARPS = 4


def chunk_words(num_words: int) -> int:
  """Words per program: whole tiles, enough of them that at most MAX_CHUNKS programs cover num_words."""
  tiles = -(-num_words // TILE)
  return TILE * max(1, -(-tiles // MAX_CHUNKS))


def _tile(words_ref, c, t, *, chunk, num_words):
  """(indices, in range, bit counts) of tile t of chunk c."""
  idx = c * chunk + t * TILE + jnp.arange(TILE, dtype=jnp.int32)
  ok = idx < num_words
  return idx, ok, lax.population_count(plgpu.load(words_ref.at[idx], mask=ok, other=0))


def _chunk_counts_kernel(words_ref, counts_ref, *, chunk, num_words):
  c = pl.program_id(0)
  total = lax.fori_loop(
      jnp.int32(0), jnp.int32(chunk // TILE),  # int32 bounds: an int32 loop counter under x64 too
      lambda t, acc: acc + jnp.sum(_tile(words_ref, c, t, chunk=chunk, num_words=num_words)[2], dtype=jnp.int32),
      jnp.int32(0))
  plgpu.store(counts_ref.at[c], total)


def _prefix_kernel(words_ref, counts_ref, prefix_ref, *, chunk, num_words, num_chunks, spare):
  c = pl.program_id(0)
  j = jnp.arange(max(2, pl.next_power_of_2(num_chunks)), dtype=jnp.int32)
  offset = jnp.sum(plgpu.load(counts_ref.at[j], mask=j < c, other=0), dtype=jnp.int32)

  def body(t, offset):
    idx, ok, bits = _tile(words_ref, c, t, chunk=chunk, num_words=num_words)
    inclusive = jnp.cumsum(bits, dtype=jnp.int32)
    # Lanes past the words point at the spare slot: in interpret mode a masked store writes back what it read.
    plgpu.store(prefix_ref.at[jnp.where(ok, idx, num_words * spare)], offset + inclusive - bits, mask=ok)
    return offset + jnp.sum(bits, dtype=jnp.int32)

  lax.fori_loop(jnp.int32(0), jnp.int32(chunk // TILE), body, offset)


def prefix_counts(words: jax.Array, *, interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """(prefix, count): int32 [W] the number of set bits in words[:w] for every w, and int32 the total.

  words: int32 [W] (W >= 1). interpret: run the kernels on the CPU.
  """
  return _prefix_counts(words, interpret=bool(interpret))


@functools.partial(jax.jit, static_argnames=("interpret",))
def _prefix_counts(words, *, interpret):
  words = jnp.asarray(words, jnp.int32)
  if words.ndim != 1 or words.shape[0] == 0:
    raise ValueError(f"words must be a non-empty 1-D int32 array, got shape {words.shape}")
  num_words = int(words.shape[0])
  chunk = chunk_words(num_words)
  num_chunks = -(-num_words // chunk)
  params = plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1)
  counts = pl.pallas_call(
      functools.partial(_chunk_counts_kernel, chunk=chunk, num_words=num_words),
      out_shape=out_struct((num_chunks,), jnp.int32, words),
      grid=(num_chunks,),
      compiler_params=params,
      interpret=interpret,
      name="occupancy_chunk_counts",
  )(words)
  spare = int(interpret)
  words, counts = same_vma(words, counts)
  prefix = pl.pallas_call(
      functools.partial(_prefix_kernel, chunk=chunk, num_words=num_words, num_chunks=num_chunks, spare=spare),
      out_shape=out_struct((num_words + spare,), jnp.int32, words, counts),
      grid=(num_chunks,),
      compiler_params=params,
      interpret=interpret,
      name="occupancy_prefix",
  )(words, counts)
  return prefix[:num_words], jnp.sum(counts, dtype=jnp.int32)


def prefix_counts_reference(words: jax.Array) -> tuple[jax.Array, jax.Array]:
  """`prefix_counts` in plain XLA ops (the tests' reference)."""
  per_word = lax.population_count(jnp.asarray(words, jnp.int32))
  ends = jnp.cumsum(per_word, dtype=jnp.int32)
  return ends - per_word, ends[-1]
