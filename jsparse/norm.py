"""Normalisations and activations on SparseTensors (functional; the flax modules are in jsparse.nn).

Every statistic is taken over the valid rows only (padding rows would otherwise pull means towards zero and
shrink variances by the fill fraction, which changes with the capacity bucket), every output is zero at
padding rows, and everything is differentiable. Statistics accumulate in float32; outputs have the input's
dtype unless `dtype` says otherwise.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jsparse import per_item
from jsparse.sparse_tensor import SparseTensor

__all__ = ["activation", "batch_statistics", "batch_norm", "layer_norm", "group_norm", "group_statistics"]


def _mask(x: SparseTensor) -> jax.Array:
  return x.valid_mask()[:, None]


def _finish(x: SparseTensor, y: jax.Array, scale, bias, dtype) -> SparseTensor:
  """Applies the affine part, zeros padding rows, casts."""
  if scale is not None:
    y = y * jnp.asarray(scale, jnp.float32)
  if bias is not None:
    y = y + jnp.asarray(bias, jnp.float32)
  y = jnp.where(_mask(x), y, 0)  # the affine bias (and fn(0)) must not leak into padding rows
  return x.replace(feats=y.astype(dtype if dtype is not None else x.dtype))


def _check_affine(name: str, value, channels: int):
  if value is not None and jnp.shape(value) != (channels,):
    raise ValueError(f"{name} must have shape ({channels},) for {channels} channels, got {jnp.shape(value)}")


def activation(x: SparseTensor, fn: Callable[[jax.Array], jax.Array]) -> SparseTensor:
  """`fn` applied to the features of the valid rows; padding rows stay zero even where fn(0) != 0."""
  return x.replace(feats=jnp.where(_mask(x), fn(x.feats), 0).astype(x.dtype))


# ---- batch norm ------------------------------------------------------------------------------------------


def batch_statistics(x: SparseTensor, *, axis_name=None, axis_index_groups=None):
  """(mean, var), float32 [C]: per channel over the valid rows of the whole batch.

  axis_name: a mapped axis (shard_map / pmap) to pool the rows of every device over. Counts and sums are
    psum'd, so the result is the statistic of the union of all devices' valid rows even when their row
    counts differ (a pmean of per-device means would weight them equally).
  The variance is the biased one. Each device centres its rows on its own mean first (two passes, for
  accuracy); with axis_name the devices' (count, sum, centred sum of squares + count * own mean^2) then
  travel in one psum, and var = pooled second moment about zero of the device means + pooled within-device
  part (Chan et al.'s parallel formula): one cross-device reduction per call instead of two dependent ones
  (the centred pass needed the pooled mean), each a synchronisation point of a data-parallel step. Only the
  between-device part is a difference of squares; its float32 rounding is ~1e-7 * mean^2 / var relative.
  """
  mask = _mask(x)
  f = jnp.where(mask, x.feats.astype(jnp.float32), 0)
  count = jnp.asarray(x.num, jnp.float32)
  local_mean = jnp.sum(f, axis=0) / jnp.maximum(count, 1.0)  # an all-padding batch gives mean 0, var 0
  centred = jnp.where(mask, f - local_mean, 0)
  m2 = jnp.sum(centred * centred, axis=0)
  if axis_name is None:
    return local_mean, m2 / jnp.maximum(count, 1.0)
  count, total, second = lax.psum((count, count * local_mean, m2 + count * local_mean * local_mean), axis_name,
                                  axis_index_groups=axis_index_groups)
  denom = jnp.maximum(count, 1.0)
  mean = total / denom
  var = jnp.maximum(second / denom - mean * mean, 0.0)  # >= 0 up to rounding; clamp that away
  return mean, var


def batch_norm(x: SparseTensor, scale=None, bias=None, *, mean=None, var=None, epsilon: float = 1e-5,
               axis_name=None, axis_index_groups=None, dtype=None) -> SparseTensor:
  """(x - mean) / sqrt(var + epsilon) * scale + bias on every valid row.

  mean, var: [C]; both None computes them from x with `batch_statistics` (pooled over `axis_name` if given);
    pass running averages for inference.
  scale, bias: [C] or None.
  """
  c = x.num_channels
  _check_affine("scale", scale, c)
  _check_affine("bias", bias, c)
  if (mean is None) != (var is None):
    raise ValueError("pass both mean and var (running statistics) or neither (batch statistics)")
  if mean is None:
    mean, var = batch_statistics(x, axis_name=axis_name, axis_index_groups=axis_index_groups)
  _check_affine("mean", mean, c)
  _check_affine("var", var, c)
  y = (x.feats.astype(jnp.float32) - mean) * lax.rsqrt(jnp.asarray(var, jnp.float32) + epsilon)
  return _finish(x, y, scale, bias, dtype)


# ---- layer norm ------------------------------------------------------------------------------------------


def layer_norm(x: SparseTensor, scale=None, bias=None, *, epsilon: float = 1e-6, dtype=None) -> SparseTensor:
  """Normalises each valid row over its channels (rows are independent, so padding cannot leak in)."""
  c = x.num_channels
  _check_affine("scale", scale, c)
  _check_affine("bias", bias, c)
  f = x.feats.astype(jnp.float32)
  mean = jnp.mean(f, axis=-1, keepdims=True)
  var = jnp.mean(jnp.square(f - mean), axis=-1, keepdims=True)
  return _finish(x, (f - mean) * lax.rsqrt(var + epsilon), scale, bias, dtype)


# ---- group norm ------------------------------------------------------------------------------------------


def _check_groups(channels: int, num_groups: int) -> int:
  if not isinstance(num_groups, int) or num_groups <= 0:
    raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
  if channels % num_groups:
    raise ValueError(f"the number of channels ({channels}) must be divisible by num_groups ({num_groups})")
  return channels // num_groups


def _group_moments(x: SparseTensor, num_groups: int):
  """(mean, var [batch_size, G], the valid rows centred on their item's group mean [capacity, G, group_size],
  the item one-hot [capacity, batch_size]); padding rows of the centred array are zero."""
  group_size = _check_groups(x.num_channels, num_groups)
  one_hot = per_item.item_one_hot(x)  # sums per item as matmuls, not scatter-adds (see per_item.py)
  valid = x.valid_mask()
  f = jnp.where(valid[:, None], x.feats.astype(jnp.float32), 0).reshape(x.capacity, num_groups, group_size)
  denom = jnp.maximum(per_item.count_per_item(one_hot) * group_size, 1.0)[:, None]
  mean = per_item.sum_per_item(one_hot, jnp.sum(f, axis=-1)) / denom
  centred = jnp.where(valid[:, None, None], f - per_item.per_row(one_hot, mean)[..., None], 0)
  var = per_item.sum_per_item(one_hot, jnp.sum(centred * centred, axis=-1)) / denom
  return mean, var, centred, one_hot


def group_statistics(x: SparseTensor, num_groups: int):
  """(mean, var), float32 [batch_size, num_groups]: over the channels of each group and the valid rows of
  each batch item. Batch items without valid rows get mean 0, var 0."""
  mean, var, _, _ = _group_moments(x, num_groups)
  return mean, var


def group_norm(x: SparseTensor, num_groups: int, scale=None, bias=None, *, epsilon: float = 1e-6,
               dtype=None) -> SparseTensor:
  """Group normalisation per batch item: each group of channels is normalised with the statistics of that
  group over the valid rows of the row's batch item (the sparse twin of flax's GroupNorm on [B, X, Y, Z, C],
  counting active sites only)."""
  c = x.num_channels
  _check_groups(c, num_groups)
  _check_affine("scale", scale, c)
  _check_affine("bias", bias, c)
  _, var, centred, one_hot = _group_moments(x, num_groups)
  row_inv = per_item.per_row(one_hot, lax.rsqrt(var + epsilon))  # padding rows: 0 (and centred is 0 there)
  y = (centred * row_inv[..., None]).reshape(x.capacity, c)
  return _finish(x, y, scale, bias, dtype)
