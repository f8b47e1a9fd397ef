"""Point clouds to sparse voxels and back.

Convention (shared with `jsparse.sampling.grid_sample`): u = (p - origin) / voxel_size in voxel units, the
point's voxel is floor(u) (cell [i, i+1) per axis) and a voxel's centre is origin + (index + 0.5) *
voxel_size (`voxel_centres`). `return_index=True` gives each point's row in the result, and `devoxelize`
reads the voxel features back at the points by those rows.

`voxelize` quantises points on the host, validates them and merges points falling into the same voxel;
`voxelize_jit` does the same inside `jax.jit` with a static capacity and reports overflow instead of
raising. Both are differentiable with respect to the point features (the voxel assignment is not).

The merge has two steps. A plan sorts the points by linear voxel key (the sorted order, each point's voxel,
where each voxel's run of points starts); a jitted reduction then merges each voxel's features, in float32
for sums and means. `voxelize` pads the points to a bucketed count (`round_capacity`) with the padding rows
marked as dropped, so a stream of clouds of varying size reuses a handful of compiled programs instead of
compiling one per point count. Its plan runs in numpy when JAX's default backend is the CPU (numpy's
integer sort is the faster one there) and with XLA otherwise; `voxelize_jit`'s always runs with XLA.
"""
from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jsparse._types import ArrayLike
from jsparse.sampling import gather_rows_in_range  # devoxelize checks its rows itself
from jsparse.sparse_tensor import (MAX_EXTENT, MAX_KEYS, SparseTensor, as_int, as_spatial_shape, check_capacity,
                                   check_frame_values, check_sparse_tensor, int32_values, key_width, real_points,
                                   report, resolve_capacity, round_capacity, site_keys, voxel_units, wide_divmod,
                                   world_frame)
from pallas_kernels.distinct_stores import store_distinct

REDUCTIONS = ("mean", "sum", "max", "first")
DEDUPS = ("numpy", "xla")
# Key of padding rows and of points dropped under jit: it sorts after every real key (those are < MAX_KEYS; on
# wide grids every word is DROPPED_KEY, which no key below 2**62 - 1 has).
DROPPED_KEY = np.iinfo(np.int32).max


def _as_vec3(v, name):
  a = np.asarray(v, np.float64)
  if a.ndim == 0:
    a = np.full(3, float(a))
  if a.shape != (3,):
    raise ValueError(f"{name} must be a scalar or 3 values, got shape {a.shape}")
  return a


def _check_reduce(reduce):
  if reduce not in REDUCTIONS:
    raise ValueError(f"reduce must be one of {REDUCTIONS}, got {reduce!r}")


def _check_key_range(batch_size, spatial_shape) -> int:
  """The key width of the grid (sparse_tensor.key_width: ValueError past 2**62 sites or 2**21 per axis)."""
  return key_width(batch_size, spatial_shape)


def _prepare_feats(feats, n, xp=jnp):
  """feats as [n, C] floating point (xp: jnp, or np for a host copy); ValueError naming the shape, TypeError for
  complex feats."""
  feats = xp.asarray(feats)
  if feats.ndim == 1:
    feats = feats[:, None]
  if feats.ndim != 2 or feats.shape[0] != n:
    raise ValueError(f"feats must be [N={n}, C], got shape {feats.shape}")
  if jnp.issubdtype(feats.dtype, jnp.complexfloating):  # kept as complex, the tensor failed later, far from here
    raise TypeError(f"feats must be real (integers and bools are taken as float32), got dtype {feats.dtype}")
  if not jnp.issubdtype(feats.dtype, jnp.inexact):
    feats = feats.astype(np.float32)
  return feats


# ---- the plan: the points sorted by voxel ------------------------------------------------------------

class _Plan(NamedTuple):
  """Which voxel each point falls in, as a pytree of arrays over P (padded) point rows.

  order: int32 [P], the input row at each sorted position (sorted by voxel key; within a voxel the input
    order is kept, which makes "first" the earliest point).
  inverse: int32 [P], the voxel of each input row, or DROPPED_KEY for padding and dropped rows.
  starts: int32 [P + 1], the sorted position where voxel s's run of points begins for s < count, and the
    number of kept rows for s >= count, so run s is order[starts[s] : starts[s + 1]].
  voxel_coords: int32 [P, 4], (batch, x, y, z) of voxel s for s < count, -1 after.
  count: int32 scalar, the number of distinct voxels.
  """

  order: jax.Array
  inverse: jax.Array
  starts: jax.Array
  voxel_coords: jax.Array
  count: jax.Array


def _host_plan(keys: np.ndarray, padded: int, spatial_shape) -> _Plan:
  """The plan on the host (numpy) for int64 keys [n] < 2**62, padded to `padded` >= n rows."""
  n = keys.shape[0]
  order = np.arange(padded, dtype=np.int32)
  if n and keys.max() > MAX_KEYS:  # wide grid: the key takes all 64 bits, so sort it stably on its own
    order[:n] = np.argsort(keys, kind="stable")
    sorted_keys = keys[order[:n]]
  else:
    # One plain int64 sort of key * 2**32 + row: numpy's vectorised integer sort is several times faster
    # than a stable argsort, and the row in the low bits keeps equal keys in input order.
    packed = (keys.astype(np.int64) << 32) | np.arange(n, dtype=np.int64)
    packed.sort()
    order[:n] = packed & 0xFFFFFFFF
    sorted_keys = (packed >> 32).astype(np.int32)
  heads = np.empty(n, bool)
  heads[:1] = True
  np.not_equal(sorted_keys[1:], sorted_keys[:-1], out=heads[1:])
  run_starts = np.flatnonzero(heads)
  count = run_starts.size
  inverse = np.full(padded, DROPPED_KEY, np.int32)
  inverse[order[:n]] = np.cumsum(heads, dtype=np.int32) - 1
  starts = np.full(padded + 1, n, np.int32)
  starts[:count] = run_starts
  voxel_coords = np.full((padded, 4), -1, np.int32)
  voxel_keys = sorted_keys[run_starts]
  for axis, size in zip((3, 2, 1), spatial_shape[::-1]):
    voxel_keys, voxel_coords[:count, axis] = np.divmod(voxel_keys, size)
  voxel_coords[:count, 0] = voxel_keys
  return _Plan(order, inverse, starts, voxel_coords, np.int32(count))


def _device_plan(keys, dims) -> _Plan:
  """The plan with XLA ops (traceable) for keys [P >= 1] given as a tuple of int32 words (site_keys: one word
  on grids of fewer than 2**31 sites, (hi, lo) on wider ones), every word DROPPED_KEY marking rows to drop.

  dims: int32 (X, Y, Z), traced so that one program serves every grid.
  """
  keys = tuple(keys) if isinstance(keys, (tuple, list)) else (keys,)
  p = keys[0].shape[0]
  rows = lax.iota(jnp.int32, p)
  *sorted_keys, order = lax.sort((*keys, rows), num_keys=len(keys), is_stable=True)
  kept = jnp.zeros((p,), bool)  # a dropped row has every word DROPPED_KEY, a kept one not (below 2**62 - 1)
  heads = jnp.zeros((p,), bool)
  for w in sorted_keys:
    kept = kept | (w != DROPPED_KEY)
    heads = heads | (w != jnp.concatenate([jnp.full((1,), -1, jnp.int32), w[:-1]]))
  heads = heads & kept
  run_index = jnp.where(kept, jnp.cumsum(heads, dtype=jnp.int32) - 1, DROPPED_KEY)
  # Scatters of distinct indices (plain stores, no atomics). The permutation's inverse:
  inverse = jnp.zeros((p,), jnp.int32).at[order].set(run_index, unique_indices=True)
  # Stream compaction: each run's first row writes its position to slot run_index.
  starts = store_distinct(jnp.full((p + 1,), jnp.sum(kept, dtype=jnp.int32)), run_index, rows, heads)
  count = jnp.sum(heads, dtype=jnp.int32)
  voxel_keys = [w[jnp.minimum(starts[:-1], p - 1)] for w in sorted_keys]
  if len(voxel_keys) == 1:
    (voxel_keys,) = voxel_keys
    z = voxel_keys % dims[2]
    rest = voxel_keys // dims[2]
    y = rest % dims[1]
    rest = rest // dims[1]
    voxel_coords = jnp.stack([rest // dims[0], rest % dims[0], y, z], axis=1)
  else:
    rest, z = wide_divmod(*voxel_keys, dims[2])
    rest, y = wide_divmod(*rest, dims[1])
    (_, b), x = wide_divmod(*rest, dims[0])  # the batch is below 2**31: its high word is 0
    voxel_coords = jnp.stack([b, x, y, z], axis=1)
  voxel_coords = jnp.where((jnp.arange(p) < count)[:, None], voxel_coords, -1)
  return _Plan(order, inverse, starts, voxel_coords, count)


_device_plan_jit = jax.jit(_device_plan)


# ---- the reduction over each voxel's points ----------------------------------------------------------

def _segmented_scan(values, heads, combine):
  """Inclusive scan of values [P, C] along rows that restarts where heads [P] is True."""

  def step(left, right):
    left_head, left_value = left
    right_head, right_value = right
    return left_head | right_head, jnp.where(right_head[:, None], right_value, combine(left_value, right_value))

  return lax.associative_scan(step, (heads, values))[1]


def _voxel_reduce(values, plan: _Plan, run_stops, capacity, reduce, segment_impl):
  """Sum or max of the rows of values [P, C] (input order) over each of the first `capacity` voxels.

  On the CPU an unsorted segment_sum / segment_max over plan.inverse: a serial loop there, faster than
  gathering the rows into sorted order first. Elsewhere the rows are gathered into sorted order and
  reduced by a segmented scan read at each run's last row: no atomics, and each run is summed on its own,
  so its error does not grow with the rows before it (a cumulative-sum difference's would).
  """
  p = values.shape[0]
  combine = jnp.add if reduce == "sum" else jnp.maximum

  def by_scatter(values, order, inverse):
    segment = jax.ops.segment_sum if reduce == "sum" else jax.ops.segment_max
    return segment(values, inverse, num_segments=capacity)

  def by_scan(values, order, inverse):
    # A permutation: distinct indices let the gradient's scatter store without atomics.
    sorted_values = values.at[order].get(unique_indices=True, mode="promise_in_bounds")
    sorted_voxels = inverse.at[order].get(unique_indices=True, mode="promise_in_bounds")
    heads = sorted_voxels != jnp.concatenate([jnp.full((1,), -1, jnp.int32), sorted_voxels[:-1]])
    return _segmented_scan(sorted_values, heads, combine)[jnp.clip(run_stops - 1, 0, p - 1)]

  args = (values, plan.order, plan.inverse)
  if segment_impl == "scatter":
    return by_scatter(*args)
  if segment_impl == "scan":
    return by_scan(*args)
  return lax.platform_dependent(*args, cpu=by_scatter, default=by_scan)


def _reduce(plan: _Plan, feats, *, capacity, reduce, segment_impl=None):
  """The first `capacity` voxels of a plan: (coords int32 [capacity, 4], feats [capacity, C], num).

  feats: [P, C] in input row order, or None for a channel of ones (occupancy). Sums and means accumulate
  in float32 (or wider) and are cast back to the features' dtype. segment_impl: None picks by platform;
  "scatter" or "scan" force one (tests).
  """
  p = plan.order.shape[0]
  starts, coords = plan.starts[: capacity + 1], plan.voxel_coords[:capacity]
  if capacity > p:  # more rows than points: the extra voxels are empty
    starts = jnp.concatenate([starts, jnp.broadcast_to(starts[-1:], (capacity - p,))])
    coords = jnp.concatenate([coords, jnp.full((capacity - p, 4), -1, jnp.int32)])
  run_starts, run_stops = starts[:-1], starts[1:]
  num = jnp.minimum(plan.count, capacity)
  valid = jnp.arange(capacity) < num
  counts = run_stops - run_starts
  if feats is None:
    out = (counts if reduce == "sum" else jnp.ones_like(counts)).astype(jnp.float32)[:, None]
  elif reduce == "first":
    out = feats[plan.order[jnp.minimum(run_starts, p - 1)]]
  elif reduce == "max":
    out = _voxel_reduce(feats, plan, run_stops, capacity, "max", segment_impl)
  else:
    accumulate = jnp.promote_types(feats.dtype, jnp.float32)
    out = _voxel_reduce(feats.astype(accumulate), plan, run_stops, capacity, "sum", segment_impl)
    if reduce == "mean":
      out = out / jnp.maximum(counts, 1).astype(accumulate)[:, None]
    out = out.astype(feats.dtype)
  return coords, jnp.where(valid[:, None], out, 0), num


_reduce_jit = jax.jit(_reduce, static_argnames=("capacity", "reduce", "segment_impl"))


# ---- public API --------------------------------------------------------------------------------------

def _batch_ids(batch, n, batch_size):
  if batch is None:
    b = jnp.zeros((n,), jnp.int32)
  else:
    b = int32_values(batch, "batch")  # clipped, not wrapped: an id past 2**31 stays outside and is dropped
    if b.shape != (n,):
      raise ValueError(f"batch must be [N={n}] integer batch ids, got shape {b.shape}")
  return b


def _choose_dedup(dedup):
  if dedup is None:
    return "numpy" if jax.default_backend() == "cpu" else "xla"
  if dedup not in DEDUPS:
    raise ValueError(f"dedup must be None or one of {DEDUPS}, got {dedup!r}")
  return dedup


def _padded_feats(feats, n, padded):
  """feats as [padded, C] with zero padding rows, or None; padded on the host unless traced."""
  if feats is None:
    return None
  if isinstance(feats, jax.core.Tracer):  # differentiated (or traced by an outer jit): pad where it lives
    f = _prepare_feats(feats, n)
    return jnp.pad(f, ((0, padded - n), (0, 0)))
  # Padding a host copy compiles nothing; padding on the device would compile once per point count.
  f = _prepare_feats(feats, n, xp=np)
  out = np.zeros((padded, f.shape[1]), f.dtype)
  out[:n] = f
  return out


def voxelize(points, feats=None, *, voxel_size, origin=None, spatial_shape=None, batch=None,
             batch_size=None, reduce="mean", capacity=None, dedup=None,
             return_index: bool = False) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """Quantises points [N, 3] into a SparseTensor (host-side validation; call outside jit).

  Voxel of a point: floor((p - origin) / voxel_size), per axis, in float64.
  feats: [N, C] (or [N]) per-point features, or None for a single channel of ones (occupancy; with
    reduce="sum" it counts the points per voxel).
  voxel_size: scalar or 3 values. origin: world position of the grid corner; None uses the points'
    minimum (per axis, over all batches).
  spatial_shape: grid size; None takes the smallest grid holding every point. Points outside it raise
    ValueError (with how many there are). batch_size * X * Y * Z must be < 2**62, each extent < 2**21.
  batch: [N] integer batch ids (default all 0); batch_size defaults to max(batch) + 1.
  reduce: how the feats of points sharing a voxel are merged: "mean", "sum", "max" or "first" (the
    earliest point in input order). Sums and means accumulate in float32 for half-precision feats.
  capacity: rows of the result: None gives round_capacity(number of voxels) (a bucket, so that the
    jitted code downstream compiles once per bucket), "exact" the number of voxels, an int that many
    (ValueError if fewer than the voxels).
  dedup: where the points are sorted into voxels: "numpy" (on the host), "xla" (on JAX's default device),
    or None: "numpy" when JAX's default backend is the CPU (numpy's integer sort is the faster one there),
    else "xla".

  The points are padded to round_capacity(N) rows, so clouds of varying N compile once per bucket of N
  (and of capacity). Feats that are jax Arrays are padded through a host copy; traced feats (under
  jax.grad) are padded where they are, which compiles the padding once per N.
  Rows are ordered by linear key (batch, x, y, z). Differentiable with respect to feats.
  return_index: also return point_rows, int32 [N]: the row of the result holding each point's voxel (`devoxelize`
    reads the voxel features back at the points through it).
  """
  if isinstance(points, jax.core.Tracer):
    raise TypeError("voxelize validates on the host; under jax.jit use voxelize_jit with a static capacity")
  _check_reduce(reduce)
  capacity = check_capacity(capacity)
  dedup = _choose_dedup(dedup)
  p = np.asarray(real_points(points))
  if p.ndim != 2 or p.shape[1] != 3:
    raise ValueError(f"points must be [N, 3], got shape {p.shape}")
  if not np.issubdtype(p.dtype, np.floating):
    p = p.astype(np.float64)
  n = p.shape[0]
  vs = _as_vec3(voxel_size, "voxel_size")
  check_frame_values("voxel_size", vs, voxel_size)
  # Column by column: numpy reduces a column far faster than axis 0 of an [N, 3] array. min and max
  # propagate NaN and inf, so these passes also check that every coordinate is finite.
  columns = [p[:, axis] for axis in range(3)]
  lo = np.array([c.min() if n else 0.0 for c in columns], np.float64)
  hi = np.array([c.max() if n else 0.0 for c in columns], np.float64)
  if not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
    raise ValueError(f"{int((~np.isfinite(p)).any(axis=1).sum())} points have non-finite coordinates")
  org = lo if origin is None else _as_vec3(origin, "origin")
  check_frame_values("origin", org, origin)
  # The voxel index is monotone in the coordinate, so the extreme points give its range exactly.
  grid_lo, grid_hi = np.floor((lo - org) / vs), np.floor((hi - org) / vs)
  if spatial_shape is None:
    # int() of an infinite extent (a tiny voxel_size) raised OverflowError; a huge one was misreported as points
    # outside the grid it had just inferred (grid_hi + 1 rounds to grid_hi past 2**53).
    if not np.all(grid_hi + 1 < MAX_EXTENT):
      raise ValueError(f"the points span {(grid_hi + 1).tolist()} voxels per axis at voxel_size={vs.tolist()}: "
                       "the inferred spatial_shape must be below 2**21 per axis (a larger voxel_size?)")
    spatial_shape = tuple(max(int(s), 1) for s in grid_hi + 1)
  spatial_shape = as_spatial_shape(spatial_shape)
  if n and (np.any(grid_lo < 0) or np.any(grid_hi >= np.array(spatial_shape))):
    index = np.floor((p - org) / vs)
    outside = ((index < 0) | (index >= np.array(spatial_shape))).any(axis=1)
    raise ValueError(
        f"{int(outside.sum())} of {n} points fall outside the grid spatial_shape={spatial_shape} "
        f"(origin={org.tolist()}, voxel_size={vs.tolist()}); first at row {int(np.argmax(outside))}: "
        f"{p[np.argmax(outside)].tolist()}")
  b = np.zeros(n, np.int64) if batch is None else np.asarray(batch)
  if b.shape != (n,) or not np.issubdtype(b.dtype, np.integer):
    raise ValueError(f"batch must be [N={n}] integer batch ids, got shape {b.shape} dtype {b.dtype}")
  if n and b.min() < 0:
    raise ValueError(f"negative batch id {int(b.min())}")
  if batch_size is None:
    batch_size = int(b.max()) + 1 if n else 1
  batch_size = as_int(batch_size, "batch_size", minimum=1)
  if n and b.max() >= batch_size:
    raise ValueError(f"batch id {int(b.max())} >= batch_size={batch_size}")
  _check_key_range(batch_size, spatial_shape)
  keys = b.astype(np.int64)
  for column, size, axis_origin, axis_size in zip(columns, spatial_shape, org, vs):
    index = np.subtract(column, axis_origin, dtype=np.float64)
    index /= axis_size
    np.floor(index, out=index)
    keys *= size
    keys += index.astype(np.int64)
  padded = round_capacity(n)
  if dedup == "numpy":
    plan = _host_plan(keys, padded, spatial_shape)
  else:
    width = key_width(batch_size, spatial_shape)
    padded_keys = np.full((width, padded), DROPPED_KEY, np.int32)
    if width == 1:
      padded_keys[0, :n] = keys
    else:  # the (hi, lo) words of sparse_tensor.site_keys
      padded_keys[0, :n], padded_keys[1, :n] = keys >> 31, keys & MAX_KEYS
    padded_keys = tuple(padded_keys)
    dims = np.array(spatial_shape, np.int32)
    plan = _device_plan_jit(padded_keys, dims)
    if isinstance(plan.count, jax.core.Tracer):  # an outer jit traces the call: find the voxels now instead
      with jax.ensure_compile_time_eval():
        plan = _device_plan_jit(padded_keys, dims)
  nvox = int(plan.count)
  capacity = resolve_capacity(capacity, nvox, what="occupied voxels")
  if capacity < nvox:
    raise ValueError(f"capacity {capacity} is smaller than the number of occupied voxels {nvox}")
  coords, out, num = _reduce_jit(plan, _padded_feats(feats, n, padded), capacity=capacity, reduce=reduce)
  out = SparseTensor(coords, out, num, spatial_shape, int(batch_size))
  if not return_index:
    return out
  # On the host unless traced: eager jnp ops on [N] rows compiled programs for every new point count.
  inverse = plan.inverse if isinstance(plan.inverse, jax.core.Tracer) else np.asarray(plan.inverse)
  return out, _point_rows(inverse[:n], capacity)


def _point_rows(inverse, capacity: int) -> jax.Array:
  """Each point's voxel index as a row of the result: -1 for dropped points and voxels past the capacity (made
  in numpy and device_put for a numpy `inverse`)."""
  xp = np if isinstance(inverse, np.ndarray) else jnp
  rows = xp.where((inverse >= 0) & (inverse < capacity), inverse, -1).astype(np.int32)
  return jax.device_put(rows) if xp is np else rows


def voxelize_jit(points, feats=None, *, voxel_size, origin, spatial_shape, capacity, batch=None,
                 batch_size=1, reduce="mean", return_index: bool = False):
  """`voxelize` usable under jax.jit: returns (SparseTensor, overflow), or (SparseTensor, overflow, point_rows)
  with return_index=True (point_rows int32 [N]: each point's row, -1 for points dropped or past capacity).

  spatial_shape, capacity, batch_size, reduce are static; origin is required (no data-dependent default)
  and voxel_size/origin may be traced (concrete ones are checked: voxel_size positive and finite, origin
  finite; ValueError). batch_size * X * Y * Z must be < 2**62, each extent < 2**21
  (ValueError); grids of 2**31 sites or more key voxels by two int32 words.
  overflow is a bool scalar, True when more voxels were occupied than `capacity` (the voxels with the
  largest keys are dropped); the tensor carries it too (`jsparse.overflowed`), and under jit
  `jax.experimental.checkify` reports it inside `jsparse.error_checks()`. Points outside the grid or with a
  batch id outside [0, batch_size) are dropped silently (check beforehand if that matters).
  The quantisation runs in float32 (float64 points: float64; half-precision points are widened first), where
  voxelize uses float64 on the host, so a point within rounding error of a voxel face may land in the
  neighbouring voxel compared with voxelize.
  Sums and means accumulate in float32 for half-precision feats.
  """
  _check_reduce(reduce)
  spatial_shape = as_spatial_shape(spatial_shape)
  batch_size = as_int(batch_size, "batch_size", minimum=1)  # no silent truncation of 2.7 to 2
  width = _check_key_range(batch_size, spatial_shape)
  capacity = as_int(capacity, "capacity", minimum=0)
  p = jnp.asarray(real_points(points))
  if p.ndim != 2 or p.shape[1] != 3:
    raise ValueError(f"points must be [N, 3], got shape {p.shape}")
  n = p.shape[0]
  # Quantised in float32 at least: in bfloat16 (float16) u ~ 1000 on a 1024^3 grid rounds to 8 (0.5) voxels, and
  # most half-precision points landed in other voxels than voxelize puts their values in.
  p = p.astype(jnp.promote_types(p.dtype, jnp.float32) if jnp.issubdtype(p.dtype, jnp.floating) else jnp.float32)
  vs, org = world_frame(voxel_size, origin, p.dtype)  # a concrete voxel_size <= 0 mirrored or dropped every point
  # The voxel index is piecewise constant in the points: stop_gradient keeps NaN-free zero cotangents.
  idx = jnp.floor(voxel_units(lax.stop_gradient(p), org, vs))
  # Extents compared in float32 at least: in float16 an extent of 2049 rounds to 2048 and dropped voxel 2048.
  compare = jnp.promote_types(p.dtype, jnp.float32)
  idx, shape = idx.astype(compare), jnp.asarray(spatial_shape, compare)
  b = _batch_ids(batch, n, batch_size)
  inside = jnp.all((idx >= 0) & (idx < shape), axis=1) & (b >= 0) & (b < batch_size)
  idx = jnp.where(inside[:, None], idx, 0).astype(jnp.int32)
  site = jnp.concatenate([jnp.where(inside, b, 0)[:, None], idx], axis=1)
  keys = tuple(jnp.where(inside, w, DROPPED_KEY) for w in site_keys(site, spatial_shape, width))
  f = None if feats is None else _prepare_feats(feats, n)
  if n == 0:  # one dropped row keeps every array non-empty
    keys = (jnp.full((1,), DROPPED_KEY, jnp.int32),) * width
    f = None if f is None else jnp.zeros((1, f.shape[1]), f.dtype)
  plan = _device_plan(keys, jnp.asarray(spatial_shape, jnp.int32))
  coords, out, num = _reduce(plan, f, capacity=capacity, reduce=reduce)
  overflow = plan.count > capacity
  report(overflow, f"voxelize_jit: {{count}} occupied voxels do not fit in capacity={capacity}; the voxels past "
         "it were dropped", eager=False, count=plan.count)
  out = SparseTensor(coords, out, num, spatial_shape, batch_size, overflow=overflow)
  if return_index:
    return out, overflow, _point_rows(plan.inverse[:n], capacity)
  return out, overflow


def voxel_centres(x: SparseTensor, *, voxel_size: ArrayLike = 1.0,
                  origin: ArrayLike = 0.0) -> tuple[jax.Array, jax.Array]:
  """Voxel centres in world units: (points [capacity, D], valid bool [capacity]), D = x.spatial_ndim (3, or 2 / 1
  for a 2D / 1D tensor, its own axes: the points `grid_sample` takes for it; voxel_size and origin: scalars or D
  values).

  points = origin + (coords + 0.5) * voxel_size (the module's convention: voxelizing a centre gives its voxel
  back); padding rows hold 0. The batch id of row i is x.coords[i, 0]. Jit-compatible. float32, or float64 under
  jax_enable_x64 (float32 values near a UTM-like origin, 4e6, are 0.25 apart: coarser than a 0.1 voxel).
  """
  check_sparse_tensor(x)
  ndim = x.spatial_ndim
  # JAX's default float: float32 made every centre float32 under x64 too, voxels away from its voxel at a far origin.
  dtype = jnp.result_type(float)
  vs, org = world_frame(voxel_size, origin, dtype, ndim)
  valid = x.valid_mask()
  # A 2D / 1D tensor's coordinates lead with lifted axes of extent 1: [P, 3] centres with a 2-value voxel_size
  # refused, and grid_sample on that tensor refused the 3-value points.
  pts = org + (x.coords[:, 4 - ndim:].astype(dtype) + 0.5) * vs
  return jnp.where(valid[:, None], pts, 0.0), valid


def devoxelize(x: SparseTensor, point_rows: ArrayLike) -> jax.Array:
  """The features of each point's voxel, [N, C]: x.feats at point_rows, zeros where it is -1.

  point_rows: int [N], from `voxelize(..., return_index=True)` or `voxelize_jit` (for x or a tensor on the same
  coordinates, e.g. the output of submanifold layers on it), or `jsparse.sampling.lookup_rows`. For points
  without a voxel index, `grid_sample(x, points, "nearest", voxel_size=, origin=)` finds the same voxels by
  coordinates. Jit-able; the gradient with respect to x.feats sums each voxel's points (no scatter-add).
  Rows >= x.capacity or < -1 raise ValueError outside jit; under jit they read zeros (`jsparse.error_checks()`
  reports them).
  """
  check_sparse_tensor(x)
  rows = jnp.asarray(point_rows)
  if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
    raise ValueError(f"point_rows must be integer [N], got {rows.dtype} {rows.shape}")
  if not isinstance(point_rows, jax.core.Tracer) and rows.size:
    host = np.asarray(point_rows)  # on the host: under an outer jit too
    largest, smallest = int(np.max(host)), int(np.min(host))
    if largest >= x.capacity:
      raise ValueError(f"point_rows has row {largest} but x has capacity {x.capacity}")
    if smallest < -1:  # read zeros as "no voxel" silently, where a Python-style index meant a row from the end
      raise ValueError(f"point_rows has row {smallest}: rows are in [-1, capacity) (-1: no voxel)")
  # Traced rows past the capacity (another tensor's) would read the clamped last row, a valid voxel when num ==
  # capacity: they read zeros instead, and inside error_checks() checkify reports them.
  past = jnp.sum(rows >= x.capacity, dtype=jnp.int32)
  report(past > 0, f"devoxelize: {{rows}} point_rows are >= x's capacity {x.capacity} (rows of another tensor?); "
         "they read zeros", rows=past)
  below = jnp.sum(rows < -1, dtype=jnp.int32)
  report(below > 0, "devoxelize: {rows} point_rows are < -1 (rows are in [-1, capacity), -1: no voxel); they read "
         "zeros", rows=below)
  # Masked before the int32 cast, so that a wide traced row cannot wrap onto a valid one; checked above already.
  in_range = (rows >= -1) & (rows < x.capacity)
  return gather_rows_in_range(x.feats, jnp.where(in_range, rows, -1).astype(jnp.int32))
