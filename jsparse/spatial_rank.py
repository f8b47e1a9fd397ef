"""2D and 1D sparse convolutions and pools: the 3D ops on a grid whose leading extents are 1.

A 2D SparseTensor (`spatial_ndim=2`: BEV feature maps, sparse images) is a 3D one of depth 1, spatial_shape
(1, H, W) and coords (batch, 0, y, x); a 1D one has spatial_shape (1, 1, L). `call_in_rank` is the one place
where an op of rank 2 or 1 becomes a 3D op: it checks the ranks of the tensors and the weight, gives every
size 3 entries (kernel extent, stride and dilation 1, padding 0 on the lifted axes), inserts the weight's
kernel axes of extent 1 and runs the 3D op on the tensor viewed as 3D, so a 2D convolution uses the same
neighbour maps, hash tables and GEMM kernels (a 3x3 kernel is 9 offsets, not 27). The functions below and the
flax modules of every rank (jsparse.nn, jsparse.nnx) call it.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp

from jsparse._types import ArrayLike, SizeND
from jsparse.conv import submconv3d
from jsparse.neighbors import lift_triple
from jsparse.size_errors import sizes_in_rank
from jsparse.pool import sparse_avg_pool3d, sparse_max_pool3d
from jsparse.sparse_conv import sparse_conv3d, sparse_conv_transpose3d, sparse_inverse_conv3d
from jsparse.sparse_tensor import SparseTensor, check_spatial_ndim
from jsparse.sparsity import as_dense_weight
from pallas_kernels.weight_layout import WeightLayout

__all__ = ["submconv2d", "sparse_conv2d", "sparse_inverse_conv2d", "sparse_conv_transpose2d", "sparse_max_pool2d",
           "sparse_avg_pool2d", "submconv1d", "sparse_conv1d", "sparse_inverse_conv1d", "sparse_conv_transpose1d",
           "sparse_max_pool1d", "sparse_avg_pool1d", "call_in_rank"]

# The sizes an op may take, and the entry each gets on a lifted axis.
LIFTED_SIZES = {"kernel_size": 1, "stride": 1, "dilation": 1, "padding": 0, "output_padding": 0}
_KERNEL_AXES = {1: ("K",), 2: ("Kh", "Kw"), 3: ("Kx", "Ky", "Kz")}


def weight_shape_text(ndim: int, layout: WeightLayout) -> str:
  """The axes of an `ndim`-D op's weight in `layout`, e.g. "(Kh, Kw, Cin, Cout)"."""
  axes = _KERNEL_AXES[ndim]
  return "(" + ", ".join(("Cout", *axes, "Cin") if layout.cout_major else (*axes, "Cin", "Cout")) + ")"


def lift_weight(weight, ndim: int, layout: WeightLayout, op: str) -> jax.Array:
  """An `ndim`-D op's weight as a 5-D one: kernel axes of extent 1 inserted before its own kernel axes (a
  Compressed2to4 weight decompressed first)."""
  weight = as_dense_weight(weight, layout)
  if weight.ndim != ndim + 2:
    raise ValueError(f"{op}: weight must be {ndim + 2}-D {weight_shape_text(ndim, layout)} (weight_layout="
                     f"{layout.value!r}), got shape {weight.shape}")
  first = 1 if layout.cout_major else 0
  return jnp.expand_dims(weight, tuple(range(first, first + 3 - ndim)))


def _as_3d(x: SparseTensor) -> SparseTensor:
  return x if x.spatial_ndim == 3 else dataclasses.replace(x, spatial_ndim=3)


def _in_rank(out, ndim: int):
  """An op's result (a SparseTensor, or one first in a tuple) tagged with the rank of its input."""
  if isinstance(out, tuple):
    return (_in_rank(out[0], ndim), *out[1:])
  return out if ndim == 3 else dataclasses.replace(out, spatial_ndim=ndim)


def call_in_rank(op3d: Callable[..., Any], ndim: int, op: str, x: SparseTensor, **kwargs: Any) -> Any:
  """`op3d(x, **kwargs)` (a 3D op of jsparse) as an `ndim`-D op named `op`: x and a `like` argument must be
  `ndim`-D SparseTensors (ValueError naming the op to use otherwise); `weight` is `ndim` + 2-D in
  `weight_layout`; the sizes (kernel_size, stride, dilation, padding, output_padding) are ints or `ndim` ints.
  The result is in x's rank, and so are the sizes that the 3D checks' errors quote (`jsparse.size_errors`: a
  2D op's kernel_size reads (3, 3), not the lifted (1, 3, 3)). ndim=3 calls op3d as it is, after the rank checks."""
  name = "y" if "like" in kwargs else "x"
  check_spatial_ndim(x, ndim, op, name)
  if "like" in kwargs:
    check_spatial_ndim(kwargs["like"], ndim, op, "like")
  if ndim == 3:
    return op3d(x, **kwargs)
  if kwargs.get("weight") is not None:
    layout = WeightLayout.of(kwargs.get("weight_layout", WeightLayout.DHWIO))
    kwargs["weight"] = lift_weight(kwargs["weight"], ndim, layout, op)
  for size, fill in LIFTED_SIZES.items():
    if kwargs.get(size) is not None:
      kwargs[size] = lift_triple(kwargs[size], size, ndim, fill)
  if "like" in kwargs:
    kwargs["like"] = _as_3d(kwargs["like"])
  with sizes_in_rank(ndim):  # the 3D checks' messages, quoting the sizes lifted above, in the user's rank
    return _in_rank(op3d(_as_3d(x), **kwargs), ndim)


# ---- 2D -------------------------------------------------------------------------------------------------------


def submconv2d(x: SparseTensor, weight: ArrayLike, bias: ArrayLike | None = None, *, dilation: SizeND = 1,
               weight_layout: WeightLayout | str = "DHWIO", **options: Any) -> SparseTensor:
  """Submanifold 2D convolution of a 2D SparseTensor (`submconv3d` with a kernel of depth 1).

  Equals `lax.conv_general_dilated(x.todense(), weight, (1, 1), "SAME", rhs_dilation=dilation,
  dimension_numbers=("NHWC", "HWIO", "NHWC"))` (+ bias) read at x's sites. weight: (Kh, Kw, Cin, Cout), odd
  sizes, or (Cout, Kh, Kw, Cin) with weight_layout="ODHWI". dilation: an int or 2 ints.
  options: submconv3d's other keyword arguments (cache, implementation, precision, algorithm,
  feature_group_count); a cache comes from `neighbor_map(x, kernel_size)` with 2D sizes.
  """
  return call_in_rank(submconv3d, 2, "submconv2d", x, weight=weight, bias=bias, dilation=dilation,
                      weight_layout=weight_layout, **options)


def sparse_conv2d(x: SparseTensor, weight: ArrayLike, bias: ArrayLike | None = None, *, stride: SizeND = 1,
                  padding: SizeND = 0, dilation: SizeND = 1, weight_layout: WeightLayout | str = "DHWIO",
                  **options: Any) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """Strided sparse 2D convolution (spconv's SparseConv2d): `sparse_conv3d` with a kernel of depth 1.

  Equals `lax.conv_general_dilated(x.todense(), weight, stride, [(p, p)] * 2, rhs_dilation=dilation,
  dimension_numbers=("NHWC", "HWIO", "NHWC"))` (+ bias) read at the output sites (every output position whose
  window holds an active input). weight: (Kh, Kw, Cin, Cout) or (Cout, Kh, Kw, Cin) with weight_layout="ODHWI";
  stride, padding, dilation: an int or 2 ints. options: sparse_conv3d's other keyword arguments (out_capacity,
  cache, implementation, precision, algorithm, with_overflow, feature_group_count). The output carries the pair
  map for `sparse_inverse_conv2d`.
  """
  return call_in_rank(sparse_conv3d, 2, "sparse_conv2d", x, weight=weight, bias=bias, stride=stride, padding=padding,
                      dilation=dilation, weight_layout=weight_layout, **options)


def sparse_inverse_conv2d(y: SparseTensor, weight: ArrayLike, bias: ArrayLike | None = None, *, like: SparseTensor,
                          stride: SizeND = 1, padding: SizeND = 0, dilation: SizeND = 1,
                          weight_layout: WeightLayout | str = "DHWIO", **options: Any) -> SparseTensor:
  """spconv's SparseInverseConv2d: `sparse_inverse_conv3d` of 2D tensors, y back onto like's coordinates.

  y is on the coordinates of `sparse_conv2d(like, ..., stride, padding, dilation)`. Equals the transpose of that
  dense convolution (`jax.vjp` of `lax.conv_general_dilated(d, weight.swapaxes(2, 3), stride, [(p, p)] * 2,
  rhs_dilation=dilation, dimension_numbers=("NHWC", "HWIO", "NHWC"))` at like.todense(), applied to
  y.todense()) read at like's sites. weight: (Kh, Kw, C_y, Cout) or (Cout, Kh, Kw, C_y) with
  weight_layout="ODHWI". options: implementation, precision, algorithm, feature_group_count.
  """
  return call_in_rank(sparse_inverse_conv3d, 2, "sparse_inverse_conv2d", y, weight=weight, bias=bias, like=like,
                      stride=stride, padding=padding, dilation=dilation, weight_layout=weight_layout, **options)


def sparse_conv_transpose2d(x: SparseTensor, weight: ArrayLike, bias: ArrayLike | None = None, *,
                            stride: SizeND = 2, padding: SizeND = 0, output_padding: SizeND = 0, dilation: SizeND = 1,
                            weight_layout: WeightLayout | str = "DHWIO",
                            **options: Any) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """Transposed sparse 2D convolution (PyTorch's ConvTranspose2d; `sparse_conv_transpose3d` of depth 1): input
  site j at kernel index v feeds output j*stride - padding + v*dilation per axis, on the grid
  (X-1)*stride - 2*padding + dilation*(k-1) + output_padding + 1; equals `lax.conv_transpose(x.todense(),
  weight[::-1, ::-1], stride, [(d*(k-1) - p, d*(k-1) - p + output_padding)] per axis, rhs_dilation=dilation,
  dimension_numbers=("NHWC", "HWIO", "NHWC"))` (+ bias) read at the output sites.

  weight: (Kh, Kw, Cin, Cout), or (Cout, Kh, Kw, Cin) with weight_layout="ODHWI". Kernel == stride with no
  padding (the default form) is generative upsampling: every site c spawns its children c * stride + (i, j),
  child (i, j) getting x[c] @ weight[i, j], in (parent, child) row order.
  options: sparse_conv_transpose3d's other keyword arguments (out_capacity, mask: bool [x.capacity, sh*sw] in
  the C order of (i, j), generative form only; implementation, precision, algorithm, with_overflow,
  feature_group_count).
  """
  return call_in_rank(sparse_conv_transpose3d, 2, "sparse_conv_transpose2d", x, weight=weight, bias=bias,
                      stride=stride, padding=padding, output_padding=output_padding, dilation=dilation,
                      weight_layout=weight_layout, **options)


def sparse_max_pool2d(x: SparseTensor, kernel_size: SizeND, stride: SizeND | None = None, padding: SizeND = 0,
                      dilation: SizeND = 1, **options: Any) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """Max over the active inputs of each 2D window (`sparse_max_pool3d` of depth 1); stride None: kernel_size.
  options: out_capacity, with_overflow, implementation."""
  return call_in_rank(sparse_max_pool3d, 2, "sparse_max_pool2d", x, kernel_size=kernel_size,
                      stride=kernel_size if stride is None else stride, padding=padding, dilation=dilation, **options)


def sparse_avg_pool2d(x: SparseTensor, kernel_size: SizeND, stride: SizeND | None = None, padding: SizeND = 0,
                      dilation: SizeND = 1, **options: Any) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """Mean over the active inputs of each 2D window (`sparse_avg_pool3d` of depth 1); stride None: kernel_size.
  options: out_capacity, with_overflow, implementation."""
  return call_in_rank(sparse_avg_pool3d, 2, "sparse_avg_pool2d", x, kernel_size=kernel_size,
                      stride=kernel_size if stride is None else stride, padding=padding, dilation=dilation, **options)


# ---- 1D -------------------------------------------------------------------------------------------------------


def submconv1d(x: SparseTensor, weight: ArrayLike, bias: ArrayLike | None = None, *, dilation: SizeND = 1,
               weight_layout: WeightLayout | str = "DHWIO", **options: Any) -> SparseTensor:
  """Submanifold 1D convolution of a 1D SparseTensor: as `submconv2d` with weight (K, Cin, Cout) (or (Cout, K,
  Cin), "ODHWI") and dimension numbers ("NWC", "WIO", "NWC")."""
  return call_in_rank(submconv3d, 1, "submconv1d", x, weight=weight, bias=bias, dilation=dilation,
                      weight_layout=weight_layout, **options)


def sparse_conv1d(x: SparseTensor, weight: ArrayLike, bias: ArrayLike | None = None, *, stride: SizeND = 1,
                  padding: SizeND = 0, dilation: SizeND = 1, weight_layout: WeightLayout | str = "DHWIO",
                  **options: Any) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """Strided sparse 1D convolution: as `sparse_conv2d` with weight (K, Cin, Cout) (or (Cout, K, Cin))."""
  return call_in_rank(sparse_conv3d, 1, "sparse_conv1d", x, weight=weight, bias=bias, stride=stride, padding=padding,
                      dilation=dilation, weight_layout=weight_layout, **options)


def sparse_inverse_conv1d(y: SparseTensor, weight: ArrayLike, bias: ArrayLike | None = None, *, like: SparseTensor,
                          stride: SizeND = 1, padding: SizeND = 0, dilation: SizeND = 1,
                          weight_layout: WeightLayout | str = "DHWIO", **options: Any) -> SparseTensor:
  """The inverse of `sparse_conv1d`, y back onto like's coordinates: as `sparse_inverse_conv2d` in 1D."""
  return call_in_rank(sparse_inverse_conv3d, 1, "sparse_inverse_conv1d", y, weight=weight, bias=bias, like=like,
                      stride=stride, padding=padding, dilation=dilation, weight_layout=weight_layout, **options)


def sparse_conv_transpose1d(x: SparseTensor, weight: ArrayLike, bias: ArrayLike | None = None, *,
                            stride: SizeND = 2, padding: SizeND = 0, output_padding: SizeND = 0, dilation: SizeND = 1,
                            weight_layout: WeightLayout | str = "DHWIO",
                            **options: Any) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """Transposed sparse 1D convolution: as `sparse_conv_transpose2d` with weight (K, Cin, Cout) (or (Cout, K,
  Cin)); kernel == stride with no padding is generative upsampling."""
  return call_in_rank(sparse_conv_transpose3d, 1, "sparse_conv_transpose1d", x, weight=weight, bias=bias,
                      stride=stride, padding=padding, output_padding=output_padding, dilation=dilation,
                      weight_layout=weight_layout, **options)


def sparse_max_pool1d(x: SparseTensor, kernel_size: SizeND, stride: SizeND | None = None, padding: SizeND = 0,
                      dilation: SizeND = 1, **options: Any) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """Max over the active inputs of each 1D window (`sparse_max_pool3d` of depth and height 1)."""
  return call_in_rank(sparse_max_pool3d, 1, "sparse_max_pool1d", x, kernel_size=kernel_size,
                      stride=kernel_size if stride is None else stride, padding=padding, dilation=dilation, **options)


def sparse_avg_pool1d(x: SparseTensor, kernel_size: SizeND, stride: SizeND | None = None, padding: SizeND = 0,
                      dilation: SizeND = 1, **options: Any) -> SparseTensor | tuple[SparseTensor, jax.Array]:
  """Mean over the active inputs of each 1D window (`sparse_avg_pool3d` of depth and height 1)."""
  return call_in_rank(sparse_avg_pool3d, 1, "sparse_avg_pool1d", x, kernel_size=kernel_size,
                      stride=kernel_size if stride is None else stride, padding=padding, dilation=dilation, **options)
