"""Pooling: max and mean over the windows of a strided pair map, and over whole batch items.

The window pools read their inputs through the pair map's `nbr` (output row i, offset v -> input row) and
route gradients back through its transpose `inv` (input row j, offset v -> output row), so both directions
are gathers: no scatter-add, no half-precision atomics (the autodiff of a gather is a scatter-add, which
serialised on fp16 atomics on a GPU). Sums accumulate in float32.

Max pooling keeps, per output row and channel, the offset of the winning input (the first in offset order on
ties), so the gradient goes to exactly one input: a subgradient, as a dense reduce_window max gives.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jsparse.eager import compiled_when_eager
from jsparse import per_item
from jsparse._types import Capacity, Size3
from jsparse.gemm_xla import gather_rows
from jsparse.sparse_conv import pair_map
from jsparse.sparse_tensor import SparseTensor, check_sparse_tensor, check_spatial_ndim

_GLOBAL_REDUCE = ("mean", "max", "sum")


def _offset_dtype(num_offsets: int):
  return jnp.int8 if num_offsets <= 127 else jnp.int32


def _to_inputs(out_values, inv, disjoint: bool, select=None):
  """grad_in[j] = sum over offsets v with inv[j, v] >= 0 of out_values[inv[j, v]] (float32), keeping a term
  only where select(rows [.., C] of the output, v) is True. disjoint: each input feeds at most one output
  (windows do not overlap), so one gather per row replaces V of them."""
  v = inv.shape[1]
  if disjoint:
    slot = jnp.argmax(inv >= 0, axis=1).astype(jnp.int32)  # the one offset that reads row j (0 if none)
    owner = jnp.max(inv, axis=1)                           # its output row, -1 if none
    vals = gather_rows(out_values, owner).astype(jnp.float32)
    keep = (owner >= 0)[:, None]
    if select is not None:
      keep = keep & select(jnp.maximum(owner, 0), slot[:, None])
    return jnp.where(keep, vals, 0)
  rows = jnp.maximum(inv, 0)
  vals = gather_rows(out_values, inv).astype(jnp.float32)  # [N, V, C]
  keep = (inv >= 0)[..., None]
  if select is not None:
    keep = keep & select(rows, jnp.arange(v, dtype=jnp.int32)[None, :, None])
  return jnp.sum(jnp.where(keep, vals, 0), axis=1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _window_max(feats, nbr, inv, disjoint: bool):
  return _window_max_fwd(feats, nbr, inv, disjoint)[0]


def _window_max_fwd(feats, nbr, inv, disjoint):
  windows = gather_rows(feats, nbr, -jnp.inf)
  winner = jnp.argmax(windows, axis=1)  # [M, C], first max (or NaN) on ties
  # XLA's CPU max reduction can drop a NaN (it returned the finite max of a [128, 8, C] window set), so a NaN
  # is put back explicitly: a sibling reduction of the same windows, which the GPU fuses with the other two.
  out = jnp.where(jnp.any(jnp.isnan(windows), axis=1), jnp.nan, jnp.max(windows, axis=1)).astype(feats.dtype)
  # Where every input of a window is -inf it ties with the -inf fill of the absent offsets, and argmax may pick
  # an absent one, whose gradient reaches no input: the winner is then the first present input.
  first_present = jnp.argmax(nbr >= 0, axis=1)
  winner = jnp.where(out == -jnp.inf, first_present[:, None], winner).astype(_offset_dtype(nbr.shape[1]))
  return out, (winner, nbr, inv, jnp.zeros((0,), feats.dtype))


def _window_max_bwd(disjoint, res, g):
  winner, nbr, inv, dtype_of = res
  # Input j gets output i's gradient in channel c only if it was i's winner there (offset v won).
  grad = _to_inputs(g, inv, disjoint, select=lambda rows, v: gather_rows(winner, rows).astype(jnp.int32) == v)
  return grad.astype(dtype_of.dtype), None, None


_window_max.defvjp(_window_max_fwd, _window_max_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _window_mean(feats, nbr, inv, disjoint: bool):
  return _window_mean_fwd(feats, nbr, inv, disjoint)[0]


def _window_mean_fwd(feats, nbr, inv, disjoint):
  total = jnp.sum(gather_rows(feats, nbr), axis=1, dtype=jnp.float32)
  count = jnp.maximum(jnp.sum(nbr >= 0, axis=1, dtype=jnp.int32), 1).astype(jnp.float32)
  return total / count[:, None], (count, inv, jnp.zeros((0,), feats.dtype))


def _window_mean_bwd(disjoint, res, g):
  count, inv, dtype_of = res
  grad = _to_inputs(g.astype(jnp.float32) / count[:, None], inv, disjoint)
  return grad.astype(dtype_of.dtype), None, None


_window_mean.defvjp(_window_mean_fwd, _window_mean_bwd)


def _pool(x: SparseTensor, kernel_size, stride, padding, dilation, out_capacity, reduce: str, with_overflow,
          implementation):
  op = f"sparse_{reduce.replace('mean', 'avg')}_pool3d"
  check_spatial_ndim(x, 3, op)
  st = kernel_size if stride is None else stride
  pm = pair_map(x, kernel_size, st, padding, dilation, out_capacity, implementation=implementation, op=op,
                raise_overflow=not with_overflow)
  g = pm.geom
  # Windows are disjoint when each one ends before the next begins along every axis.
  disjoint = all(d * (k - 1) + 1 <= s for k, s, d in zip(g.kernel_size, g.stride, g.dilation))
  window = _window_max if reduce == "max" else _window_mean
  out = window(x.feats, pm.nbr, pm.inv, disjoint)
  valid = jnp.arange(pm.out_capacity) < pm.out_num
  out = pm.output(jnp.where(valid[:, None], out, 0).astype(x.dtype), x)
  return (out, pm.overflow) if with_overflow else out


@compiled_when_eager
def sparse_max_pool3d(x: SparseTensor, kernel_size: Size3, stride: Size3 | None = None, padding: Size3 = 0,
                      dilation: Size3 = 1, *, out_capacity: Capacity = None, with_overflow: bool = False,
                      implementation: str | None = None) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """Max over the valid inputs in each window (inactive sites do not count as zeros).

  Output sites and grid as sparse_conv3d (stride defaults to kernel_size); the output carries the pair map,
  so `sparse_inverse_conv3d(..., like=x)` can scatter back through it. Equals a dense reduce_window max with
  -inf at inactive sites and in the padding, read at the output sites (spconv's max pool starts from 0
  instead, so the two agree only on non-negative inputs, e.g. after a ReLU). The gradient goes to the first
  input in offset order among ties. implementation: how the output sites are found (`pair_map`).
  Overflow of out_capacity as sparse_conv3d: ValueError outside jit (with_overflow=True: returned as
  (output, overflow) instead); under jit the output's flag (`jsparse.overflowed`) and, inside
  `jsparse.error_checks()`, a `jax.experimental.checkify` report.
  """
  return _pool(x, kernel_size, stride, padding, dilation, out_capacity, "max", with_overflow, implementation)


@compiled_when_eager
def sparse_avg_pool3d(x: SparseTensor, kernel_size: Size3, stride: Size3 | None = None, padding: Size3 = 0,
                      dilation: Size3 = 1, *, out_capacity: Capacity = None, with_overflow: bool = False,
                      implementation: str | None = None) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """Mean over the valid inputs in each window: sum of the active inputs / their number (not / window size,
  which is what a dense average pool over zero-filled inactive sites would give). Sites as sparse_max_pool3d."""
  return _pool(x, kernel_size, stride, padding, dilation, out_capacity, "mean", with_overflow, implementation)


@jax.custom_vjp
def _max_per_item(feats, seg, one_hot):
  """[batch_size, C]: the max of each item's rows (seg: the row's item, batch_size for padding rows)."""
  return jax.ops.segment_max(feats, seg, num_segments=one_hot.shape[1] + 1)[:-1]


def _max_per_item_fwd(feats, seg, one_hot):
  out = _max_per_item(feats, seg, one_hot)
  return out, (feats, one_hot, out)


def _max_per_item_bwd(res, g):
  """The item's cotangent split evenly among its rows at the max, as jnp.max's gradient does. Not autodiff of the
  scatter-max: that counts the -inf the scatter starts from as one more tie, so an item whose maximum is -inf
  passed 1 / (ties + 1) of its cotangent (half of it for a single row) to its rows."""
  feats, one_hot, out = res
  valid = per_item.valid_rows(one_hot)[:, None]
  at_max = valid & (feats.astype(jnp.float32) == per_item.per_row(one_hot, out))
  ties = per_item.sum_per_item(one_hot, at_max)
  grad = jnp.where(at_max, per_item.per_row(one_hot, g / jnp.maximum(ties, 1.0)), 0)
  return grad.astype(feats.dtype), None, jnp.zeros_like(one_hot)


_max_per_item.defvjp(_max_per_item_fwd, _max_per_item_bwd)


@compiled_when_eager
def global_pool(x: SparseTensor, reduce: str = "mean") -> jax.Array:
  """[batch_size, C]: per batch item, the "mean" | "max" | "sum" of the feats of its valid rows.

  Batch items without sites give zeros (also for "max"). Accumulates in float32; returns x's dtype. The
  gradient of "max" splits evenly among an item's tied maxima (as `jnp.max`'s does), where the window pools
  give it all to the first input in offset order.
  """
  check_sparse_tensor(x)
  if reduce not in _GLOBAL_REDUCE:
    raise ValueError(f"reduce must be one of {_GLOBAL_REDUCE}, got {reduce!r}")
  # Per-item sums as one-hot matmuls, not segment sums (scatter-adds into batch_size slots: see per_item.py).
  one_hot = per_item.item_one_hot(x)
  counts = per_item.count_per_item(one_hot)
  if reduce == "max":
    # A scatter-max (no one-hot form for max: a masked max over [rows, batch, C] materialises that whole
    # array in its gradient). Padding rows go to an extra segment that is dropped.
    seg = jnp.where(x.valid_mask(), x.coords[:, 0], x.batch_size)
    out = _max_per_item(x.feats, seg, one_hot)
    out = jnp.where(counts[:, None] > 0, out, 0)
  else:
    out = per_item.sum_per_item(one_hot, x.feats)
    if reduce == "mean":
      out = out / jnp.maximum(counts, 1)[:, None]
  return out.astype(x.dtype)


__all__ = ["sparse_max_pool3d", "sparse_avg_pool3d", "global_pool"]
