"""Ops that change which sites a SparseTensor holds, or read one tensor's sites in another (MinkowskiEngine's
pruning and union, coarse-to-fine labels), and feature dropout.

Every site lookup here sorts linear site keys and binary-searches them (neighbors.sorted_site_keys,
neighbors.lookup_keys), so there is no hash table and no scatter. Moving features between two row sets goes
through `gather_injective`, whose gradient is the gather the other way (each source row lands in at most one
output row, so the transposed map is known): no scatter-add in the forward or backward pass.

Capacities follow the rest of the library: an int (required under jit), "exact" (the count) or None (a
bucket, `round_capacity`); `select` defaults to its input's capacity, which always fits. Sites that do not
fit raise ValueError outside jit; under jit the output's overflow flag is set (`jsparse.overflowed`),
`jax.experimental.checkify` reports the op and counts inside `jsparse.error_checks()`, and `with_overflow=True`
also returns this op's flag.
"""
from __future__ import annotations

import functools
import math
import numbers

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jsparse.eager import compiled_when_eager
from jsparse import eager as eager_calls
from jsparse import per_item
from jsparse._types import ArrayLike, Capacity, Size3
from jsparse.eager import NeedsHostValues
from jsparse.gemm_xla import gather_rows
from jsparse.neighbors import keyed_rows, lift_triple, lookup_keys, sorted_site_keys
from jsparse.sampling import lookup_rows
from jsparse.sparse_tensor import (
  EXACT,
  SparseTensor,
  check_capacity,
  check_distinct_sites,
  check_inside_grid,
  check_sparse_tensor,
  is_traced,
  report,
  resolve_capacity,
  site_keys,
  sites_of_keys,
)
from pallas_kernels.distinct_stores import store_distinct

__all__ = ["add", "broadcast_per_item", "child_labels", "dropout", "gather_injective", "multiply", "select", "union"]

_BIG = jnp.iinfo(jnp.int32).max


# ---- gathers whose gradient is a gather ----------------------------------------------------------------


@jax.custom_vjp
def _gather(values, rows, back):
  if values.shape[0] == 0:  # nothing to read (an empty tensor)
    return jnp.zeros((rows.shape[0],) + values.shape[1:], values.dtype)
  return jnp.where((rows >= 0)[:, None], values[jnp.maximum(rows, 0)], 0).astype(values.dtype)


def _gather_fwd(values, rows, back):
  return _gather(values, rows, back), (rows, back)


def _gather_bwd(res, g):
  rows, back = res
  # Each source row feeds at most one output row (back names it), so the transposed gather is exact.
  return _gather(g, back, rows), None, None


_gather.defvjp(_gather_fwd, _gather_bwd)


def gather_injective(values: jax.Array, rows: jax.Array, back: jax.Array) -> jax.Array:
  """values [N, C] read at `rows` [M] (int32, -1 gives a zero row), for an injective map.

  back [N]: the output row that reads each source row, or -1 (the inverse of rows: rows[back[j]] == j
  wherever back[j] >= 0). The gradient is then the gather g[back], with no scatter-add; a map that is not
  injective needs another gradient.
  """
  return _gather(values, rows.astype(jnp.int32), back.astype(jnp.int32))


def _compaction(keep: jax.Array, size: int) -> tuple[jax.Array, jax.Array]:
  """(rows [size], rank [N]): the indices of the first `size` True entries of keep [N] in order (-1 after
  them), and each kept entry's position among them (-1 where not kept or past size).

  A prefix sum and a store to distinct positions: jnp.nonzero would scatter-add ones that all collide.
  """
  n = keep.shape[0]
  rank = jnp.cumsum(keep, dtype=jnp.int32) - 1
  rank = jnp.where(keep & (rank < size), rank, -1)
  rows = store_distinct(jnp.full((size,), -1, jnp.int32), rank, jnp.arange(n, dtype=jnp.int32), rank >= 0)
  return rows, rank


# ---- select / prune ----------------------------------------------------------------------------------


def _check_row_mask(x: SparseTensor, mask, name: str = "mask") -> jax.Array:
  mask = jnp.asarray(mask)
  if mask.shape != (x.capacity,) or mask.dtype != jnp.bool_:
    raise ValueError(f"{name} must be bool [capacity={x.capacity}], got {mask.dtype} {tuple(mask.shape)}")
  return mask


def _finish(op: str, what: str, count, capacity: int, with_overflow: bool):
  overflow = count > capacity
  report(overflow, f"{op}: {{count}} {what} do not fit in capacity={capacity}; the {what} past it were dropped",
         eager=not with_overflow, count=count)
  return overflow


@compiled_when_eager
def select(x: SparseTensor, mask: ArrayLike, *, capacity: Capacity = None,
           with_overflow: bool = False) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """The rows of x where `mask` is True (pruning, as MinkowskiEngine's MinkowskiPruning), in x's row order.

  mask: bool [x.capacity]; rows at or past x.num are never kept. capacity: rows of the result; None (default)
  keeps x.capacity (always fits, and works under jit), "exact" the count, or an int (under jit, kept rows past
  it are dropped and flagged, module docstring). Differentiable with respect to x.feats; the gradient of a
  dropped row is zero. The result has no neighbour maps (its coordinates are new) and x's overflow flag.
  """
  check_sparse_tensor(x)
  keep = _check_row_mask(x, mask) & x.valid_mask()
  count = jnp.sum(keep, dtype=jnp.int32)
  capacity = x.capacity if capacity is None else resolve_capacity(capacity, count, "capacity", "kept rows")
  overflow = _finish("select", "kept rows", count, capacity, with_overflow)
  rows, back = _compaction(keep, capacity)  # the output row of each kept input row is its rank
  coords = gather_rows(x.coords, rows, -1)  # -1 past the kept rows; also from a capacity-0 x
  out = SparseTensor(coords, gather_injective(x.feats, rows, back), jnp.minimum(count, capacity), x.spatial_shape,
                     x.batch_size, overflow=x.overflow | overflow, spatial_ndim=x.spatial_ndim)
  return (out, overflow) if with_overflow else out


# ---- union ---------------------------------------------------------------------------------------------


def _check_same_grid(op: str, a: SparseTensor, b: SparseTensor) -> None:
  check_sparse_tensor(a, "a")
  check_sparse_tensor(b, "b")
  grid = lambda t: (t.spatial_shape, t.batch_size, t.spatial_ndim)
  if grid(a) != grid(b):
    raise ValueError(f"{op}: a and b must be on one grid: spatial_shape/batch_size/spatial_ndim {grid(a)} vs {grid(b)}")


def _masked_keys(x: SparseTensor) -> tuple[jax.Array, ...]:
  return tuple(jnp.where(keyed_rows(x), k, _BIG) for k in site_keys(x.coords, x.spatial_shape, x.key_width))


def _sites_only(coords, num, spatial_shape, batch_size) -> SparseTensor:
  return SparseTensor(coords, jnp.zeros((coords.shape[0], 1), jnp.float32), num, spatial_shape, batch_size)


@functools.partial(jax.jit, static_argnames=("spatial_shape", "batch_size", "capacity"))
def _union_sites(a_coords, a_num, b_coords, b_num, spatial_shape, batch_size: int, capacity: int):
  """(out_coords, count, a_rows, b_rows, a_back, b_back): the union's first `capacity` sites by key, the row
  of each in a and b (or -1), and the output row of each row of a and b (or -1)."""
  a = _sites_only(a_coords, a_num, spatial_shape, batch_size)
  b = _sites_only(b_coords, b_num, spatial_shape, batch_size)
  keys_a, keys_b = _masked_keys(a), _masked_keys(b)
  merged = lax.sort(tuple(jnp.concatenate([ka, kb]) for ka, kb in zip(keys_a, keys_b)), num_keys=len(keys_a))
  merged = merged if isinstance(merged, tuple) else (merged,)
  if merged[0].shape[0] == 0:  # two capacity-0 tensors: one empty key, so the gathers below have a row to read
    merged = tuple(jnp.full((1,), _BIG, w.dtype) for w in merged)
  empty, new = jnp.ones(merged[0].shape, bool), jnp.zeros(merged[0].shape, bool)
  for w in merged:  # a key starts a run when a word differs from the previous key's; empty keys are _BIG
    empty = empty & (w == _BIG)
    new = new | (w != jnp.concatenate([jnp.full((1,), -1, w.dtype), w[:-1]]))
  heads = new & ~empty
  count = jnp.sum(heads, dtype=jnp.int32)
  pos, _ = _compaction(heads, capacity)
  out_keys = tuple(jnp.where(pos >= 0, w[jnp.maximum(pos, 0)], _BIG) for w in merged)  # ascending, then _BIG
  filled = jnp.arange(capacity) < jnp.minimum(count, capacity)
  coords = sites_of_keys(tuple(jnp.where(filled, w, 0) for w in out_keys), batch_size, spatial_shape)
  coords = jnp.where(filled[:, None], coords, -1)
  rows = []
  for x in (a, b):
    sorted_keys, order = sorted_site_keys(x)
    rows.append(lookup_keys(sorted_keys, order, out_keys, filled))
  backs = [lookup_keys(out_keys, None, keys, keyed_rows(x)) for keys, x in ((keys_a, a), (keys_b, b))]
  return coords, count, rows[0], rows[1], backs[0], backs[1]


def _union(op: str, a: SparseTensor, b: SparseTensor, capacity, with_overflow: bool):
  _check_same_grid(op, a, b)
  for name, x in (("a", a), ("b", b)):  # only directly built tensors hold such rows
    check_inside_grid(op, x.coords, x.num, x.batch_size, x.spatial_shape, "they are dropped", name)
    # The union reads one of a repeated site's rows, and the gradient would reach all of them.
    check_distinct_sites(op, x.coords, x.num, name)
  capacity = check_capacity(capacity)
  grid = (a.spatial_shape, a.batch_size)
  if capacity is None or capacity == EXACT:
    count = _union_sites(a.coords, a.num, b.coords, b.num, *grid, a.capacity + b.capacity)[1]
    capacity = resolve_capacity(capacity, count, "capacity", "union sites")
  coords, count, a_rows, b_rows, a_back, b_back = _union_sites(a.coords, a.num, b.coords, b.num, *grid, capacity)
  overflow = _finish(op, "union sites", count, capacity, with_overflow)
  flag = a.overflow | b.overflow | overflow
  num = jnp.minimum(count, capacity)
  a_out = SparseTensor(coords, gather_injective(a.feats, a_rows, a_back), num, *grid, overflow=flag,
                       spatial_ndim=a.spatial_ndim)
  b_out = SparseTensor(coords, gather_injective(b.feats, b_rows, b_back), num, *grid, overflow=flag,
                       spatial_ndim=a.spatial_ndim)
  return a_out, b_out, overflow


@compiled_when_eager
def union(a: SparseTensor, b: SparseTensor, *, capacity: Capacity = None,
          with_overflow: bool = False) -> tuple[SparseTensor, SparseTensor] | tuple[SparseTensor, SparseTensor,
                                                                                     jax.Array]:
  """(a', b'): a and b placed on the union of their sites, with zero features where a tensor has no site.

  a and b must share spatial_shape and batch_size; their channels and dtypes may differ. a' and b' have the
  same coords (sorted by linear key) and num, so `jsparse.concat(a', b')` or any element-wise op of their
  features works on them (`add` and `multiply` are two). capacity: rows of the result (None: a bucket of the
  count, "exact": the count, both outside jit only; an int under jit, overflow as the module docstring says).
  Differentiable with respect to both tensors' features. The overflow flags of a and b carry over.
  """
  a_out, b_out, overflow = _union("union", a, b, capacity, with_overflow)
  return (a_out, b_out, overflow) if with_overflow else (a_out, b_out)


def _elementwise(op: str, fn, a: SparseTensor, b: SparseTensor, capacity, with_overflow):
  check_sparse_tensor(a, "a")
  check_sparse_tensor(b, "b")
  if a.num_channels != b.num_channels or a.dtype != b.dtype:
    raise ValueError(f"{op}: a and b need the same channels and dtype, got {a.num_channels} {a.dtype} and "
                     f"{b.num_channels} {b.dtype}")
  a_u, b_u, overflow = _union(op, a, b, capacity, with_overflow)
  out = a_u.replace(feats=fn(a_u.feats, b_u.feats).astype(a.dtype))
  return (out, overflow) if with_overflow else out


@compiled_when_eager
def add(a: SparseTensor, b: SparseTensor, *, capacity: Capacity = None,
        with_overflow: bool = False) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """a + b on the union of their sites (MinkowskiEngine's MinkowskiUnion): a site of one tensor only keeps
  its features, as adding the dense tensors and reading the union's sites. Same channels and dtype; capacity
  and overflow as `union`."""
  return _elementwise("add", jnp.add, a, b, capacity, with_overflow)


@compiled_when_eager
def multiply(a: SparseTensor, b: SparseTensor, *, capacity: Capacity = None,
             with_overflow: bool = False) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """a * b on the union of their sites, as multiplying the dense tensors and reading the union's sites: a
  site of one tensor only gets zeros. Same channels and dtype; capacity and overflow as `union`."""
  return _elementwise("multiply", jnp.multiply, a, b, capacity, with_overflow)


# ---- per-item vectors, child labels, dropout ------------------------------------------------------------


@compiled_when_eager
def broadcast_per_item(x: SparseTensor, values: ArrayLike) -> SparseTensor:
  """A tensor on x's sites whose row i holds values[batch of row i] (e.g. a per-shape latent or class
  embedding placed on every voxel of its shape; add it with `x.replace(feats=x.feats + y.feats)` or
  concatenate it with `jsparse.concat`).

  values: floating [x.batch_size, C]. Padding rows stay zero. Differentiable with respect to values; the
  gradient is a per-item sum by a one-hot product (jsparse.per_item), not a scatter-add.
  """
  check_sparse_tensor(x)
  values = jnp.asarray(values)
  if values.ndim != 2 or values.shape[0] != x.batch_size:
    raise ValueError(f"values must be [batch_size={x.batch_size}, C], got shape {values.shape}")
  if not jnp.issubdtype(values.dtype, jnp.floating):
    raise TypeError(f"values must be floating point, got dtype {values.dtype}")
  feats = per_item.per_row(per_item.item_one_hot(x), values).astype(values.dtype)
  return SparseTensor(x.coords, feats, x.num, x.spatial_shape, x.batch_size, caches=x.caches, overflow=x.overflow,
                      spatial_ndim=x.spatial_ndim)


@compiled_when_eager
def child_labels(coarse: SparseTensor, fine: SparseTensor, stride: Size3 = 2) -> jax.Array:
  """bool [coarse.capacity, sx*sy*sz]: which children of each coarse site are sites of `fine`.

  For 2D (1D) tensors stride is an int or 2 ints (1 int) and the result is [coarse.capacity, sy*sx] ([.., sx]),
  the child order of `sparse_conv_transpose2d` (1d).

  Child t of site c is c * stride + (i, j, k), t the C-order index of (i, j, k) in [0, stride)^3: the child
  order of `sparse_conv_transpose3d`'s mask, so the result is the teacher-forcing mask and the occupancy
  target of a coarse-to-fine decoder. coarse.spatial_shape must be fine's divided by stride, rounded up (the
  output grid of a kernel-size-equals-stride convolution or pool of fine padded "SAME") or down (padded 0);
  children outside fine's grid are False, and so are padding rows. Every fine site is then a labelled child of a
  coarse site when coarse was made from fine by a convolution or pool of this stride whose window of site c
  (taps c * stride - padding + v * dilation) holds c's children (kernel == stride with padding 0 does, and so
  does kernel 3, stride 2, padding 1). A coarse tensor made from fine's coordinates otherwise (e.g. "SAME"
  down-sampling by 3 on an extent of 7, which pads 1 before the grid) would leave fine sites that no label names:
  ValueError (under jit when it was made from the very arrays of fine).
  """
  check_sparse_tensor(coarse, "coarse")
  check_sparse_tensor(fine, "fine")
  if coarse.spatial_ndim != fine.spatial_ndim:
    raise ValueError(f"coarse ({coarse.spatial_ndim}D) and fine ({fine.spatial_ndim}D) must have one spatial_ndim")
  ndim = fine.spatial_ndim
  user = lambda sizes: tuple(sizes)[3 - ndim:]  # sizes as the user's rank has them, not lifted
  st = lift_triple(stride, "stride", ndim)
  if min(st) < 1:
    raise ValueError(f"stride must be >= 1, got {user(st)}")
  low = tuple(n // s for n, s in zip(fine.spatial_shape, st))
  high = tuple(-(-n // s) for n, s in zip(fine.spatial_shape, st))
  fits = all(lo <= c <= hi for lo, c, hi in zip(low, coarse.spatial_shape, high))
  if not fits or coarse.batch_size != fine.batch_size:
    raise ValueError(f"coarse (spatial_shape={user(coarse.spatial_shape)}, batch_size={coarse.batch_size}) is not "
                     f"the stride-{user(st)} grid of fine (spatial_shape between {user(low)} and {user(high)}, "
                     f"batch_size={fine.batch_size})")
  _check_child_windows(coarse, fine, st, user)
  check_inside_grid("child_labels", fine.coords, fine.num, fine.batch_size, fine.spatial_shape,
                    "they are nobody's child", "fine")
  t = math.prod(st)
  child = jnp.stack(jnp.unravel_index(jnp.arange(t), st), axis=-1).astype(jnp.int32)  # [T, 3], C order
  xyz = coarse.coords[:, None, 1:] * jnp.asarray(st, jnp.int32) + child[None]
  query = jnp.concatenate([jnp.broadcast_to(coarse.coords[:, None, :1], (coarse.capacity, t, 1)), xyz], axis=-1)
  ok = jnp.broadcast_to(coarse.valid_mask()[:, None], (coarse.capacity, t))
  return lookup_rows(fine, query, ok) >= 0


def _check_child_windows(coarse: SparseTensor, fine: SparseTensor, stride, user) -> None:
  """Raises ValueError when coarse carries the pair map of a convolution or pool of fine's coordinates whose window
  of a site does not hold all its children c * stride + t: a fine site whose parent's window misses it made another
  coarse site, and no label names it (the masks would not spawn it). Outside jit the coordinates are compared;
  under jit only the very arrays of fine count."""
  from jsparse.sparse_conv import PairMap

  for pm in coarse.caches.values():
    if not isinstance(pm, PairMap) or pm.out_coords is not coarse.coords:
      continue
    g = pm.geom
    # Child t of site c sits at c * stride + t, kernel tap (padding + t) / dilation of c's window.
    if g.stride == tuple(stride) and all((p + t) % d == 0 and (p + t) // d < k
                                         for k, s, p, d in zip(g.kernel_size, g.stride, g.padding, g.dilation)
                                         for t in range(s)):
      continue
    made_from_fine = pm.in_coords is fine.coords and pm.in_num is fine.num
    if not made_from_fine and is_traced(pm.in_coords, pm.in_num, fine.coords, fine.num) and eager_calls.collecting():
      raise NeedsHostValues("child_labels compares coarse's pair map with fine on the host")
    if not made_from_fine and not is_traced(pm.in_coords, pm.in_num, fine.coords, fine.num):
      made_from_fine = (pm.in_coords.shape == fine.coords.shape and bool(jnp.array_equal(pm.in_coords, fine.coords))
                        and int(pm.in_num) == int(fine.num))
    if made_from_fine:
      raise ValueError(f"child_labels: coarse was made from fine by a convolution or pool with kernel_size="
                       f"{user(g.kernel_size)}, stride={user(g.stride)}, padding={user(g.padding)}, dilation="
                       f"{user(g.dilation)}, whose windows miss children c * {user(stride)} + t of their sites: "
                       "fine sites there made other coarse sites and no label would name them (each window must "
                       "hold its site's children as taps: kernel_size = strides with padding 0 does; a module's "
                       "\"SAME\" pads before the grid where the stride leaves 2 or more cells)")


def check_rate(rate, what: str = "rate") -> float:
  """A dropout rate as a Python float in [0, 1]: Python and numpy reals pass (np.float32(0.5) too), as do a 0-d
  numpy array and a concrete scalar jax array; a traced rate raises TypeError (the rate is static: it decides while
  tracing whether anything is dropped); bools, strings, NaN and values outside [0, 1] raise ValueError naming
  `what`."""
  if isinstance(rate, jax.core.Tracer):
    raise TypeError(f"{what} must be a static number in [0, 1], got a traced value {rate}: the rate decides "
                    "while tracing whether anything is dropped, so pass it as a Python float (close over it, or "
                    "mark it static with jax.jit's static_argnums / static_argnames)")
  if isinstance(rate, (jax.Array, np.ndarray)) and rate.shape == () and not jnp.issubdtype(rate.dtype, jnp.bool_):
    rate = rate.item()
  if not isinstance(rate, numbers.Real) or isinstance(rate, (bool, np.bool_)) or not 0.0 <= rate <= 1.0:
    raise ValueError(f"{what} must be a number in [0, 1], got {rate!r}")
  return float(rate)


def dropout(x: SparseTensor, rate: float, *, rng: jax.Array | None = None,
            deterministic: bool = False) -> SparseTensor:
  """flax's nn.Dropout on the features: each entry is zeroed with probability `rate` and the rest scaled by
  1 / (1 - rate). deterministic=True (or rate 0) returns x unchanged; rng (a jax.random key) is required
  otherwise. Padding rows stay zero; the coordinates and maps are x's."""
  check_sparse_tensor(x)
  rate = check_rate(rate)
  if deterministic or rate == 0.0:
    return x
  if rate == 1.0:
    return x.replace(feats=jnp.zeros_like(x.feats))
  if rng is None:
    raise ValueError("dropout needs rng (a jax.random key) unless deterministic=True")
  keep = jax.random.bernoulli(rng, 1.0 - rate, x.feats.shape) & x.valid_mask()[:, None]
  return x.replace(feats=jnp.where(keep, x.feats / (1.0 - rate), 0).astype(x.dtype))
