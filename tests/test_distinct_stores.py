"""store_distinct (plain-store scatters with skipped updates) against NumPy, and the int32 bound it states."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import jsparse
from pallas_kernels.distinct_stores import store_distinct


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**16), size=st.integers(1, 40), n=st.integers(0, 60))
def test_store_distinct_matches_numpy(seed, size, n):
  # Kept updates go to distinct positions; skipped ones hold any index at all (in range, negative, huge) and
  # must change nothing: the old `size + i` misses, wrapped past int32, landed inside through the negative rule.
  rng = np.random.default_rng(seed)
  keep = rng.random(n) < 0.5
  kept = int(keep.sum())
  if kept > size:
    keep[np.flatnonzero(keep)[size:]] = False
  index = rng.integers(-2**31, 2**31 - 1, n, dtype=np.int64).astype(np.int32)
  index[keep] = rng.permutation(size)[:int(keep.sum())]
  values = rng.integers(0, 1000, n).astype(np.int32)
  dest = np.full(size, -7, np.int32)
  expected = dest.copy()
  expected[index[keep]] = values[keep]
  got = jax.jit(store_distinct)(jnp.asarray(dest), jnp.asarray(index), jnp.asarray(values), jnp.asarray(keep))
  np.testing.assert_array_equal(np.asarray(got), expected)


def test_store_distinct_tuple_index_skips_on_its_axis():
  # A map transpose: nbr[inv[j, v], v] = j where inv[j, v] >= 0 (the skipped entries are -1, which NumPy's rule
  # would send to the last row).
  inv = np.array([[1, -1], [-1, 0], [0, 2]], np.int32)
  src = np.broadcast_to(np.arange(3, dtype=np.int32)[:, None], inv.shape)
  got = store_distinct(jnp.full((3, 2), -1, jnp.int32), (jnp.asarray(inv), jnp.arange(2)[None, :]),
                       jnp.asarray(src), jnp.asarray(inv >= 0))
  np.testing.assert_array_equal(np.asarray(got), [[2, 1], [0, -1], [-1, 2]])
  # The offset-major lists of pair_lists_reference: the skipped component is the second one.
  got = store_distinct(jnp.zeros((2, 3), jnp.int32), (jnp.arange(2)[:, None], jnp.asarray([[0, 5, 1], [-1, 0, 9]])),
                       jnp.asarray([[1, 2, 3], [4, 5, 6]]), jnp.asarray([[True, False, True], [False, True, False]]),
                       axis=1)
  np.testing.assert_array_equal(np.asarray(got), [[1, 3, 0], [5, 0, 0]])


def test_store_distinct_refuses_more_updates_than_int32_misses():
  big = jax.ShapeDtypeStruct((2**31,), jnp.int32)
  with pytest.raises(ValueError, match="2147483648 updates"):
    jax.eval_shape(lambda i: store_distinct(jnp.zeros((4,), jnp.int32), i, i, i >= 0), big)


def test_todense_drops_rows_outside_the_grid_rather_than_wrapping():
  # A directly built tensor's valid row at x = -1 used to land at x = X - 1 (NumPy's negative-index rule).
  coords = jnp.asarray([[0, 1, 1, 1], [0, -1, 0, 0], [-1, -1, -1, -1]], jnp.int32)
  x = jsparse.SparseTensor(coords, jnp.asarray([[1.0], [2.0], [0.0]]), jnp.int32(2), (3, 3, 3), 1)
  dense = np.asarray(x.todense())
  assert dense[0, 1, 1, 1, 0] == 1.0 and dense.sum() == 1.0
