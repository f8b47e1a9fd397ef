"""flax.linen modules for the non-submanifold sparse ops (jsparse/sparse_conv.py).

Parameters are named and laid out as flax's nn.Conv: "kernel" (*kernel_size, in_features, features) and
"bias" (features,); or "kernel" (features, *kernel_size, in_features) with kernel_layout="ODHWI" (ConvParams).
`padding` is as nn.Conv's, default "SAME": "SAME" (output grid ceil(X / stride) per axis, lax's split of the
padding, the larger half after the grid), "VALID" (= 0), an int or 3 ints (symmetric padding per axis, as
lax.conv_general_dilated's [(p, p)] * 3). nn.Conv's list of (low, high) pairs is not offered. kernel_size is
required, as nn.Conv's. spconv's SparseConv3d pads 0 by default: pass padding=0 (or "VALID") to port one.
An `out_capacity` too small for the output sites behaves as in the functional ops: ValueError outside jit;
under jit the output's flag, `jsparse.overflowed(y)`, and (inside `jsparse.error_checks()`) a
`jax.experimental.checkify` error naming the op.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import flax.linen as nn

from jsparse import pool, sparse_conv
from jsparse.nn.layers import ConvParams, _check_sparse
from jsparse.nn.layers import _triple as _triple_named
from jsparse.sparse_tensor import SparseTensor

__all__ = ["SparseConv3d", "SparseInverseConv3d", "SparseConvTranspose3d", "SparseMaxPool3d", "SparseAvgPool3d"]


def _sparse(x, module) -> SparseTensor:
  return _check_sparse(x, type(module).__name__)


def _triple(value, name: str, module) -> tuple[int, int, int]:
  return _triple_named(value, name, type(module).__name__)


def _padding(value, module) -> tuple[int, int, int]:
  """Explicit padding: ints or "VALID" (the pools, and the convolutions once "SAME" is resolved by _geometry)."""
  if isinstance(value, str):
    if value.upper() == "VALID":
      return (0, 0, 0)
    raise ValueError(f"{type(module).__name__}: padding must be ints or 'VALID', got {value!r}")
  return _triple(value, "padding", module)


def _is_same(value) -> bool:
  return isinstance(value, str) and value.upper() == "SAME"


def same_padding(spatial_shape, kernel_size, strides, dilation) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(low padding, extra high padding) per axis of lax's "SAME": total = max((ceil(X/s) - 1)*s + (k-1)*d + 1
  - X, 0), low = total // 2, high = total - low, so the extra (high - low) is 0 or 1."""
  low, extra = [], []
  for n, k, s, d in zip(spatial_shape, kernel_size, strides, dilation):
    total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
    low.append(total // 2)
    extra.append(total - 2 * (total // 2))
  return tuple(low), tuple(extra)


def _on_grid(x: SparseTensor, spatial_shape, caches=None) -> SparseTensor:
  """x on a grid of another extent (the same sites): the symmetric padding of the core ops plus one empty slice
  at the high end of an axis is "SAME"'s uneven padding. Maps keyed by the old grid are dropped."""
  if tuple(spatial_shape) == x.spatial_shape:
    return x
  return dataclasses.replace(x, spatial_shape=tuple(spatial_shape), caches={} if caches is None else caches)


def _geometry(module, x: SparseTensor):
  """(x on the padded grid, padding) for the module's kernel_size, strides, padding and dilation."""
  ks = _triple(module.kernel_size, "kernel_size", module)
  st = _triple(module.strides, "strides", module)
  dil = _triple(module.kernel_dilation, "kernel_dilation", module)
  if not _is_same(module.padding):
    if isinstance(module.padding, str) and module.padding.upper() != "VALID":
      raise ValueError(f"{type(module).__name__}: padding must be 'SAME', 'VALID' or ints, got {module.padding!r}")
    return x, _padding(module.padding, module)
  low, extra = same_padding(x.spatial_shape, ks, st, dil)
  return _on_grid(x, [n + e for n, e in zip(x.spatial_shape, extra)]), low


class SparseConv3d(ConvParams):
  """Strided sparse convolution (spconv's SparseConv3d): `jsparse.sparse_conv3d` with flax parameters.

  Equals nn.Conv(features, kernel_size, strides, padding, kernel_dilation) on x.todense() read at the output
  sites (every output position whose window holds an active input), with the same parameters. Differences
  from nn.Conv: padding takes "SAME" (default, as nn.Conv), "VALID" or symmetric ints, not (low, high)
  pairs; no feature_group_count, input_dilation or mask; the input is a SparseTensor and the output sites are
  data-dependent, so out_capacity sets their static row count (required under jit; None counts them, outside
  jit only). The output carries the pair map, for SparseInverseConv3d(...)(y, like=x).
  """

  features: int
  kernel_size: int | Sequence[int]
  strides: int | Sequence[int] = 1
  padding: int | Sequence[int] | str = "SAME"
  kernel_dilation: int | Sequence[int] = 1
  out_capacity: int | None = None

  @nn.compact
  def __call__(self, x: SparseTensor) -> SparseTensor:
    x = _sparse(x, self)
    ks = _triple(self.kernel_size, "kernel_size", self)
    x, padding = _geometry(self, x)
    x, kernel, bias = self.conv_params(x, ks)
    return sparse_conv.sparse_conv3d(
        x, kernel, bias, stride=_triple(self.strides, "strides", self), padding=padding,
        dilation=_triple(self.kernel_dilation, "kernel_dilation", self), out_capacity=self.out_capacity,
        implementation=self.implementation, precision=self.precision, weight_layout=self.kernel_layout)


class SparseInverseConv3d(ConvParams):
  """spconv's SparseInverseConv3d: `jsparse.sparse_inverse_conv3d`, called as `module(y, like=x)` where y
  lives on the output coordinates of a SparseConv3d of x with the same kernel_size/strides/padding/dilation
  (padding "SAME" by default, as SparseConv3d's; kernel_size required). The output is on x's coordinates.
  kernel: (*kernel_size, y channels, features)."""

  features: int
  kernel_size: int | Sequence[int]
  strides: int | Sequence[int] = 1
  padding: int | Sequence[int] | str = "SAME"
  kernel_dilation: int | Sequence[int] = 1

  @nn.compact
  def __call__(self, y: SparseTensor, *, like: SparseTensor) -> SparseTensor:
    y = _sparse(y, self)
    like = _sparse(like, self)
    ks = _triple(self.kernel_size, "kernel_size", self)
    padded_like, padding = _geometry(self, like)
    y, kernel, bias = self.conv_params(y, ks)
    out = sparse_conv.sparse_inverse_conv3d(
        y, kernel, bias, like=padded_like, stride=_triple(self.strides, "strides", self), padding=padding,
        dilation=_triple(self.kernel_dilation, "kernel_dilation", self), implementation=self.implementation,
        precision=self.precision, weight_layout=self.kernel_layout)
    return _on_grid(out, like.spatial_shape, like.caches)


class SparseConvTranspose3d(ConvParams):
  """Generative upsampling (`jsparse.sparse_conv_transpose3d`): every site spawns its prod(strides)
  children; `module(x, mask=None)`, mask bool [x.capacity, prod(strides)] keeps a subset.
  kernel: (*strides, in, features); child t of c gets x[c] @ kernel[t]."""

  features: int
  strides: int | Sequence[int] = 2
  out_capacity: int | None = None

  @nn.compact
  def __call__(self, x: SparseTensor, mask=None) -> SparseTensor:
    x = _sparse(x, self)
    st = _triple(self.strides, "strides", self)
    x, kernel, bias = self.conv_params(x, st)
    return sparse_conv.sparse_conv_transpose3d(x, kernel, bias, stride=st, out_capacity=self.out_capacity,
                                               mask=mask, implementation=self.implementation,
                                               precision=self.precision, weight_layout=self.kernel_layout)


class SparseMaxPool3d(nn.Module):
  """`jsparse.sparse_max_pool3d` (max over the active inputs of each window) as a parameter-free module."""

  kernel_size: int | Sequence[int] = 2
  strides: int | Sequence[int] | None = None  # None: kernel_size
  padding: int | Sequence[int] | str = 0
  out_capacity: int | None = None

  def __call__(self, x: SparseTensor) -> SparseTensor:
    return pool.sparse_max_pool3d(_sparse(x, self), self.kernel_size, self.strides,
                                         _padding(self.padding, self), out_capacity=self.out_capacity)


class SparseAvgPool3d(nn.Module):
  """`jsparse.sparse_avg_pool3d` (mean over the active inputs of each window) as a parameter-free module."""

  kernel_size: int | Sequence[int] = 2
  strides: int | Sequence[int] | None = None
  padding: int | Sequence[int] | str = 0
  out_capacity: int | None = None

  def __call__(self, x: SparseTensor) -> SparseTensor:
    return pool.sparse_avg_pool3d(_sparse(x, self), self.kernel_size, self.strides,
                                         _padding(self.padding, self), out_capacity=self.out_capacity)
