"""Point clouds to sparse voxels and back.

`voxelize` quantises points on the host, validates them and merges points falling into the same voxel;
`voxelize_jit` does the same inside `jax.jit` with a static capacity and reports overflow instead of
raising. Both are differentiable with respect to the point features (the voxel assignment is not).
"""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.sparse_tensor import MAX_KEYS, SparseTensor, _as_spatial_shape, round_capacity

REDUCTIONS = ("mean", "sum", "max", "first")


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


def _prepare_feats(feats, n):
  if feats is None:
    return jnp.ones((n, 1), jnp.float32)  # occupancy channel
  feats = jnp.asarray(feats)
  if feats.ndim == 1:
    feats = feats[:, None]
  if feats.ndim != 2 or feats.shape[0] != n:
    raise ValueError(f"feats must be [N={n}, C], got shape {feats.shape}")
  if not jnp.issubdtype(feats.dtype, jnp.inexact):
    feats = feats.astype(jnp.float32)
  return feats


def _merge(coords, keys, inside, feats, capacity, reduce):
  """Merges rows with equal keys into at most `capacity` voxels, in increasing key order.

  coords int32 [N, 4], keys int32 [N] (any value where not inside), inside bool [N], feats [N, C].
  Returns (coords [capacity, 4], feats [capacity, C], num, overflow). Traceable.
  """
  n = keys.shape[0]
  big = jnp.iinfo(jnp.int32).max
  keys = jnp.where(inside, keys, big)
  # Stable sort: within a voxel the original point order survives, which makes "first" well defined.
  order = jnp.argsort(keys, stable=True)
  sk = keys[order]
  ok = inside[order]
  new = jnp.concatenate([jnp.ones((1,), bool), sk[1:] != sk[:-1]]) if n else jnp.zeros((0,), bool)
  seg = jnp.cumsum(new.astype(jnp.int32)) - 1
  count = jnp.sum(new & ok, dtype=jnp.int32)
  # Points outside the grid, and voxels past the capacity, go to segment `capacity`: dropped by mode="drop".
  seg = jnp.where(ok & (seg < capacity), seg, capacity)
  num = jnp.minimum(count, capacity)
  valid = jnp.arange(capacity) < num
  first_seg = jnp.where(new, seg, capacity)
  out_coords = jnp.full((capacity, 4), -1, jnp.int32).at[first_seg].set(coords[order], mode="drop")
  f = feats[order]
  c = f.shape[1]
  if reduce == "first":
    out = jnp.zeros((capacity, c), f.dtype).at[first_seg].set(f, mode="drop")
  elif reduce == "max":
    out = jnp.full((capacity, c), -jnp.inf, f.dtype).at[seg].max(f, mode="drop")
  else:
    out = jnp.zeros((capacity, c), f.dtype).at[seg].add(f, mode="drop")
    if reduce == "mean":
      cnt = jnp.zeros((capacity,), f.dtype).at[seg].add(jnp.ones((n,), f.dtype), mode="drop")
      out = out / jnp.maximum(cnt, 1)[:, None]
  out = jnp.where(valid[:, None], out, 0)
  return out_coords, out, num, count > capacity


def _batch_ids(batch, n, batch_size):
  if batch is None:
    b = jnp.zeros((n,), jnp.int32)
  else:
    b = jnp.asarray(batch).astype(jnp.int32)
    if b.shape != (n,):
      raise ValueError(f"batch must be [N={n}] integer batch ids, got shape {b.shape}")
  return b


def voxelize(points, feats=None, *, voxel_size, origin=None, spatial_shape=None, batch=None,
             batch_size=None, reduce="mean", capacity=None) -> SparseTensor:
  """Quantises points [N, 3] into a SparseTensor (host-side validation; call outside jit).

  Voxel of a point: floor((p - origin) / voxel_size), per axis.
  feats: [N, C] (or [N]) per-point features, or None for a single channel of ones (occupancy; with
    reduce="sum" it counts the points per voxel).
  voxel_size: scalar or 3 values. origin: world position of the grid corner; None uses the points'
    minimum (per axis, over all batches).
  spatial_shape: grid size; None takes the smallest grid holding every point. Points outside it raise
    ValueError (with how many there are).
  batch: [N] integer batch ids (default all 0); batch_size defaults to max(batch) + 1.
  reduce: how the feats of points sharing a voxel are merged: "mean", "sum", "max" or "first" (the
    earliest point in input order).
  capacity: rows of the result (>= number of voxels); None gives round_capacity(number of voxels).

  Rows are ordered by linear key (batch, x, y, z). Differentiable with respect to feats.
  """
  if isinstance(points, jax.core.Tracer):
    raise TypeError("voxelize validates on the host; under jax.jit use voxelize_jit with a static capacity")
  _check_reduce(reduce)
  p = np.asarray(points, np.float64)
  if p.ndim != 2 or p.shape[1] != 3:
    raise ValueError(f"points must be [N, 3], got shape {p.shape}")
  n = p.shape[0]
  if not np.all(np.isfinite(p)):
    raise ValueError(f"{int((~np.isfinite(p)).any(axis=1).sum())} points have non-finite coordinates")
  vs = _as_vec3(voxel_size, "voxel_size")
  if np.any(vs <= 0):
    raise ValueError(f"voxel_size must be positive, got {voxel_size!r}")
  org = (p.min(axis=0) if n else np.zeros(3)) if origin is None else _as_vec3(origin, "origin")
  idx = np.floor((p - org) / vs).astype(np.int64)
  if spatial_shape is None:
    spatial_shape = tuple(int(s) for s in (idx.max(axis=0) + 1)) if n else (1, 1, 1)
    spatial_shape = tuple(max(s, 1) for s in spatial_shape)
  spatial_shape = _as_spatial_shape(spatial_shape)
  outside = ((idx < 0) | (idx >= np.array(spatial_shape))).any(axis=1)
  if outside.any():
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
  if n and b.max() >= batch_size:
    raise ValueError(f"batch id {int(b.max())} >= batch_size={batch_size}")
  if batch_size * math.prod(spatial_shape) > MAX_KEYS:
    raise ValueError("batch_size * X * Y * Z exceeds 2**31 - 1: jsparse keys sites by int32 linear index")
  coords = np.concatenate([b[:, None], idx], axis=1)
  X, Y, Z = spatial_shape
  keys = ((coords[:, 0] * X + coords[:, 1]) * Y + coords[:, 2]) * Z + coords[:, 3]
  nvox = len(np.unique(keys))
  if capacity is None:
    capacity = round_capacity(nvox)
  if capacity < nvox:
    raise ValueError(f"capacity {capacity} is smaller than the number of occupied voxels {nvox}")
  f = _prepare_feats(feats, n)
  oc, of, num, _ = _merge(jnp.asarray(coords, jnp.int32), jnp.asarray(keys, jnp.int32),
                          jnp.ones((n,), bool), f, int(capacity), reduce)
  return SparseTensor(oc, of, num, spatial_shape, int(batch_size))


def voxelize_jit(points, feats=None, *, voxel_size, origin, spatial_shape, capacity, batch=None,
                 batch_size=1, reduce="mean"):
  """`voxelize` usable under jax.jit: returns (SparseTensor, overflow).

  spatial_shape, capacity, batch_size, reduce are static; origin is required (no data-dependent default)
  and voxel_size/origin may be traced. overflow is a bool scalar, True when more voxels were occupied than
  `capacity` (the voxels with the largest keys are dropped). Points outside the grid or with a batch id
  outside [0, batch_size) are dropped silently (check beforehand if that matters).
  The quantisation runs in the points' dtype (voxelize uses float64 on the host), so a point within
  rounding error of a voxel face may land in the neighbouring voxel compared with voxelize.
  """
  _check_reduce(reduce)
  spatial_shape = _as_spatial_shape(spatial_shape)
  p = jnp.asarray(points)
  if p.ndim != 2 or p.shape[1] != 3:
    raise ValueError(f"points must be [N, 3], got shape {p.shape}")
  n = p.shape[0]
  if not jnp.issubdtype(p.dtype, jnp.floating):
    p = p.astype(jnp.float32)
  vs = jnp.broadcast_to(jnp.asarray(voxel_size, p.dtype), (3,))
  org = jnp.broadcast_to(jnp.asarray(origin, p.dtype), (3,))
  # The voxel index is piecewise constant in the points: stop_gradient keeps NaN-free zero cotangents.
  idx = jnp.floor((jax.lax.stop_gradient(p) - org) / vs)
  shape = jnp.asarray(spatial_shape, p.dtype)
  b = _batch_ids(batch, n, batch_size)
  inside = jnp.all((idx >= 0) & (idx < shape), axis=1) & (b >= 0) & (b < batch_size)
  idx = jnp.where(inside[:, None], idx, 0).astype(jnp.int32)
  coords = jnp.concatenate([b[:, None], idx], axis=1)
  X, Y, Z = spatial_shape
  keys = ((coords[:, 0] * X + coords[:, 1]) * Y + coords[:, 2]) * Z + coords[:, 3]
  f = _prepare_feats(feats, n)
  oc, of, num, overflow = _merge(coords, keys, inside, f, int(capacity), reduce)
  return SparseTensor(oc, of, num, spatial_shape, int(batch_size)), overflow


def devoxelize(x: SparseTensor, *, voxel_size=1.0, origin=0.0):
  """Voxel centres in world units: (points [capacity, 3], valid bool [capacity]).

  points = origin + (coords + 0.5) * voxel_size; padding rows hold 0. The batch id of row i is
  x.coords[i, 0]. Jit-compatible.
  """
  vs = jnp.broadcast_to(jnp.asarray(voxel_size, jnp.float32), (3,))
  org = jnp.broadcast_to(jnp.asarray(origin, jnp.float32), (3,))
  valid = x.valid_mask()
  pts = org + (x.coords[:, 1:].astype(jnp.float32) + 0.5) * vs
  return jnp.where(valid[:, None], pts, 0.0), valid
