"""SparseTensor: coordinates and features of the active sites of a batch of voxel grids, as a pytree."""
from __future__ import annotations

import dataclasses
import math
import operator
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jsparse._types import ArrayLike, Capacity

# Linear site keys are int32 (JAX runs without x64 by default), so the grid must fit in 2**31 keys.
MAX_KEYS = 2**31 - 1
_REDUCTIONS = ("sum", "mean", "max", "first")


def as_int(value, name: str, minimum: int | None = None) -> int:
  """`value` as a Python int, for static sizes and counts.

  Python and numpy integers (and concrete integer 0-d arrays) pass; floats, bools, strings and traced values
  raise TypeError (int() would truncate 5.7 to 5 silently), and values below `minimum` raise ValueError.
  """
  if isinstance(value, jax.core.Tracer):
    raise TypeError(f"{name} must be a static int, got a traced value (pass a Python int under jax.jit)")
  if isinstance(value, (bool, np.bool_)) or getattr(value, "dtype", None) == np.bool_:
    raise TypeError(f"{name} must be an int, got the bool {value!r}")
  try:
    out = operator.index(value)
  except TypeError:
    raise TypeError(f"{name} must be an int, got {value!r} of type {type(value).__name__}") from None
  if minimum is not None and out < minimum:
    raise ValueError(f"{name} must be >= {minimum}, got {out}")
  return out


def check_sparse_tensor(x, name: str = "x") -> None:
  """Raises TypeError unless x is a SparseTensor (a dense array passed by mistake fails here, clearly)."""
  if not isinstance(x, SparseTensor):
    hint = " (build one with SparseTensor.from_dense or from_coords)" if hasattr(x, "shape") else ""
    raise TypeError(f"{name} must be a jsparse.SparseTensor, got {type(x).__name__}{hint}")


def _check_feats_dtype(dtype, name: str = "feats") -> None:
  # Complex features would lose their imaginary part in the float32 accumulations, ints and bools are not
  # features a convolution can produce: reject both rather than coerce.
  if not jnp.issubdtype(dtype, jnp.floating):
    raise TypeError(f"{name} must be real floating point (float16, bfloat16, float32), got dtype {dtype}")


def round_capacity(n: int, steps_per_octave: int = 4, minimum: int = 128) -> int:
  """Rounds a site count up to a bucket (4 per power of two, multiples of 128).

  Jitted code compiles once per capacity, so bucketing keeps the number of compilations small while the
  padding stays under ~19%.
  """
  steps_per_octave = as_int(steps_per_octave, "steps_per_octave", minimum=1)
  minimum = as_int(minimum, "minimum", minimum=1)
  n = max(as_int(n, "n", minimum=0), minimum)
  octave = 2 ** math.floor(math.log2(n))
  step = max(octave // steps_per_octave, minimum)
  return int(-(-n // step) * step)


EXACT = "exact"


def check_capacity(capacity, name: str = "capacity"):
  """None, "exact" or a non-negative int (validated): the three ways to ask for a number of rows."""
  if capacity is None or (isinstance(capacity, str) and capacity == EXACT):
    return capacity
  if isinstance(capacity, str):
    raise TypeError(f"{name} must be None, {EXACT!r} or a non-negative int, got {capacity!r}")
  return as_int(capacity, name, minimum=0)


def resolve_capacity(capacity, count, name: str = "capacity", what: str = "sites") -> int:
  """The static row count for `count` sites (a concrete count: outside jit). None: round_capacity(count), a
  bucket, so that inputs of varying size compile a handful of programs rather than one each; "exact": count;
  an int: itself, ValueError if count does not fit (an op that can flag overflow checks that itself instead)."""
  capacity = check_capacity(capacity, name)
  if capacity is not None and capacity != EXACT:
    return capacity
  if isinstance(count, jax.core.Tracer):
    raise TypeError(f"{name}=None or {EXACT!r} counts the {what} on the host: under jax.jit pass an int "
                    f"(e.g. round_capacity of an upper bound)")
  count = int(count)
  return count if capacity == EXACT else round_capacity(count)


def _as_spatial_shape(spatial_shape) -> tuple[int, int, int]:
  # A string is a sequence too: "888" must not pass as (8, 8, 8).
  if isinstance(spatial_shape, (str, bytes)) or not hasattr(spatial_shape, "__iter__"):
    raise TypeError(f"spatial_shape must be a sequence of 3 ints, got {spatial_shape!r}")
  shape = tuple(as_int(s, "spatial_shape entries") for s in spatial_shape)
  if len(shape) != 3 or min(shape) <= 0:
    raise ValueError(f"spatial_shape must be 3 positive ints (X, Y, Z), got {spatial_shape!r}")
  return shape


@dataclasses.dataclass(frozen=True)
class SparseTensor:
  """The active sites of `batch_size` voxel grids of shape `spatial_shape`, with a feature vector each.

  coords: int32 [capacity, 4], rows (batch, x, y, z).
  feats: [capacity, C].
  num: int32 scalar, the number of valid rows. Rows at index >= num are padding: their coords are -1,
    their feats are zero, they are nobody's neighbour, and every op writes zeros there.
  spatial_shape, batch_size: static metadata (part of the pytree structure, not traced).
  caches: the neighbour maps already built for these coordinates, by key (neighbors.cache_key,
    sparse_conv.pair_map_key). Convolutions look here first and attach what they build to their output, so
    layers on the same coordinates share one map without the caller threading it (spconv's indice_key,
    automatic). Replacing coords or num drops them. They are pytree leaves (arrays under jit), but not a
    dataclass field, so summaries such as flax's `nn.tabulate` show the tensor without them.

  The capacity (the number of rows) is static so that jitted code sees fixed shapes while the number
  of sites varies; round it up with `round_capacity` to limit recompilations.

  Loops and branches (`lax.scan`, flax's `nn.scan`, `lax.cond`, `lax.while_loop`): a carried tensor must
  leave the body with the same pytree structure it came in with, maps included, and a convolution adds its
  map when the input lacks it. So build the maps before the loop, `x = jsparse.with_maps(x, kernel_size=3)`
  (one call per kernel size and dilation the body uses, with the body's `implementation`); the body then
  reuses them and the structure stays put.
  """

  coords: jax.Array
  feats: jax.Array
  num: jax.Array
  spatial_shape: tuple[int, int, int]
  batch_size: int
  caches: dataclasses.InitVar[dict | None] = None

  def __post_init__(self, caches):
    object.__setattr__(self, "caches", {} if caches is None else caches)

  # ---- construction -------------------------------------------------------------------------------

  @classmethod
  def from_coords(
      cls,
      coords: ArrayLike,
      feats: ArrayLike,
      spatial_shape: Sequence[int],
      batch_size: int | None = None,
      capacity: Capacity = None,
      *,
      reduce: str | None = None,
  ) -> "SparseTensor":
    """Builds a SparseTensor from host data, validating it.

    coords: integer [N, 4] (batch, x, y, z), or [N, 3] (x, y, z) for a batch of one.
    feats: [N, C] (or [N] for one channel).
    batch_size: defaults to max(batch) + 1.
    capacity: number of rows (>= N). None (default): round_capacity(N), a bucket, so that a jitted step over
      batches of varying size compiles a handful of times, not once per batch; "exact": N. Extra rows are
      padding.
    reduce: what to do with duplicate coordinates: None (raise ValueError), or merge their feats with
      "sum", "mean", "max" or "first".

    Runs on the host (numpy): call it outside `jax.jit`.
    """
    if isinstance(coords, jax.core.Tracer) or isinstance(feats, jax.core.Tracer):
      raise TypeError("SparseTensor.from_coords validates on the host; call it outside jax.jit "
                      "(inside jit, build the pytree directly with SparseTensor(coords, feats, num, ...)).")
    spatial_shape = _as_spatial_shape(spatial_shape)
    coords = np.asarray(coords)
    feats_arr = jnp.asarray(feats)
    if not (np.issubdtype(coords.dtype, np.integer)):
      raise TypeError(f"coords must be integers, got dtype {coords.dtype}")
    if coords.ndim != 2 or coords.shape[1] not in (3, 4):
      raise ValueError(f"coords must be [N, 4] (batch, x, y, z) or [N, 3], got shape {coords.shape}")
    if coords.shape[1] == 3:
      coords = np.concatenate([np.zeros((coords.shape[0], 1), coords.dtype), coords], axis=1)
    if feats_arr.ndim == 1:
      feats_arr = feats_arr[:, None]
    if feats_arr.ndim != 2:
      raise ValueError(f"feats must be [N, C], got shape {feats_arr.shape}")
    _check_feats_dtype(feats_arr.dtype)
    if feats_arr.shape[1] == 0:
      raise ValueError(f"feats must have at least one channel, got shape {feats_arr.shape}")
    n = coords.shape[0]
    if feats_arr.shape[0] != n:
      raise ValueError(f"feats has {feats_arr.shape[0]} rows but coords has {n}: they must match")
    coords = coords.astype(np.int64)
    if n and coords.min() < 0:
      bad = np.argwhere(coords < 0)[0]
      raise ValueError(f"negative coordinate in row {bad[0]}: {coords[bad[0]].tolist()}")
    if batch_size is None:
      batch_size = int(coords[:, 0].max()) + 1 if n else 1
    batch_size = as_int(batch_size, "batch_size", minimum=1)
    capacity = check_capacity(capacity)
    limits = np.array((batch_size,) + spatial_shape)
    outside = (coords >= limits).any(axis=1)
    if outside.any():
      row = int(np.argmax(outside))
      raise ValueError(
          f"coordinate {coords[row].tolist()} in row {row} is outside batch_size={batch_size}, "
          f"spatial_shape={spatial_shape}")
    if batch_size * math.prod(spatial_shape) > MAX_KEYS:
      raise ValueError(
          f"batch_size * X * Y * Z = {batch_size * math.prod(spatial_shape)} exceeds 2**31 - 1: "
          "jsparse keys sites by int32 linear index")
    keys = _linear_keys_np(coords, spatial_shape)
    uniq, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    if len(uniq) != n:
      if reduce is None:
        counts = np.bincount(inverse)
        dup = int(np.argmax(counts > 1))
        raise ValueError(
            f"duplicate coordinates: {coords[first[dup]].tolist()} appears {counts[dup]} times "
            f"({n - len(uniq)} duplicate rows in all); pass reduce='sum'|'mean'|'max'|'first' to merge them")
      if reduce not in _REDUCTIONS:
        raise ValueError(f"reduce must be one of {_REDUCTIONS} or None, got {reduce!r}")
      inv = jnp.asarray(inverse.reshape(-1))
      m = len(uniq)
      if reduce == "first":
        feats_arr = feats_arr[jnp.asarray(first)]
      elif reduce == "max":
        feats_arr = jax.ops.segment_max(feats_arr, inv, num_segments=m)
      else:
        # Accumulate in float32 at least: fp16 sums of many duplicates stall (2048 + 1 == 2048) or overflow.
        acc_dtype = jnp.promote_types(feats_arr.dtype, jnp.float32)
        summed = jax.ops.segment_sum(feats_arr.astype(acc_dtype), inv, num_segments=m)
        if reduce == "mean":
          counts = jnp.asarray(np.bincount(inverse.reshape(-1), minlength=m), acc_dtype)
          summed = summed / counts[:, None]
        feats_arr = summed.astype(feats_arr.dtype)
      coords = coords[first]
      n = m
    elif reduce is not None and reduce not in _REDUCTIONS:
      raise ValueError(f"reduce must be one of {_REDUCTIONS} or None, got {reduce!r}")
    capacity = resolve_capacity(capacity, n)
    if capacity < n:
      raise ValueError(f"capacity {capacity} is smaller than the number of sites {n}")
    pad = capacity - n
    coords_p = np.concatenate([coords.astype(np.int32), np.full((pad, 4), -1, np.int32)])
    feats_p = jnp.concatenate([feats_arr, jnp.zeros((pad, feats_arr.shape[1]), feats_arr.dtype)])
    return cls(jnp.asarray(coords_p), feats_p, jnp.asarray(n, jnp.int32), spatial_shape, batch_size)

  @classmethod
  def from_dense(cls, dense: ArrayLike, capacity: Capacity = None, *,
                 with_overflow: bool = False) -> "SparseTensor | tuple[SparseTensor, jax.Array]":
    """The nonzero sites of a dense [B, X, Y, Z, C] array (a site is active if any channel is nonzero).

    capacity: rows of the result. None: round_capacity of the number of sites, "exact": that number (both count
      on the host: outside jit).
    Under jit with a capacity, sites past the capacity cannot be stored: pass with_overflow=True to get
    `(tensor, overflow)` where overflow is a bool scalar that is True when sites were dropped. Outside jit
    an overflow raises ValueError.
    """
    dense = jnp.asarray(dense)
    if dense.ndim != 5:
      raise ValueError(f"dense must be [B, X, Y, Z, C], got shape {dense.shape}")
    _check_feats_dtype(dense.dtype, "dense")  # as from_coords: no int / bool / complex features
    if min(dense.shape) == 0:
      raise ValueError(f"dense must have nonzero extents [B, X, Y, Z, C], got shape {dense.shape}")
    b, x, y, z, _ = dense.shape
    capacity = check_capacity(capacity)
    active = jnp.any(dense != 0, axis=-1).reshape(-1)
    count = jnp.sum(active, dtype=jnp.int32)
    if capacity is None or capacity == EXACT:
      capacity = resolve_capacity(capacity, count)
    (flat,) = jnp.nonzero(active, size=capacity, fill_value=-1)
    valid = flat >= 0
    idx = jnp.stack(jnp.unravel_index(jnp.maximum(flat, 0), (b, x, y, z)), axis=-1).astype(jnp.int32)
    coords = jnp.where(valid[:, None], idx, -1)
    feats = jnp.where(valid[:, None], dense.reshape(-1, dense.shape[-1])[jnp.maximum(flat, 0)], 0)
    overflow = count > capacity
    out = cls(coords, feats, jnp.minimum(count, capacity), (x, y, z), b)
    if with_overflow:
      return out, overflow
    if not isinstance(overflow, jax.core.Tracer) and bool(overflow):
      raise ValueError(f"from_dense: {int(count)} active sites do not fit in capacity {capacity}")
    return out

  # ---- views ---------------------------------------------------------------------------------------

  @property
  def capacity(self) -> int:
    return self.coords.shape[0]

  @property
  def num_channels(self) -> int:
    return self.feats.shape[-1]

  @property
  def dtype(self) -> np.dtype:
    """The features' dtype."""
    return self.feats.dtype

  def valid_mask(self) -> jax.Array:
    """bool [capacity]: True for the valid rows."""
    return jnp.arange(self.capacity) < self.num

  def replace(self, **changes: Any) -> "SparseTensor":
    """A copy with some fields replaced, e.g. `x.replace(feats=jax.nn.relu(x.feats))`.

    New feats keep the padding convention only if they are zero at padding rows; elementwise functions
    with f(0) != 0 need `x.replace(feats=jnp.where(x.valid_mask()[:, None], f(x.feats), 0))`.
    """
    capacity = self.capacity
    if "coords" in changes:
      coords = changes["coords"]
      if not (hasattr(coords, "shape") and hasattr(coords, "dtype")):
        raise TypeError(f"coords must be an array, got {type(coords).__name__}")
      if len(coords.shape) != 2 or coords.shape[1] != 4 or not jnp.issubdtype(coords.dtype, jnp.integer):
        raise ValueError(f"coords must be integer [capacity, 4], got {coords.dtype} {tuple(coords.shape)}")
      capacity = coords.shape[0]
      if "feats" not in changes and capacity != self.capacity:
        raise ValueError(f"new coords have {capacity} rows but feats {self.capacity}: replace both together")
    if "feats" in changes:
      f = changes["feats"]
      if not (hasattr(f, "shape") and hasattr(f, "dtype")):
        raise TypeError(f"feats must be an array (jax or numpy), got {type(f).__name__}")
      if len(f.shape) != 2 or f.shape[0] != capacity:
        raise ValueError(f"feats must be [capacity={capacity}, C], got shape {tuple(f.shape)}")
      _check_feats_dtype(f.dtype)
    if "num" in changes and not isinstance(changes["num"], jax.core.Tracer):
      num = np.asarray(changes["num"])
      if num.shape != () or not np.issubdtype(num.dtype, np.integer) or not 0 <= int(num) <= capacity:
        raise ValueError(f"num must be an integer scalar in [0, capacity={capacity}], got {changes['num']!r}")
    if ("coords" in changes or "num" in changes) and "caches" not in changes:
      changes["caches"] = {}  # maps belong to the old coordinates
    return dataclasses.replace(self, **changes)

  def with_cache(self, key: str, cache: Any) -> "SparseTensor":
    """A copy that carries `cache` (a neighbour map of these coordinates) under `key`."""
    return dataclasses.replace(self, caches={**self.caches, key: cache})

  def todense(self) -> jax.Array:
    """The dense [B, X, Y, Z, C] array (zeros at inactive sites)."""
    x, y, z = self.spatial_shape
    valid = self.valid_mask()
    # Out-of-range indices make the scatter drop padding rows.
    b_idx = jnp.where(valid, self.coords[:, 0], self.batch_size)
    dense = jnp.zeros((self.batch_size, x, y, z, self.num_channels), self.feats.dtype)
    return dense.at[b_idx, self.coords[:, 1], self.coords[:, 2], self.coords[:, 3]].set(
        self.feats, mode="drop")

  def linear_keys(self) -> jax.Array:
    """int32 [capacity]: ((b*X + x)*Y + y)*Z + z for valid rows, -1 for padding."""
    keys = linear_keys(self.coords, self.spatial_shape)
    return jnp.where(self.valid_mask(), keys, -1)

  def __repr__(self) -> str:
    num = self.num if isinstance(self.num, jax.core.Tracer) else int(self.num)
    return (f"SparseTensor(num={num}, capacity={self.capacity}, channels={self.num_channels}, "
            f"dtype={self.dtype}, spatial_shape={self.spatial_shape}, batch_size={self.batch_size})")


def _flatten_with_keys(x: SparseTensor):
  leaves = tuple((jax.tree_util.GetAttrKey(name), getattr(x, name)) for name in ("coords", "feats", "num", "caches"))
  return leaves, (x.spatial_shape, x.batch_size)


def _unflatten(static, leaves) -> SparseTensor:
  coords, feats, num, caches = leaves
  return SparseTensor(coords, feats, num, *static, caches)


jax.tree_util.register_pytree_with_keys(
    SparseTensor, _flatten_with_keys, _unflatten,
    lambda x: ((x.coords, x.feats, x.num, x.caches), (x.spatial_shape, x.batch_size)))


def linear_keys(coords: jax.Array, spatial_shape: tuple[int, int, int]) -> jax.Array:
  x, y, z = spatial_shape
  return ((coords[:, 0] * x + coords[:, 1]) * y + coords[:, 2]) * z + coords[:, 3]


def _linear_keys_np(coords: np.ndarray, spatial_shape) -> np.ndarray:
  x, y, z = spatial_shape
  c = coords.astype(np.int64)
  return ((c[:, 0] * x + c[:, 1]) * y + c[:, 2]) * z + c[:, 3]
