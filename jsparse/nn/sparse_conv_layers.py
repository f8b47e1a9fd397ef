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

from typing import ClassVar, Sequence

import flax.linen as nn

from jsparse import layer_rules as rules
from jsparse import pool, sparse_conv
from jsparse.nn.layers import ConvParams
from jsparse.sparse_tensor import SparseTensor
from jsparse.spatial_rank import call_in_rank

__all__ = ["SparseConv3d", "SparseInverseConv3d", "SparseConvTranspose3d", "SparseMaxPool3d", "SparseAvgPool3d",
           "SparseConv2d", "SparseInverseConv2d", "SparseConvTranspose2d", "SparseMaxPool2d", "SparseAvgPool2d",
           "SparseConv1d", "SparseInverseConv1d", "SparseConvTranspose1d", "SparseMaxPool1d", "SparseAvgPool1d"]


def _sparse(x, module) -> SparseTensor:
  return rules.check_sparse(x, type(module).__name__)


def _triple(value, name: str, module) -> tuple[int, ...]:
  """A size of the module as `module.spatial_ndim` ints."""
  return rules.triple(value, name, type(module).__name__, module.spatial_ndim)


def _padding(value, module) -> tuple[int, ...]:
  return rules.explicit_padding(value, type(module).__name__, module.spatial_ndim)


def _geometry(module, x: SparseTensor):
  """(x on the padded grid, padding) for the module's kernel_size, strides, padding and dilation (the rule
  the nnx twins share, in jsparse/layer_rules.py)."""
  return rules.strided_geometry(type(module).__name__, x, module.kernel_size, module.strides, module.padding,
                                module.kernel_dilation, module.spatial_ndim)


def _call(module, op3d, x: SparseTensor, **kwargs):
  """op3d in the module's rank (`jsparse.spatial_rank.call_in_rank`), errors named after the module."""
  return call_in_rank(op3d, module.spatial_ndim, type(module).__name__, x, **kwargs)


class SparseConv3d(ConvParams):
  """Strided sparse convolution (spconv's SparseConv3d): `jsparse.sparse_conv3d` with flax parameters.

  Equals nn.Conv(features, kernel_size, strides, padding, kernel_dilation) on x.todense() read at the output
  sites (every output position whose window holds an active input), with the same parameters. Differences
  from nn.Conv: padding takes "SAME" (default, as nn.Conv), "VALID" or symmetric ints, not (low, high)
  pairs; no input_dilation or mask; the input is a SparseTensor and the output sites are
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
    return _call(self, sparse_conv.sparse_conv3d, x, weight=kernel, bias=bias,
                 stride=_triple(self.strides, "strides", self), padding=padding,
                 dilation=_triple(self.kernel_dilation, "kernel_dilation", self), out_capacity=self.out_capacity,
                 implementation=self.implementation, precision=self.precision, weight_layout=self.kernel_layout,
                 feature_group_count=self.feature_group_count)


class SparseInverseConv3d(ConvParams):
  """spconv's SparseInverseConv3d: `jsparse.sparse_inverse_conv3d`, called as `module(y, like=x)` where y
  lives on the output coordinates of a SparseConv3d of x with the same kernel_size/strides/padding/dilation
  (padding "SAME" by default, as SparseConv3d's; kernel_size required). The output is on x's coordinates.
  kernel: (*kernel_size, y channels, features). spconv's SparseInverseConv3d takes its sizes from the indice_key:
  here pass the forward's strides and padding (a forward ported with padding=1 needs padding=1 here too; another
  padding raises ValueError)."""

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
    out = _call(self, sparse_conv.sparse_inverse_conv3d, y, weight=kernel, bias=bias, like=padded_like,
                stride=_triple(self.strides, "strides", self), padding=padding,
                dilation=_triple(self.kernel_dilation, "kernel_dilation", self), implementation=self.implementation,
                precision=self.precision, weight_layout=self.kernel_layout,
                feature_group_count=self.feature_group_count)
    return rules.on_grid(out, like.spatial_shape, like.caches)


class SparseConvTranspose3d(ConvParams):
  """Transposed sparse convolution (`jsparse.sparse_conv_transpose3d`): PyTorch's ConvTranspose3d and
  spconv's SparseConvTranspose3d with flax parameters; `module(x, mask=None)`.

  Input site j at kernel index v feeds output j*strides - padding + v*kernel_dilation, on the output grid
  (X-1)*strides - 2*padding + kernel_dilation*(k-1) + output_padding + 1 per axis (PyTorch's padding and
  output_padding, not nn.ConvTranspose's; padding takes ints or "VALID" = 0). kernel_size None (default) is
  strides: generative upsampling, every site spawns its prod(strides) children, child t of c getting
  x[c] @ kernel[t], and mask bool [x.capacity, prod(strides)] keeps a subset (mask needs this form).
  kernel: (*kernel_size, in, features), or (features, *kernel_size, in) with kernel_layout="ODHWI" (spconv's
  weight as it is). out_capacity: output rows (required under jit)."""

  features: int
  strides: int | Sequence[int] = 2
  out_capacity: int | None = None
  kernel_size: int | Sequence[int] | None = None
  padding: int | Sequence[int] | str = 0
  output_padding: int | Sequence[int] = 0
  kernel_dilation: int | Sequence[int] = 1

  @nn.compact
  def __call__(self, x: SparseTensor, mask=None) -> SparseTensor:
    x = _sparse(x, self)
    ks, st, pad, out_pad, dil = rules.transpose_geometry(type(self).__name__, self.kernel_size, self.strides,
                                                         self.padding, self.output_padding, self.kernel_dilation,
                                                         self.spatial_ndim)
    x, kernel, bias = self.conv_params(x, ks)
    return _call(self, sparse_conv.sparse_conv_transpose3d, x, weight=kernel, bias=bias, stride=st, padding=pad,
                 output_padding=out_pad, dilation=dil, out_capacity=self.out_capacity, mask=mask,
                 implementation=self.implementation, precision=self.precision, weight_layout=self.kernel_layout,
                 feature_group_count=self.feature_group_count)


class _Pool(nn.Module):
  """A parameter-free pooling module over `_op` (a pool of jsparse.pool)."""

  kernel_size: int | Sequence[int] = 2
  strides: int | Sequence[int] | None = None  # None: kernel_size
  padding: int | Sequence[int] | str = 0
  out_capacity: int | None = None
  spatial_ndim: ClassVar[int] = 3

  def __call__(self, x: SparseTensor) -> SparseTensor:
    strides = None if self.strides is None else _triple(self.strides, "strides", self)
    return _call(self, self._op, _sparse(x, self), kernel_size=_triple(self.kernel_size, "kernel_size", self),
                 stride=strides, padding=_padding(self.padding, self), out_capacity=self.out_capacity)


class SparseMaxPool3d(_Pool):
  """`jsparse.sparse_max_pool3d` (max over the active inputs of each window) as a parameter-free module."""

  _op = staticmethod(pool.sparse_max_pool3d)


class SparseAvgPool3d(_Pool):
  """`jsparse.sparse_avg_pool3d` (mean over the active inputs of each window) as a parameter-free module."""

  _op = staticmethod(pool.sparse_avg_pool3d)


# ---- the same modules on 2D and 1D SparseTensors (SparseTensor.spatial_ndim): sizes take 2 (1) ints, kernels
# (*kernel_size, in, features) have 2 (1) kernel axes, as nn.Conv's; the 3D classes do the work.

SparseConv2d = rules.in_rank(SparseConv3d, 2, __name__)
SparseInverseConv2d = rules.in_rank(SparseInverseConv3d, 2, __name__)
SparseConvTranspose2d = rules.in_rank(SparseConvTranspose3d, 2, __name__)
SparseMaxPool2d = rules.in_rank(SparseMaxPool3d, 2, __name__)
SparseAvgPool2d = rules.in_rank(SparseAvgPool3d, 2, __name__)
SparseConv1d = rules.in_rank(SparseConv3d, 1, __name__)
SparseInverseConv1d = rules.in_rank(SparseInverseConv3d, 1, __name__)
SparseConvTranspose1d = rules.in_rank(SparseConvTranspose3d, 1, __name__)
SparseMaxPool1d = rules.in_rank(SparseMaxPool3d, 1, __name__)
SparseAvgPool1d = rules.in_rank(SparseAvgPool3d, 1, __name__)
