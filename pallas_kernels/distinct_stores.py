"""Scatters of distinct indices, some updates skipped: stream compaction and map transposes as plain stores.

XLA runs a scatter whose indices are declared unique as plain stores (no atomics, no scatter-add). An update that
is not wanted still needs an index of its own, one that lies outside the destination so the scatter drops it. The
i-th update's is -1 - i, taken as written (no NumPy-style wrap of negative indices). An index past the end,
`size + i`, wraps in int32 once size + i passes 2**31 and, wrapped negative, NumPy's rule moves it back inside.
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def store_distinct(dest: jax.Array, index, values, keep, *, axis: int = 0) -> jax.Array:
  """dest with dest[index][i] = values[i] wherever keep[i], unchanged elsewhere.

  index: an int array for dest's first axis, or a tuple of them, one per leading axis of dest (broadcast
    together with keep and values). The kept updates must name distinct in-range positions; the others may hold
    anything.
  axis: the component of a tuple index whose skipped entries are replaced (its skipped updates become distinct).
  """
  parts = list(index) if isinstance(index, tuple) else [index]
  shape = jnp.broadcast_shapes(jnp.shape(keep), *(jnp.shape(p) for p in parts))
  if math.prod(shape) >= 2**31:
    raise ValueError(f"store_distinct: {math.prod(shape)} updates; at most 2**31 - 1 have distinct int32 misses")
  misses = -1 - jnp.arange(math.prod(shape), dtype=jnp.int32).reshape(shape)
  parts[axis] = jnp.where(keep, parts[axis], misses)
  return dest.at[tuple(parts)].set(values, mode="drop", unique_indices=True, wrap_negative_indices=False)
