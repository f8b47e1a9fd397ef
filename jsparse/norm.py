"""Normalisations and activations on SparseTensors (functional; the flax modules are in jsparse.nn).

Every statistic is taken over the valid rows only (padding rows would otherwise pull means towards zero and
shrink variances by the fill fraction, which changes with the capacity bucket), every output is zero at
padding rows, and everything is differentiable. Statistics accumulate in float32; outputs have the input's
dtype unless `dtype` says otherwise.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jsparse.eager import compiled_when_eager
from jsparse import dispatch, per_item
from jsparse._types import ArrayLike
from jsparse.sparse_tensor import (SparseTensor, as_int, as_nonnegative_float, check_feats_dtype, check_sparse_tensor,
                                    report)
from pallas_kernels import channel_moments
from pallas_kernels.out_struct import same_vma

__all__ = ["activation", "batch_statistics", "batch_norm", "layer_norm", "group_norm", "group_statistics"]


def _mask(x: SparseTensor) -> jax.Array:
  return x.valid_mask()[:, None]


def _valid_feats_f32(x: SparseTensor) -> jax.Array:
  """x's features in float32 with padding rows zeroed: a non-finite value left there (a tensor built directly)
  would otherwise give NaN derivatives (0 * NaN) in the backward, which scale and bias gradients sum over."""
  return jnp.where(_mask(x), x.feats.astype(jnp.float32), 0)


def _finish(x: SparseTensor, y: jax.Array, scale, bias, dtype) -> SparseTensor:
  """Applies the affine part, zeros padding rows, casts."""
  if scale is not None:
    y = y * jnp.asarray(scale, jnp.float32)
  if bias is not None:
    y = y + jnp.asarray(bias, jnp.float32)
  y = jnp.where(_mask(x), y, 0)  # the affine bias (and fn(0)) must not leak into padding rows
  return x.replace(feats=y.astype(dtype if dtype is not None else x.dtype))


def _output_dtype(x: SparseTensor, dtype) -> np.dtype:
  """The output's dtype: `dtype`, or x's if None. TypeError naming `dtype` for a non-float one (the cast
  output was refused later as "feats", an argument the caller never passed)."""
  out = jnp.dtype(dtype if dtype is not None else x.dtype)
  check_feats_dtype(out, "dtype")
  return out


def _check_affine(name: str, value, channels: int):
  if value is not None and jnp.shape(value) != (channels,):
    raise ValueError(f"{name} must have shape ({channels},) for {channels} channels, got {jnp.shape(value)}")


def activation(x: SparseTensor, fn: Callable[[jax.Array], jax.Array]) -> SparseTensor:
  """`fn` applied to the features of the valid rows; padding rows stay zero even where fn(0) != 0.

  fn maps the [capacity, C] features to [capacity, C'] (C' = C for an elementwise fn; jax.nn.glu halves it)."""
  check_sparse_tensor(x)
  if not callable(fn):
    raise TypeError(f"fn must be a callable (e.g. jax.nn.relu), got {fn!r}")
  mask = _mask(x)
  # fn sees zeros on padding rows: a NaN or inf left there would give a NaN derivative (0 * NaN) in the backward.
  y = fn(jnp.where(mask, x.feats, 0))
  # A row per site: a result of another shape (a reduction over rows or channels) broadcast against the row mask
  # into a [capacity, capacity] array. Channels may change (jax.nn.glu halves them).
  if getattr(y, "ndim", None) != 2 or y.shape[0] != x.capacity:
    raise ValueError(f"fn must map the [capacity, C] = {tuple(x.feats.shape)} features to [capacity, C'] "
                     f"(a row per site), got shape {getattr(y, 'shape', type(y).__name__)}")
  return x.replace(feats=jnp.where(mask, y, 0).astype(x.dtype))


# ---- batch norm ------------------------------------------------------------------------------------------


def _corrected_moments(mean: jax.Array, centred_mean: jax.Array, centred_square_mean: jax.Array):
  """(mean, biased var) from a first mean and the mean and mean square of the values centred on it.

  The centred values' mean is what rounding left out of the first mean (XLA divides by a count as a product with
  its rounded reciprocal): added back, a constant feature's mean is exact and it normalises to 0, where a mean 1
  ulp off divided by sqrt(epsilon) gave up to +-0.7; its square comes off the variance.
  """
  return mean + centred_mean, jnp.maximum(centred_square_mean - centred_mean * centred_mean, 0.0)


def batch_statistics(x: SparseTensor, *, axis_name=None, axis_index_groups=None, return_count: bool = False):
  """(mean, var), float32 [C]: per channel over the valid rows of the whole batch.

  axis_name: a mapped axis (shard_map / pmap) to pool the rows of every device over. The result is the
    statistic of the union of all devices' valid rows even when their row counts differ (a pmean of
    per-device means would weight them equally).
  return_count: also return the number of valid rows the statistics are over, a float32 scalar (every
    device's together with axis_name): (mean, var, count). It comes out of the same psum, so a caller that
    needs it (the modules' running averages skip batches without rows) pays no second cross-device reduction.
  The variance is the biased one. Each device centres its rows on its own float32 mean first (two passes,
  for accuracy). With axis_name every device's (count, mean, mean of its centred rows, centred sum of
  squares) goes into its own slot of a [devices, 3C + 1] array that one psum fills in everywhere (a gather
  that stays replicated, which shard_map's out_specs=P() needs); each device then combines the slots with
  Chan et al.'s parallel formula, var = (sum of within-device parts + sum_d count_d (mean_d - mean)^2) /
  count, every term centred. So one cross-device reduction per call (a synchronisation point of a
  data-parallel step) and no difference of squares: pooling sum x^2 - count mean^2 instead lost everything
  for means far above the spread (mean 1000, std 0.1 gave var 0). The device means enter as offsets from
  one device's mean, each with the mean of its centred rows (what float32 rounding of the mean left out)
  added back, so their rounding does not reach the between-device part either: as accurate as one device.
  """
  check_sparse_tensor(x)
  mask = _mask(x)
  f = jnp.where(mask, x.feats.astype(jnp.float32), 0)
  count = jnp.asarray(x.num, jnp.float32)
  local_mean = jnp.sum(f, axis=0) / jnp.maximum(count, 1.0)  # an all-padding batch gives mean 0, var 0
  # One value of the mean for every use below: XLA may otherwise recompute the sum inside each consumer's
  # fusion in another order, and the residual would then measure a different rounding than the one sent.
  local_mean = lax.optimization_barrier(local_mean)
  centred = jnp.where(mask, f - local_mean, 0)
  m2 = jnp.sum(centred * centred, axis=0)
  residual = jnp.sum(centred, axis=0) / jnp.maximum(count, 1.0)  # the exact mean is ~ local_mean + residual
  if axis_name is None:
    mean, var = _corrected_moments(local_mean, residual, m2 / jnp.maximum(count, 1.0))
    return (mean, var, count) if return_count else (mean, var)
  mine = jnp.concatenate([count[None], local_mean, residual, m2])
  # Slots by the index along the whole axis: with axis_index_groups the other groups' slots stay zero
  # (count 0), which the combination ignores.
  slot = jnp.arange(lax.axis_size(axis_name)) == lax.axis_index(axis_name)
  try:
    slots = lax.psum(jnp.where(slot[:, None], mine[None], 0.0), axis_name, axis_index_groups=axis_index_groups)
  except NotImplementedError as e:
    if axis_index_groups is None or str(e):  # vmap's says "not supported in vmap collectives": it stands
      raise
    # JAX's psum under jax.shard_map raises a bare NotImplementedError for groups, naming neither argument.
    raise NotImplementedError(
        f"axis_index_groups={axis_index_groups!r} is not supported by JAX's psum here (jax.shard_map has no "
        "axis_index_groups; jax.pmap does): inside shard_map pool over a mesh axis of its own instead (axis_name "
        "naming a sub-mesh axis)") from e
  counts = slots[:, 0]
  means, residuals, m2s = jnp.split(slots[:, 1:], 3, axis=1)
  total = jnp.sum(counts)
  denom = jnp.maximum(total, 1.0)
  reference = means[jnp.argmax(counts > 0)]  # a device with rows: its mean is near the data
  offsets = (means - reference) + residuals  # each device's mean relative to the reference, small and exact
  shift = jnp.sum(counts[:, None] * offsets, axis=0) / denom
  spread = offsets - shift
  # Within-device parts about the exact device means (m2 is about the rounded one: minus count * residual^2).
  within = m2s - counts[:, None] * residuals * residuals
  var = jnp.maximum(jnp.sum(within + counts[:, None] * spread * spread, axis=0) / denom, 0.0)
  return (reference + shift, var, total) if return_count else (reference + shift, var)


@compiled_when_eager
def batch_norm(x: SparseTensor, scale: ArrayLike | None = None, bias: ArrayLike | None = None, *,
               mean: ArrayLike | None = None, var: ArrayLike | None = None, epsilon: float = 1e-5,
               axis_name=None, axis_index_groups=None, dtype=None, activation: Callable | None = None,
               return_statistics: bool = False, implementation: str | None = None):
  """activation((x - mean) / sqrt(var + epsilon) * scale + bias) on every valid row.

  mean, var: [C]; both None computes them from x (batch statistics; pooled over `axis_name` if given, with
    `batch_statistics`); pass running averages for inference.
  scale, bias: [C] or None. activation: an elementwise function applied in the same pass (e.g. jax.nn.relu),
    or None.
  return_statistics: also return the (mean, var) used, float32 [C] (for running averages).
  implementation: who takes the column sums of batch statistics on one device: None or "xla" (XLA's
    reductions, everywhere), or "pallas" (the kernels of `pallas_kernels.channel_moments`; opt-in, because on a
    GPU they measured no faster than XLA's, docs/perf_notes.md). The elementwise passes are XLA's either way.

  With batch statistics on one device the whole op is one differentiable unit (`_batch_norm_train`): a pass
  over x for the statistics, a pass that writes the output, and a backward of one reduction pass and one
  elementwise pass that recomputes the normalised rows instead of storing them, the activation included.
  That statistics pass sums the rows shifted by the first valid row (one read of x); its variance's relative
  error grows like float32 epsilon x rows x (first row - mean)^2 / var, so only a first row thousands of
  standard deviations out costs accuracy (percents at 1e5 rows); `batch_statistics` (two passes) is exact there.
  """
  check_sparse_tensor(x)
  epsilon = as_nonnegative_float(epsilon, "epsilon", scalars_only=True)
  c = x.num_channels
  _check_affine("scale", scale, c)
  _check_affine("bias", bias, c)
  if (mean is None) != (var is None):
    raise ValueError("pass both mean and var (running statistics) or neither (batch statistics)")
  if activation is not None and not callable(activation):
    raise TypeError(f"activation must be a callable such as jax.nn.relu, got {activation!r}")
  out_dtype = _output_dtype(x, dtype)
  # XLA unless asked: the Pallas reductions measured no faster on a GPU.
  impl = dispatch.resolve("xla" if implementation is None else implementation)
  if mean is None and axis_name is None:
    ones, zeros = jnp.ones(c, jnp.float32), jnp.zeros(c, jnp.float32)
    s = ones if scale is None else jnp.asarray(scale, jnp.float32)
    b = zeros if bias is None else jnp.asarray(bias, jnp.float32)
    # Inside shard_map the custom_vjp must see every input vary over the feature's mesh axes: a replicated scale
    # would otherwise get a per-device cotangent (its pcast here transposes to the psum autodiff needs).
    feats, num, s, b = same_vma(x.feats, jnp.asarray(x.num, jnp.int32), s, b)
    y, mean, var = _batch_norm_train(feats, num, s, b, epsilon, activation, out_dtype, impl)
    out = x.replace(feats=y)
    return (out, (mean, var)) if return_statistics else out
  if mean is None:
    mean, var = batch_statistics(x, axis_name=axis_name, axis_index_groups=axis_index_groups)
  _check_affine("mean", mean, c)
  _check_affine("var", var, c)
  # A reported check, not a host one, so that an eager inference call (running statistics given) compiles; a
  # concrete var (also a constant under the caller's jit, where jnp would trace the comparison) is checked in numpy.
  negative = (jnp.sum(jnp.asarray(var) < 0, dtype=jnp.int32) if isinstance(var, jax.core.Tracer)
              else np.sum(np.asarray(var, np.float32) < 0, dtype=np.int32))
  var = jnp.asarray(var, jnp.float32)
  report(negative > 0, "batch_norm: var must be >= 0 (running variances are); {count} of its entries are negative",
         count=negative)
  y = (_valid_feats_f32(x) - mean) * lax.rsqrt(var + epsilon)
  if activation is not None:
    if scale is not None:
      y = y * jnp.asarray(scale, jnp.float32)
    if bias is not None:
      y = y + jnp.asarray(bias, jnp.float32)
    y, scale, bias = activation(y), None, None
  out = _finish(x, y, scale, bias, out_dtype)
  return (out, (jnp.asarray(mean, jnp.float32), jnp.asarray(var, jnp.float32))) if return_statistics else out


def _moments(feats, num, impl: dispatch.Implementation):
  """(count, mean, biased var) float32 over the rows < num, in one pass: sums of the rows shifted by the first
  row (a sample of the data, so the difference of squares cancels little, unlike sums about zero)."""
  count = jnp.minimum(num, feats.shape[0]).astype(jnp.float32)
  n = jnp.maximum(count, 1.0)
  # Zero without valid rows: row 0 is then padding, whatever it holds (an inf would turn the mean into nan).
  first = feats[0] if feats.shape[0] else jnp.zeros(feats.shape[1:], feats.dtype)
  shift = jnp.where(count > 0, first.astype(jnp.float32), 0.0)
  if impl.is_pallas:
    s1, s2 = channel_moments.channel_moments(feats, num, shift, interpret=impl.interpret)
  else:
    d = jnp.where(_valid(feats, num)[:, None], feats.astype(jnp.float32) - shift, 0)
    s1, s2 = jnp.sum(d, axis=0), jnp.sum(d * d, axis=0)
  mean_d = s1 / n
  return n, shift + mean_d, jnp.maximum(s2 / n - mean_d * mean_d, 0.0)


def _valid(feats, num):
  return jnp.arange(feats.shape[0]) < num


def _normalise(feats, valid, mean, inv_std, scale, bias, activation):
  z = (feats.astype(jnp.float32) - mean) * (inv_std * scale) + bias
  y = z if activation is None else activation(z)
  return jnp.where(valid[:, None], y, 0)


def _activation_grad(g_y, xhat, valid, scale, bias, activation):
  """float32 g_y pulled back through activation(xhat * scale + bias), recomputing the pre-activation instead of
  storing it; zero at the rows that are not valid."""
  g = g_y.astype(jnp.float32)
  if activation is not None:
    _, act_vjp = jax.vjp(activation, xhat * scale + bias)
    g = act_vjp(g)[0]
  return jnp.where(valid, g, 0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _batch_norm_train(feats, num, scale, bias, epsilon, activation, out_dtype, impl):
  return _batch_norm_train_fwd(feats, num, scale, bias, epsilon, activation, out_dtype, impl)[0]


def _batch_norm_train_fwd(feats, num, scale, bias, epsilon, activation, out_dtype, impl):
  n, mean, var = _moments(feats, num, impl)
  inv_std = lax.rsqrt(var + epsilon)
  y = _normalise(feats, _valid(feats, num), mean, inv_std, scale, bias, activation).astype(out_dtype)
  return (y, mean, var), (feats, num, scale, bias, n, mean, inv_std)


def _batch_norm_train_bwd(epsilon, activation, out_dtype, impl, res, cotangents):
  feats, num, scale, bias, n, mean, inv_std = res
  g_y, g_mean, g_var = cotangents
  # Tied to the cotangent, the recomputation below cannot run before the backward: otherwise XLA fuses the
  # activation's derivative into the forward pass and keeps it as a [rows, C] mask until here (measured: five
  # such masks, 133 MB, in MinkUNet's fp16 training step; docs/perf_notes.md).
  g_y, feats, mean, inv_std = lax.optimization_barrier((g_y, feats, mean, inv_std))
  valid = _valid(feats, num)[:, None]

  def pulled_back(feats, mean, inv_std):
    """(xhat, g) float32 [rows, C]: the normalised rows and dy pulled back through the activation. Padding rows
    may hold anything (a nan there would reach sum_gx through 0 * nan): they become zeros first."""
    xhat = jnp.where(valid, (feats.astype(jnp.float32) - mean) * inv_std, 0)
    return xhat, _activation_grad(g_y, xhat, valid, scale, bias, activation)

  xhat, g = pulled_back(feats, mean, inv_std)
  if impl.is_pallas:  # one read of x and dy for both sums
    sum_g, sum_gx = channel_moments.normalised_grad_sums(feats, g_y, num, mean, inv_std, scale, bias,
                                                         activation=activation, interpret=impl.interpret)
  else:
    sum_g, sum_gx = jnp.sum(g, axis=0), jnp.sum(g * xhat, axis=0)
  if activation is not None:
    # The dx pass recomputes the activation's derivative from x behind a barrier: shared with the sums, XLA
    # wrote it as a [rows, C] mask of its own, one more write and two more reads (docs/perf_notes.md).
    feats, mean, inv_std, sum_g, sum_gx = lax.optimization_barrier((feats, mean, inv_std, sum_g, sum_gx))
    xhat, g = pulled_back(feats, mean, inv_std)
  # d/dx of (x - mean) * inv_std through the batch mean and variance, plus the statistics' own cotangents.
  g_x = (scale * inv_std) * (g - (sum_g + xhat * sum_gx) / n)
  g_x = g_x + (g_mean + 2.0 * g_var * (xhat / inv_std)) / n
  g_x = jnp.where(valid, g_x, 0).astype(feats.dtype)
  return g_x, None, sum_gx, sum_g


_batch_norm_train.defvjp(_batch_norm_train_fwd, _batch_norm_train_bwd)


# ---- layer norm ------------------------------------------------------------------------------------------


@compiled_when_eager
def layer_norm(x: SparseTensor, scale: ArrayLike | None = None, bias: ArrayLike | None = None, *,
               epsilon: float = 1e-6, dtype=None) -> SparseTensor:
  """Normalises each valid row over its channels (rows are independent, so padding cannot leak in)."""
  check_sparse_tensor(x)
  epsilon = as_nonnegative_float(epsilon, "epsilon", scalars_only=True)
  c = x.num_channels
  _check_affine("scale", scale, c)
  _check_affine("bias", bias, c)
  f = _valid_feats_f32(x)
  first_mean = jnp.mean(f, axis=-1, keepdims=True)
  centred = f - first_mean
  mean, var = _corrected_moments(first_mean, jnp.mean(centred, axis=-1, keepdims=True),
                                 jnp.mean(jnp.square(centred), axis=-1, keepdims=True))
  return _finish(x, (f - mean) * lax.rsqrt(var + epsilon), scale, bias, _output_dtype(x, dtype))


# ---- group norm ------------------------------------------------------------------------------------------


def _check_groups(channels: int, num_groups: int) -> int:
  num_groups = as_int(num_groups, "num_groups", minimum=1)
  if channels % num_groups:
    raise ValueError(f"the number of channels ({channels}) must be divisible by num_groups ({num_groups})")
  return channels // num_groups


def _group_stats(feats: jax.Array, one_hot: jax.Array, num_groups: int):
  """(mean, biased var) float32 [batch_size, G] over each item's valid rows and each group's channels: a pass for
  the means, then one over the rows centred on them (float32 sums of squares about zero cancel badly), which also
  sums the centred rows for `_corrected_moments`."""
  cap, c = feats.shape
  group_size = c // num_groups
  valid = per_item.valid_rows(one_hot)
  f = jnp.where(valid[:, None], feats.astype(jnp.float32), 0).reshape(cap, num_groups, group_size)
  denom = jnp.maximum(per_item.count_per_item(one_hot) * group_size, 1.0)[:, None]
  mean = per_item.sum_per_item(one_hot, jnp.sum(f, axis=-1)) / denom
  centred = jnp.where(valid[:, None, None], f - per_item.per_row(one_hot, mean)[..., None], 0)
  # One per-item product for both sums of the second pass.
  sums = per_item.sum_per_item(one_hot, jnp.stack([jnp.sum(centred, axis=-1), jnp.sum(centred * centred, axis=-1)],
                                                  axis=-1))
  return _corrected_moments(mean, sums[..., 0] / denom, sums[..., 1] / denom)


def _group_normalised(feats, one_hot, mean, inv_std, num_groups):
  """float32 [capacity, C]: each valid row normalised with its item's group statistics; zero at padding rows."""
  cap, c = feats.shape
  f = feats.astype(jnp.float32).reshape(cap, num_groups, c // num_groups)
  xhat = (f - per_item.per_row(one_hot, mean)[..., None]) * per_item.per_row(one_hot, inv_std)[..., None]
  return jnp.where(per_item.valid_rows(one_hot)[:, None], xhat.reshape(cap, c), 0)


def group_statistics(x: SparseTensor, num_groups: int):
  """(mean, var), float32 [batch_size, num_groups]: over the channels of each group and the valid rows of
  each batch item. Batch items without valid rows get mean 0, var 0."""
  check_sparse_tensor(x)
  _check_groups(x.num_channels, num_groups)
  # Sums per item as one-hot matmuls, not scatter-adds (see per_item.py).
  return _group_stats(x.feats, per_item.item_one_hot(x), int(num_groups))


@compiled_when_eager
def group_norm(x: SparseTensor, num_groups: int, scale: ArrayLike | None = None, bias: ArrayLike | None = None,
               *, epsilon: float = 1e-6, dtype=None, activation: Callable | None = None) -> SparseTensor:
  """activation(group-normalised x * scale + bias) per batch item: each group of channels is normalised with
  the statistics of that group over the valid rows of the row's batch item (the sparse twin of flax's GroupNorm
  on [B, X, Y, Z, C], counting active sites only).

  activation: an elementwise function applied in the same pass (e.g. jax.nn.silu), or None.

  One differentiable unit (`_group_norm_unit`), like batch norm's: the forward's statistics and output passes,
  and a backward that recomputes the normalised rows and the activation's input instead of keeping them, so a
  training step holds only the input and the output of each normalisation.
  """
  check_sparse_tensor(x)
  epsilon = as_nonnegative_float(epsilon, "epsilon", scalars_only=True)
  c = x.num_channels
  _check_groups(c, num_groups)
  num_groups = int(num_groups)
  _check_affine("scale", scale, c)
  _check_affine("bias", bias, c)
  if activation is not None and not callable(activation):
    raise TypeError(f"activation must be a callable such as jax.nn.silu, got {activation!r}")
  out_dtype = _output_dtype(x, dtype)
  s = jnp.ones(c, jnp.float32) if scale is None else jnp.asarray(scale, jnp.float32)
  b = jnp.zeros(c, jnp.float32) if bias is None else jnp.asarray(bias, jnp.float32)
  feats, one_hot, s, b = same_vma(x.feats, per_item.item_one_hot(x), s, b)
  y = _group_norm_unit(feats, one_hot, s, b, num_groups, epsilon, activation, out_dtype)
  return x.replace(feats=y)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7))
def _group_norm_unit(feats, one_hot, scale, bias, num_groups, epsilon, activation, out_dtype):
  return _group_norm_unit_fwd(feats, one_hot, scale, bias, num_groups, epsilon, activation, out_dtype)[0]


def _group_norm_unit_fwd(feats, one_hot, scale, bias, num_groups, epsilon, activation, out_dtype):
  mean, var = _group_stats(feats, one_hot, num_groups)
  inv_std = lax.rsqrt(var + epsilon)
  z = _group_normalised(feats, one_hot, mean, inv_std, num_groups) * scale + bias
  y = z if activation is None else activation(z)
  y = jnp.where(per_item.valid_rows(one_hot)[:, None], y, 0).astype(out_dtype)
  return y, (feats, one_hot, scale, bias, mean, inv_std)


def _group_norm_unit_bwd(num_groups, epsilon, activation, out_dtype, res, g_y):
  feats, one_hot, scale, bias, mean, inv_std = res
  # As in batch norm's backward: tied to the cotangent, the recomputation stays in the backward pass.
  g_y, feats, mean, inv_std = lax.optimization_barrier((g_y, feats, mean, inv_std))
  cap, c = feats.shape
  group_size = c // num_groups
  valid = per_item.valid_rows(one_hot)[:, None]
  # One pulled-back cotangent shared by the three passes: recomputing it per pass behind barriers measured slower
  # (decoder large fp16 training 139.0 -> 146.2 ms, +2.3 GB; docs/perf_notes.md).
  xhat = _group_normalised(feats, one_hot, mean, inv_std, num_groups)
  g = _activation_grad(g_y, xhat, valid, scale, bias, activation)
  sum_g, sum_gx = jnp.sum(g, axis=0), jnp.sum(g * xhat, axis=0)
  # d/dx of (x - mean) * inv_std through the item's group mean and variance: the means over each (item, group)
  # of the normalised rows' cotangent and of its product with them.
  g_hat = (g * scale).reshape(cap, num_groups, group_size)
  xhat = xhat.reshape(cap, num_groups, group_size)
  denom = jnp.maximum(per_item.count_per_item(one_hot) * group_size, 1.0)[:, None]
  mean_g = per_item.sum_per_item(one_hot, jnp.sum(g_hat, axis=-1)) / denom
  mean_gx = per_item.sum_per_item(one_hot, jnp.sum(g_hat * xhat, axis=-1)) / denom
  g_x = per_item.per_row(one_hot, inv_std)[..., None] * (
      g_hat - per_item.per_row(one_hot, mean_g)[..., None] - xhat * per_item.per_row(one_hot, mean_gx)[..., None])
  g_x = jnp.where(valid, g_x.reshape(cap, c), 0).astype(feats.dtype)
  return g_x, jnp.zeros_like(one_hot), sum_gx, sum_g


_group_norm_unit.defvjp(_group_norm_unit_fwd, _group_norm_unit_bwd)
