"""Sampling sparse voxel features at arbitrary points (trilinear or nearest).

The convention, shared with `jsparse.voxelize.voxelize` and `jsparse.voxelize.voxel_centres`: a point p in
world units sits at u = (p - origin) / voxel_size in voxel units; voxel (i, j, k) is the cell [i, i+1) x
[j, j+1) x [k, k+1) of u, so a point's own voxel is floor(u) and the voxel's centre is u = (i, j, k) + 0.5
(world origin + (index + 0.5) * voxel_size). "nearest" reads floor(u), which is the voxel `voxelize` put the
point in (up to float rounding at a face: voxelize quantises in float64 on the host); "trilinear"
blends the features of the 8 voxels whose centres surround u.

Gathers of voxel features by many points (`gather_sites`) have a gradient that sums the points' cotangents
per voxel by a sort and a segmented scan, not by a scatter-add.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jsparse._types import ArrayLike
from jsparse.neighbors import lookup_keys, sorted_site_keys
from jsparse.sparse_tensor import (SparseTensor, check_sparse_tensor, int32_values, is_traced, real_points, report,
                                   site_keys, voxel_units, world_frame)

MODES = ("trilinear", "nearest")


def _segment_heads(sorted_ids):
  return sorted_ids != jnp.concatenate([jnp.full((1,), -1, sorted_ids.dtype), sorted_ids[:-1]])


def _sum_by_row(g, rows, num_rows: int):
  """[num_rows, C] float32: per row r, the sum of g[i] over the i with rows[i] == r (sort + segmented scan)."""
  if g.shape[0] == 0 or num_rows == 0:
    return jnp.zeros((num_rows,) + g.shape[1:], jnp.float32)
  ids = jnp.where(rows >= 0, rows, num_rows)  # unread entries sort last and are never read back
  sorted_ids, order = lax.sort((ids, lax.iota(jnp.int32, ids.shape[0])), num_keys=1)
  sorted_g = g.astype(jnp.float32)[order]

  def step(left, right):
    (left_head, left_value), (right_head, right_value) = left, right
    return left_head | right_head, jnp.where(right_head[:, None], right_value, left_value + right_value)

  # A segmented scan sums each row's run on its own: an inf or NaN of one row reaches no other.
  scanned = lax.associative_scan(step, (_segment_heads(sorted_ids), sorted_g))[1]
  targets = jnp.arange(num_rows, dtype=sorted_ids.dtype)
  start = jnp.searchsorted(sorted_ids, targets, side="left")
  stop = jnp.searchsorted(sorted_ids, targets, side="right")
  return jnp.where((stop > start)[:, None], scanned[jnp.maximum(stop - 1, 0)], 0)


@jax.custom_vjp
def gather_rows_in_range(values, rows):
  """values[rows] for int32 rows already in [-1, M), without gather_sites' checks (callers whose rows are in range by
  construction: no host round trip); -1, and any row outside, reads zeros. Same gradient as gather_sites."""
  if values.shape[0] == 0:  # nothing to read (an empty tensor)
    return jnp.zeros((rows.shape[0],) + values.shape[1:], values.dtype)
  # A row past M would read the clamped last row, a real site's features: it reads zeros as -1 does.
  read = (rows >= 0) & (rows < values.shape[0])
  return jnp.where(read[:, None], values[jnp.clip(rows, 0, values.shape[0] - 1)], 0).astype(values.dtype)


def _gather_rows_in_range_fwd(values, rows):
  # An empty [M, 0] array carries the row count and dtype (residuals must be arrays).
  return gather_rows_in_range(values, rows), (rows, jnp.zeros((values.shape[0], 0), values.dtype))


def _gather_rows_in_range_bwd(res, g):
  rows, like = res
  return _sum_by_row(g, rows, like.shape[0]).astype(like.dtype), None


gather_rows_in_range.defvjp(_gather_rows_in_range_fwd, _gather_rows_in_range_bwd)


def gather_sites(values: jax.Array, rows: ArrayLike) -> jax.Array:
  """values [M, C] read at rows [N] (int, -1 gives a zero row): each point's voxel features.

  Many points may read one row. The gradient with respect to values sums each row's cotangents in float32
  by sorting the rows and a segmented scan (no scatter-add, so no float atomics on a GPU).
  Rows >= M or < -1 raise ValueError outside jit; under jit they read zeros (`jsparse.error_checks()` reports them).
  """
  values = jnp.asarray(values)
  given = rows
  rows = rows if isinstance(rows, jax.Array) else np.asarray(rows)  # not jnp: an int64 2**32 wrapped to row 0
  if values.ndim != 2:
    raise ValueError(f"values must be [M, C], got shape {values.shape}")
  if rows.ndim != 1 or not jnp.issubdtype(rows.dtype, jnp.integer):
    raise ValueError(f"rows must be integer [N], got {rows.dtype} {rows.shape}")
  m = values.shape[0]
  message = f"gather_sites: {{rows}} rows are outside [-1, {m}) (-1: a zero row); they read zeros"
  if not is_traced(given) and rows.size:
    host = np.asarray(rows)
    report(np.any((host < -1) | (host >= m)), message, rows=int(np.sum((host < -1) | (host >= m))))
  rows = int32_values(rows, "rows")  # clipped, not wrapped: a wide row stays outside
  if is_traced(given):
    report(jnp.any((rows < -1) | (rows >= m)), message, rows=jnp.sum((rows < -1) | (rows >= m), dtype=jnp.int32))
  return gather_rows_in_range(values, rows)


def lookup_rows(x: SparseTensor, query, ok=None) -> jax.Array:
  """Row index of each query site in x, or -1 where absent. Jit-able.

  query: integer [..., 4] (batch, x, y, z) (TypeError otherwise); ok: optional bool [...] (False forces -1;
  out-of-grid queries are -1 anyway). Sorts x's linear keys once, then binary-searches every query key
  (neighbors.lookup_keys).
  """
  check_sparse_tensor(x)
  query = int32_values(query, "query")  # clipped, not wrapped: a wide out-of-grid query stays out of the grid
  # Checked here: [N, 3] queries failed in a reshape, with a TypeError naming no argument.
  if query.ndim < 1 or query.shape[-1] != 4:
    raise ValueError(f"query must be integer [..., 4] (batch, x, y, z), got shape {query.shape}")
  lead = query.shape[:-1]
  q = query.reshape(-1, 4)
  limits = jnp.asarray((min(x.batch_size, 2**31 - 1),) + tuple(x.spatial_shape), jnp.int32)  # batch ids are int32
  inside = jnp.all((q >= 0) & (q < limits), axis=-1)
  if ok is not None:
    ok = jnp.asarray(ok)
    # An int mask was and-ed bitwise (ok=2 cleared a hit), one of another shape broadcast or failed unnamed.
    if ok.shape != lead or ok.dtype != jnp.bool_:
      raise ValueError(f"ok must be bool {lead} (query's leading shape), got {ok.dtype} {ok.shape}")
    inside = inside & ok.reshape(-1)
  # Out-of-grid queries would alias other sites' keys: key them from a clamped copy and mask them.
  qk = site_keys(jnp.where(inside[:, None], q, 0), x.spatial_shape, x.key_width)
  sorted_keys, order = sorted_site_keys(x)
  return lookup_keys(sorted_keys, order, qk, inside).reshape(lead)


def grid_sample(x: SparseTensor, points: ArrayLike, mode: str = "trilinear", batch: ArrayLike | None = None, *,
                voxel_size: ArrayLike = 1.0, origin: ArrayLike = 0.0) -> jax.Array:
  """Samples x's features at points: [P, D] -> [P, C], or [B, P, D] -> [B, P, C], D = x.spatial_ndim (3, or 2 /
  1 for a 2D / 1D tensor, sampled bilinearly / linearly over its own axes).

  Points are in world units, u = (points - origin) / voxel_size in voxel units (the defaults: points already
  in voxel units), with the module's convention: voxel (i, j, k) covers [i, i+1)^3 of u, centre at +0.5, as
  `voxelize` with the same voxel_size and origin. mode "nearest": the voxel floor(u), the one voxelize puts
  the point in; "trilinear": the blend of the 8 voxels whose centres surround u (scipy's
  map_coordinates(x.todense(), u - 0.5, order=1, mode="grid-constant", cval=0), which jax.scipy's
  mode="constant" also computes). Inactive or out-of-grid voxels count as zero; voxel_size must be positive.
  Batch of each point: the leading axis for [B, P, 3] points (B must equal x.batch_size), else `batch`
  ([P] ints in [0, x.batch_size), default 0; another id is a ValueError outside jit, under jit its point samples
  zeros and `error_checks()` reports it).
  Jit-able; differentiable with respect to x.feats (both modes, no scatter-add: `gather_sites`) and points
  (trilinear; piecewise linear, so the gradient jumps where u - 0.5 is an integer). u is computed in float32 (or
  float64 for float64 points), also for half-precision points.
  voxel_size and origin: scalars or D values.
  """
  check_sparse_tensor(x)
  if mode not in MODES:
    raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
  points = jnp.asarray(real_points(points))
  # Voxel units in float32 at least: in bfloat16 (float16) u ~ 1000 on a 1024^3 grid rounds to 8 (0.5) voxels, and
  # most half-precision points sampled another voxel than their exact values name. The gradient comes back in
  # the points' dtype.
  points = points.astype(jnp.promote_types(points.dtype, jnp.float32) if jnp.issubdtype(points.dtype, jnp.floating)
                         else jnp.float32)
  ndim = x.spatial_ndim
  if ndim < 3:
    if points.ndim not in (2, 3) or points.shape[-1] != ndim:
      raise ValueError(f"points of a {ndim}D SparseTensor must be [P, {ndim}] or [B, P, {ndim}], got shape "
                       f"{points.shape}")
    vs, org = world_frame(voxel_size, origin, points.dtype, ndim)
    # The lifted axes (extent 1) are sampled at their one voxel's centre, where the blend gives that voxel
    # weight 1: 3-value points at 0 there halved every value.
    u = voxel_units(points, org, vs)
    lifted = jnp.concatenate([jnp.full(u.shape[:-1] + (3 - ndim,), 0.5, u.dtype), u], axis=-1)
    return grid_sample(x.replace(spatial_ndim=3), lifted, mode, batch)
  if points.ndim == 3:
    if points.shape[0] != x.batch_size:
      raise ValueError(f"points [B, P, 3] needs B == batch_size={x.batch_size}, got {points.shape}")
    if batch is not None:
      raise ValueError("pass batch only with [P, 3] points")
    bsz, p = points.shape[:2]
    b = jnp.broadcast_to(jnp.arange(bsz, dtype=jnp.int32)[:, None], (bsz, p)).reshape(-1)
    out = grid_sample(x, points.reshape(-1, 3), mode, batch=b, voxel_size=voxel_size, origin=origin)
    return out.reshape(bsz, p, x.num_channels)  # not -1: with no points (P = 0) that size is ambiguous
  if points.ndim != 2 or points.shape[1] != 3:
    raise ValueError(f"points must be [P, 3] or [B, P, 3], got shape {points.shape}")
  vs, org = world_frame(voxel_size, origin, points.dtype)
  n = points.shape[0]
  b = jnp.zeros((n,), jnp.int32) if batch is None else int32_values(batch, "batch")
  if b.shape != (n,):
    raise ValueError(f"batch must be [P={n}], got shape {b.shape}")
  if batch is not None and n:
    # A batch id outside the tensor's items sampled zeros everywhere (lookup_rows finds no such item): a silent
    # wrong answer for an off-by-one batch. A concrete batch (also a constant under the caller's jit, where jnp
    # would trace the comparison) is checked in numpy and raises; a traced one samples zeros there, and inside
    # error_checks() checkify reports it.
    message = f"grid_sample: batch must be in [0, batch_size={x.batch_size}), got {{value}} for point {{point}}"
    if is_traced(batch):
      outside = (b < 0) | (b >= x.batch_size)
      first = jnp.argmax(outside).astype(jnp.int32)
      report(jnp.any(outside), message, point=first, value=b[first])
    else:
      host = np.asarray(batch)  # not b: under jit, int32_values' device_put of host data is traced
      bad = np.flatnonzero((host < 0) | (host >= x.batch_size))
      if bad.size:
        raise ValueError(message.format(value=int(host[bad[0]]), point=int(bad[0])))
  if x.capacity == 0:  # nothing to gather from
    return jnp.zeros((n, x.num_channels), x.feats.dtype)
  u = voxel_units(points, org, vs)
  finite = jnp.all(jnp.isfinite(u), axis=-1)
  # Clamp far-away points so the int32 cast cannot overflow (they sample zeros either way).
  lim = float(max(x.spatial_shape) + 2)
  uc = jnp.clip(jnp.where(finite[:, None], u, -lim), -lim, lim)
  if mode == "nearest":
    site = jnp.floor(lax.stop_gradient(uc)).astype(jnp.int32)
    rows = lookup_rows(x, jnp.concatenate([b[:, None], site], axis=-1), finite)
    return gather_rows_in_range(x.feats, rows)  # lookup_rows' rows are in [-1, capacity): no check
  centred = uc - 0.5  # voxel centres at integers
  base = jnp.floor(lax.stop_gradient(centred))
  frac = centred - base  # carries the gradient with respect to the points
  base = base.astype(jnp.int32)
  corners = jnp.array([[i, j, k] for i in (0, 1) for j in (0, 1) for k in (0, 1)], jnp.int32)  # [8, 3]
  sites = base[:, None, :] + corners[None]  # [P, 8, 3]
  query = jnp.concatenate([jnp.broadcast_to(b[:, None, None], (n, 8, 1)), sites], axis=-1)
  rows = lookup_rows(x, query, jnp.broadcast_to(finite[:, None], (n, 8)))  # [P, 8]
  cf = corners.astype(uc.dtype)
  w = jnp.prod(jnp.where(cf[None] > 0, frac[:, None, :], 1 - frac[:, None, :]), axis=-1)  # [P, 8]
  w = jnp.where(rows >= 0, w, 0).astype(x.feats.dtype)
  # [P, 8, C], reshaped by n rather than -1, which failed at P = 0.
  vals = gather_rows_in_range(x.feats, rows.reshape(-1)).reshape(n, 8, x.num_channels)
  # Elementwise (no TF32 matmul on GPUs), accumulated in float32 for half-precision features.
  blended = jnp.sum(w.astype(jnp.float32)[..., None] * vals.astype(jnp.float32), axis=1)
  return blended.astype(x.feats.dtype)
