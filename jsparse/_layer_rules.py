"""What the flax.linen modules (jsparse.nn) and the flax.nnx modules (jsparse.nnx) share besides the functional
ops they call: hyper-parameter checks, the kernel's layout and initialisation, dtype promotion and the batch norm
step with its running averages. Each function is written once here so that the two module families cannot
drift apart (their parameters are interchangeable, see `jsparse.nnx.linen_to_nnx`).
"""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax.linen import dtypes as flax_dtypes
from jax import lax

from jsparse import norm
from jsparse.conv import WEIGHT_LAYOUTS
from jsparse.neighbors import as_triple
from jsparse.sparse_tensor import SparseTensor

NORM_KINDS = ("batch", "group", None)


def check_sparse(x, module: str) -> SparseTensor:
  if not isinstance(x, SparseTensor):
    raise TypeError(f"{module} takes a jsparse.SparseTensor, got {type(x).__name__}")
  return x


def triple(value, name: str, module: str) -> tuple[int, int, int]:
  try:
    return as_triple(value, name)
  except (TypeError, ValueError) as e:
    raise type(e)(f"{module}: {e}") from None


def submanifold_geometry(module: str, kernel_size, strides, padding, kernel_dilation):
  """(kernel_size, dilation) triples of a submanifold convolution, after checking what nn.Conv would accept
  but a submanifold convolution cannot (even kernels, strides, padding other than "SAME")."""
  ks = triple(kernel_size, "kernel_size", module)
  if any(k % 2 == 0 for k in ks):
    raise ValueError(f"{module}: kernel_size must be odd (a submanifold kernel is centred), got {ks}")
  if triple(strides, "strides", module) != (1, 1, 1):
    raise ValueError(f"{module}: strides must be 1 (a submanifold convolution keeps the input sites), got "
                     f"{strides!r}; use SparseConv3d to downsample")
  if not (isinstance(padding, str) and padding.upper() == "SAME"):
    raise ValueError(f"{module}: padding must be 'SAME' (the output sites are the input sites), got {padding!r}")
  return ks, triple(kernel_dilation, "kernel_dilation", module)


def check_conv_features(module: str, features, kernel_layout: str, name: str = "features") -> None:
  if not isinstance(features, int) or isinstance(features, bool) or features <= 0:
    raise ValueError(f"{module}: {name} must be a positive int, got {features!r}")
  if kernel_layout not in WEIGHT_LAYOUTS:
    raise ValueError(f"{module}: kernel_layout must be one of {tuple(WEIGHT_LAYOUTS)}, got {kernel_layout!r}")


def kernel_shape(kernel_size, in_features: int, features: int, kernel_layout: str) -> tuple[int, ...]:
  """"DHWIO": nn.Conv's (*kernel_size, in_features, features); "ODHWI": (features, *kernel_size, in_features)."""
  if kernel_layout == "ODHWI":
    return (features, *kernel_size, in_features)
  return (*kernel_size, in_features, features)


def kernel_initializer(kernel_init: Callable, kernel_layout: str) -> Callable:
  """kernel_init for `kernel_shape(..., kernel_layout)`: an "ODHWI" kernel is drawn in the "DHWIO" shape and
  transposed once, so the initialiser reads the same fan-in and fan-out in either layout."""
  if kernel_layout != "ODHWI":
    return kernel_init
  return lambda key, shape, dtype: jnp.moveaxis(kernel_init(key, (*shape[1:], shape[0]), dtype), -1, 0)


def check_kernel_inputs(module: str, kernel_shape_: tuple[int, ...], kernel_layout: str, cin: int) -> None:
  """A kernel whose input-channel extent is not the input's channel count, named as such (flax would report it
  as an initialiser shape mismatch, or a matmul as a dimension error)."""
  have = kernel_shape_[4 if kernel_layout == "ODHWI" else 3] if len(kernel_shape_) == 5 else None
  if have is not None and have != cin:
    raise ValueError(f"{module}: its kernel {tuple(kernel_shape_)} ({kernel_layout}) expects {have} input channels "
                     f"but the input SparseTensor has {cin}")


def promote_conv(x: SparseTensor, kernel, bias, dtype) -> tuple[SparseTensor, jax.Array, jax.Array | None]:
  """(x, kernel, bias) in the compute dtype by flax's rule (`dtype` None promotes the features' and the
  parameters' dtypes)."""
  feats, kernel, bias = flax_dtypes.promote_dtype(x.feats, kernel, bias, dtype=dtype)
  return x.replace(feats=feats), kernel, bias


def norm_output_dtype(dtype, x: SparseTensor, param_dtype, affine: bool):
  """flax's normalisations return the promoted dtype of the input and the parameters unless dtype is set."""
  if dtype is not None:
    return dtype
  return jnp.promote_types(x.dtype, param_dtype) if affine else x.dtype


def group_count(module: str, channels: int, num_groups, group_size) -> int:
  """The number of groups from exactly one of num_groups / group_size (as flax), dividing the channels."""
  if (num_groups is None) == (group_size is None):
    raise ValueError(f"{module}: set exactly one of num_groups and group_size (got num_groups={num_groups}, "
                     f"group_size={group_size})")
  if group_size is not None:
    if not isinstance(group_size, int) or group_size <= 0 or channels % group_size:
      raise ValueError(f"{module}: the number of channels ({channels}) must be divisible by group_size "
                       f"({group_size})")
    return channels // group_size
  if not isinstance(num_groups, int) or num_groups <= 0 or channels % num_groups:
    raise ValueError(f"{module}: the number of channels ({channels}) must be divisible by num_groups ({num_groups})")
  return num_groups


def check_norm_kind(module: str, kind) -> None:
  if kind not in NORM_KINDS:
    raise ValueError(f"{module}: norm must be 'batch', 'group' or None, got {kind!r}")


def batch_norm_step(x: SparseTensor, scale, bias, running_mean, running_var, *, use_running_average: bool,
                    update_statistics: bool, momentum: float, epsilon: float, axis_name, axis_index_groups,
                    dtype, activation: Callable | None) -> tuple[SparseTensor, Any, Any]:
  """One SparseBatchNorm call: (y, new running mean, new running var).

  With running averages the statistics pass through unchanged. With batch statistics they move towards the
  batch's (float32, no gradient) by `momentum` when update_statistics, as flax's BatchNorm does.
  """
  if use_running_average:
    y = norm.batch_norm(x, scale, bias, mean=running_mean, var=running_var, epsilon=epsilon, dtype=dtype,
                        activation=activation)
    return y, running_mean, running_var
  y, (mean, var) = norm.batch_norm(x, scale, bias, epsilon=epsilon, axis_name=axis_name,
                                   axis_index_groups=axis_index_groups, dtype=dtype, activation=activation,
                                   return_statistics=True)
  if not update_statistics:
    return y, running_mean, running_var
  mean, var = lax.stop_gradient(mean), lax.stop_gradient(var)
  return (y, momentum * running_mean + (1 - momentum) * mean, momentum * running_var + (1 - momentum) * var)
