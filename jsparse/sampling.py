"""Sampling sparse voxel features at arbitrary points (trilinear or nearest)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from jsparse.neighbors import lookup_keys, sorted_site_keys
from jsparse.sparse_tensor import SparseTensor, site_keys

MODES = ("trilinear", "nearest")


def lookup_rows(x: SparseTensor, query, ok=None) -> jax.Array:
  """Row index of each query site in x, or -1 where absent. Jit-able.

  query: int [..., 4] (batch, x, y, z); ok: optional bool [...] (False forces -1; out-of-grid queries are
  -1 anyway). Sorts x's linear keys once, then binary-searches every query key (neighbors.lookup_keys).
  """
  query = jnp.asarray(query, jnp.int32)
  lead = query.shape[:-1]
  q = query.reshape(-1, 4)
  limits = jnp.asarray((min(x.batch_size, 2**31 - 1),) + tuple(x.spatial_shape), jnp.int32)  # batch ids are int32
  inside = jnp.all((q >= 0) & (q < limits), axis=-1)
  if ok is not None:
    inside = inside & jnp.asarray(ok).reshape(-1)
  # Out-of-grid queries would alias other sites' keys: key them from a clamped copy and mask them.
  qk = site_keys(jnp.where(inside[:, None], q, 0), x.spatial_shape, x.key_width)
  sorted_keys, order = sorted_site_keys(x)
  return lookup_keys(sorted_keys, order, qk, inside).reshape(lead)


def grid_sample(x: SparseTensor, points, mode: str = "trilinear", batch=None) -> jax.Array:
  """Samples x's features at points in voxel units: [P, 3] -> [P, C], or [B, P, 3] -> [B, P, C].

  Voxel (i, j, k)'s feature sits at the point (i, j, k) (integer coordinates are voxel centres), and
  inactive or out-of-grid voxels count as zero: trilinear mode blends the 8 surrounding integer sites
  (like scipy's map_coordinates(order=1, mode="constant", cval=0) on x.todense()); nearest mode takes
  the site floor(p + 0.5).
  Batch of each point: the leading axis for [B, P, 3] points (B must equal x.batch_size), else `batch`
  ([P] ints, default 0).
  Jit-able; differentiable with respect to x.feats (both modes) and points (trilinear; piecewise
  linear, so the gradient jumps at integer coordinates).
  """
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  points = jnp.asarray(points)
  if not jnp.issubdtype(points.dtype, jnp.floating):
    points = points.astype(jnp.float32)
  if points.ndim == 3:
    if points.shape[0] != x.batch_size:
      raise ValueError(f"points [B, P, 3] needs B == batch_size={x.batch_size}, got {points.shape}")
    if batch is not None:
      raise ValueError("pass batch only with [P, 3] points")
    bsz, p = points.shape[:2]
    b = jnp.broadcast_to(jnp.arange(bsz, dtype=jnp.int32)[:, None], (bsz, p)).reshape(-1)
    out = grid_sample(x, points.reshape(-1, 3), mode, batch=b)
    return out.reshape(bsz, p, -1)
  if points.ndim != 2 or points.shape[1] != 3:
    raise ValueError(f"points must be [P, 3] or [B, P, 3], got shape {points.shape}")
  n = points.shape[0]
  b = jnp.zeros((n,), jnp.int32) if batch is None else jnp.asarray(batch).astype(jnp.int32)
  if b.shape != (n,):
    raise ValueError(f"batch must be [P={n}], got shape {b.shape}")
  if x.capacity == 0:  # nothing to gather from
    return jnp.zeros((n, x.num_channels), x.feats.dtype)
  finite = jnp.all(jnp.isfinite(points), axis=-1)
  # Clamp far-away points so the int32 cast cannot overflow (they sample zeros either way).
  lim = float(max(x.spatial_shape) + 2)
  pc = jnp.clip(jnp.where(finite[:, None], points, -lim), -lim, lim)
  if mode == "nearest":
    site = jnp.floor(jax.lax.stop_gradient(pc) + 0.5).astype(jnp.int32)
    rows = lookup_rows(x, jnp.concatenate([b[:, None], site], axis=-1), finite)
    return jnp.where((rows >= 0)[:, None], x.feats[jnp.maximum(rows, 0)], 0)
  base = jnp.floor(jax.lax.stop_gradient(pc))
  frac = pc - base  # carries the gradient with respect to the points
  base = base.astype(jnp.int32)
  corners = jnp.array([[i, j, k] for i in (0, 1) for j in (0, 1) for k in (0, 1)], jnp.int32)  # [8, 3]
  sites = base[:, None, :] + corners[None]  # [P, 8, 3]
  query = jnp.concatenate([jnp.broadcast_to(b[:, None, None], (n, 8, 1)), sites], axis=-1)
  rows = lookup_rows(x, query, jnp.broadcast_to(finite[:, None], (n, 8)))  # [P, 8]
  cf = corners.astype(pc.dtype)
  w = jnp.prod(jnp.where(cf[None] > 0, frac[:, None, :], 1 - frac[:, None, :]), axis=-1)  # [P, 8]
  w = jnp.where(rows >= 0, w, 0).astype(x.feats.dtype)
  vals = jnp.where((rows >= 0)[..., None], x.feats[jnp.maximum(rows, 0)], 0)  # [P, 8, C]
  return jnp.sum(w[..., None] * vals, axis=1)  # elementwise: no TF32 matmul on GPUs
