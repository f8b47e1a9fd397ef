"""Tests for pallas_kernels/occupancy_prefix.py (prefix counts of packed occupancy words).

CPU: the interpret-mode kernels against numpy (hypothesis over lengths and bit densities, words with the sign bit
set, one tile, several tiles per chunk and the chunk count at its bound), the XLA reference, the argument checks,
and Triton lowering. GPU (``-m gpu``): an 11.5M-word array (a 1M-site LiDAR batch's grid) against the reference.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pallas_kernels import occupancy_prefix
from pallas_kernels.occupancy_prefix import prefix_counts, prefix_counts_reference

_on_gpu = jax.default_backend() == "gpu"


def _words(rng, n: int, density: float) -> np.ndarray:
  """int32 [n] words whose bits are set with probability `density` (bit 31 included: negative words)."""
  bits = rng.random((n, 32)) < density
  return (bits.astype(np.uint64) << np.arange(32, dtype=np.uint64)).sum(axis=1).astype(np.uint32).view(np.int32)


def _numpy_prefix(words: np.ndarray) -> tuple[np.ndarray, int]:
  per_word = np.array([bin(int(w) & 0xFFFFFFFF).count("1") for w in words], np.int64)
  return (np.cumsum(per_word) - per_word).astype(np.int32), int(per_word.sum())


def _check(words: np.ndarray) -> None:
  prefix, count = prefix_counts(jnp.asarray(words), interpret=True)
  ref_prefix, ref_count = prefix_counts_reference(jnp.asarray(words))
  expect, total = _numpy_prefix(words)
  np.testing.assert_array_equal(prefix, expect)
  np.testing.assert_array_equal(ref_prefix, expect)
  assert int(count) == int(ref_count) == total


@pytest.mark.parametrize("n,density", [(1, 0.5), (37, 1.0), (4096, 0.03), (4097, 0.5), (9000, 0.0)])
def test_prefix_counts_match_numpy(n, density):
  # One word, full words (-1), exactly one tile, a tile and a word, an all-zero map.
  _check(_words(np.random.default_rng(n), n, density))


@settings(max_examples=20, deadline=None)  # every length compiles the kernels anew
@given(n=st.integers(1, 3000), density=st.sampled_from([0.0, 0.01, 0.3, 1.0]), seed=st.integers(0, 2**31))
def test_prefix_counts_property(n, density, seed):
  _check(_words(np.random.default_rng(seed), n, density))


@pytest.mark.parametrize("n", [1, 63, 64, 65, 257, 1000])
def test_several_tiles_per_chunk(monkeypatch, request, n):
  # Tiles of 8 words and at most 4 chunks: a chunk then loops over several tiles, carrying its running offset,
  # and the chunks' offsets add the counts of all the chunks before them. (The jitted entry point caches by shape,
  # not by the module's constants: its cache is cleared on the way in and out, so that a length traced elsewhere
  # with the real constants does not stand in for this trace, nor this one for a later caller.)
  monkeypatch.setattr(occupancy_prefix, "TILE", 8)
  monkeypatch.setattr(occupancy_prefix, "MAX_CHUNKS", 4)
  occupancy_prefix._prefix_counts.clear_cache()
  request.addfinalizer(occupancy_prefix._prefix_counts.clear_cache)
  assert occupancy_prefix.chunk_words(1000) == 256 and occupancy_prefix.chunk_words(33) == 16
  words = _words(np.random.default_rng(n), n + 11, 0.4)
  _check(words)


def test_chunk_words_bounds_the_programs():
  for n in (1, 4096, 4097, 4096 * 1024, 4096 * 1024 + 1, 11_534_336, 2**26):
    chunk = occupancy_prefix.chunk_words(n)
    assert chunk % occupancy_prefix.TILE == 0 and -(-n // chunk) <= occupancy_prefix.MAX_CHUNKS
    assert chunk == occupancy_prefix.TILE or -(-n // (chunk - occupancy_prefix.TILE)) > occupancy_prefix.MAX_CHUNKS


def test_checks_name_the_argument():
  with pytest.raises(ValueError, match="words must be a non-empty 1-D"):
    prefix_counts(jnp.zeros((0,), jnp.int32), interpret=True)
  with pytest.raises(ValueError, match="words must be a non-empty 1-D"):
    prefix_counts(jnp.zeros((4, 4), jnp.int32), interpret=True)


def test_triton_lowering():
  from triton_lowering import lower_for_cuda

  text = lower_for_cuda(lambda w: prefix_counts(w), jnp.zeros((10_000,), jnp.int32))
  assert text.count("__gpu$xla.gpu.triton") == 2
  assert "occupancy_chunk_counts" in text and "occupancy_prefix" in text


@pytest.mark.gpu
@pytest.mark.skipif(not _on_gpu, reason="needs a CUDA GPU")
def test_gpu_prefix_counts_match_the_reference():
  n = 11_534_336  # the words of four 41 x 1600 x 1408 grids, with 1M sites set
  sites = np.random.default_rng(3).choice(n * 32, size=1_000_000, replace=False)
  words = np.zeros(n, np.uint32)
  np.bitwise_or.at(words, sites >> 5, (np.uint32(1) << (sites & 31).astype(np.uint32)))
  words = jnp.asarray(words.view(np.int32))
  prefix, count = jax.jit(prefix_counts)(words)
  ref_prefix, ref_count = jax.jit(prefix_counts_reference)(words)
  np.testing.assert_array_equal(prefix, ref_prefix)
  assert int(count) == int(ref_count) > 0
