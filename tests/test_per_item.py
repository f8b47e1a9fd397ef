"""jsparse.per_item: per-batch-item sums and their broadcast, against numpy on random tensors with padding."""
import jax.numpy as jnp
import numpy as np
import pytest

import jsparse
from jsparse import per_item
from reference import random_sparse


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_per_item_sums_match_numpy(seed):
  rng = np.random.default_rng(seed)
  x = random_sparse(rng, (5, 6, 4), 3, batch_size=3, pad=7)
  n = int(x.num)
  items = np.asarray(x.coords[:n, 0])
  values = rng.standard_normal((x.capacity, 2, 3)).astype(np.float32)
  one_hot = per_item.item_one_hot(x)
  sums = np.asarray(per_item.sum_per_item(one_hot, jnp.asarray(values)))
  want = np.zeros((3, 2, 3))
  np.add.at(want, items, values[:n])  # padding rows (and their nonzero values) must not count
  np.testing.assert_allclose(sums, want, rtol=1e-6, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(per_item.count_per_item(one_hot)), np.bincount(items, minlength=3))
  table = rng.standard_normal((3, 4)).astype(np.float32)
  rows = np.asarray(per_item.per_row(one_hot, jnp.asarray(table)))
  np.testing.assert_array_equal(rows[:n], table[items])
  np.testing.assert_array_equal(rows[n:], 0)


@pytest.mark.parametrize("batch_size", [3, 12])
@pytest.mark.parametrize("capacity", [per_item.SUM_CHUNK_ROWS, 2 * per_item.SUM_CHUNK_ROWS + 276])
def test_per_item_sums_over_several_chunks(capacity, batch_size):
  """The sums run per chunk of SUM_CHUNK_ROWS rows, then over the chunks: a capacity of whole chunks and one
  that needs zero rows appended, items interleaved across chunk boundaries, padding rows holding garbage, and
  +inf / -inf / NaN in item 2 only, which must not reach the other items (float64 numpy reference); a few
  items and many."""
  rng = np.random.default_rng(capacity)
  n = capacity - 37
  items = rng.integers(0, batch_size, n)
  coords = np.zeros((capacity, 4), np.int32)
  coords[:n, 0] = items
  x = jsparse.SparseTensor(jnp.asarray(coords), jnp.zeros((capacity, 1)), jnp.asarray(n, jnp.int32), (4, 4, 4),
                           batch_size)
  one_hot = per_item.item_one_hot(x)
  values = rng.standard_normal((capacity, 5)).astype(np.float32) * 100
  values[n:] = np.nan  # padding: must not count
  rows2 = np.flatnonzero(items == 2)
  values[rows2[0], 0], values[rows2[1], 1], values[rows2[2], 2] = np.inf, -np.inf, np.nan
  values[rows2[3], 3], values[rows2[4], 3] = np.inf, -np.inf  # inf - inf: NaN
  sums = np.asarray(per_item.sum_per_item(one_hot, jnp.asarray(values)))
  want = np.zeros((batch_size, 5))
  with np.errstate(invalid="ignore"):  # inf + -inf in the reference
    np.add.at(want, items, values[:n].astype(np.float64))
  others = np.arange(batch_size) != 2
  np.testing.assert_allclose(sums[others], want[others], rtol=1e-5, atol=1e-3)
  np.testing.assert_array_equal(np.isposinf(sums[2]), np.isposinf(want[2]))
  np.testing.assert_array_equal(np.isneginf(sums[2]), np.isneginf(want[2]))
  np.testing.assert_array_equal(np.isnan(sums[2]), np.isnan(want[2]))
  np.testing.assert_allclose(sums[2, 4], want[2, 4], rtol=1e-5)
  np.testing.assert_array_equal(np.asarray(per_item.count_per_item(one_hot)),
                                np.bincount(items, minlength=batch_size))


def test_non_finite_counts_decode_per_chunk():
  """The flag column holds n_up + FLAG_DOWN * n_down per chunk: a chunk whose every row is +inf must read as +inf
  (not as a -inf count), +inf and -inf of one item in different chunks as NaN, and the chunk size must keep the
  encoding exact (float32 integers below 2**24, a NaN's flag exact in TF32)."""
  chunk = per_item.SUM_CHUNK_ROWS
  assert chunk < per_item.FLAG_DOWN and per_item.FLAG_DOWN * (chunk + 1) < 2**24
  assert per_item.FLAG_DOWN + 1 <= 2**11  # a NaN's flag is exact in TF32's 11-bit significand too
  capacity, batch_size = 3 * chunk, 2
  items = np.zeros(capacity, np.int64)
  items[chunk:] = np.arange(2 * chunk) % 2  # chunk 0: item 0 only; chunks 1 and 2: both items
  coords = np.zeros((capacity, 4), np.int32)
  coords[:, 0] = items
  x = jsparse.SparseTensor(jnp.asarray(coords), jnp.zeros((capacity, 1)), jnp.asarray(capacity, jnp.int32),
                           (4, 4, 4), batch_size)
  values = np.random.default_rng(9).standard_normal((capacity, 6)).astype(np.float32)
  values[:chunk, 0] = np.inf  # a whole chunk of +inf: n_up = SUM_CHUNK_ROWS
  values[chunk + 1, 1], values[2 * chunk + 3, 1] = np.inf, -np.inf  # item 1, two chunks: NaN
  values[chunk + 2, 2] = np.nan  # item 0: NaN
  values[:chunk, 3] = -np.inf  # a whole chunk of -inf: item 0's -inf
  values[chunk, 3] = np.inf  # and a +inf of item 0 in the next chunk: NaN
  values[2 * chunk + 5, 4] = -np.inf  # item 1: -inf
  sums = np.asarray(per_item.sum_per_item(per_item.item_one_hot(x), jnp.asarray(values)))
  want = np.zeros((batch_size, 6))
  with np.errstate(invalid="ignore"):
    np.add.at(want, items, values.astype(np.float64))
  for check in (np.isposinf, np.isneginf, np.isnan):
    np.testing.assert_array_equal(check(sums), check(want), err_msg=check.__name__)
  assert np.isposinf(sums[0, 0]) and np.isnan(sums[1, 1]) and np.isneginf(sums[1, 4])
  finite = np.isfinite(want)
  np.testing.assert_allclose(sums[finite], want[finite], rtol=1e-5, atol=1e-4)


def test_global_pool_gradients_stay_row_sized():
  """global_pool's gradients need O(rows x C) memory, not O(rows x batch x C): a masked max over a
  [rows, batch, C] broadcast (once tried for "max") materialises that array in its gradient."""
  import jax

  n, b, c = 20_000, 32, 16
  coords = np.stack([np.arange(n) % b, np.arange(n) // b % 32, np.arange(n) // b // 32, np.zeros(n)], -1)
  x = jsparse.SparseTensor(jnp.asarray(coords, jnp.int32), jnp.ones((n, c), jnp.float32), jnp.asarray(n, jnp.int32),
                           (32, 32, 32), b)
  for reduce in ("max", "mean", "sum"):
    loss = lambda f: jnp.sum(jsparse.global_pool(x.replace(feats=f), reduce) ** 2)  # noqa: E731
    temp = jax.jit(jax.grad(loss)).lower(x.feats).compile().memory_analysis().temp_size_in_bytes
    assert temp < n * b * c * 4 / 4, (reduce, temp)
