"""flax.nnx twins of the jsparse.nn (flax.linen) layers: the same functional ops, the same parameter names and
layouts, with nnx's conventions (input widths given at construction, `rngs=`, `model.train()` / `model.eval()`).

Each module holds its parameters and calls exactly what its linen twin calls (the ops of jsparse.conv,
jsparse.sparse_conv, jsparse.pool, jsparse.norm and the rules in jsparse.layer_rules), so the two compute the
same thing; `jsparse.nnx.linen_to_nnx` / `jsparse.nnx.nnx_to_linen` move parameters between them.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar, Sequence

import jax
import jax.numpy as jnp
from flax import nnx
from flax.nnx import initializers

from jsparse import layer_rules as rules
from jsparse import norm, pool, sparse_conv
from jsparse.conv import submconv3d
from jsparse.sparse_tensor import SparseTensor
from jsparse.spatial_rank import call_in_rank

Dtype = Any
Initializer = Callable[..., jax.Array]

__all__ = ["SubMConv3d", "SparseConv3d", "SparseInverseConv3d", "SparseConvTranspose3d", "SparseMaxPool3d",
           "SparseAvgPool3d", "SparseBatchNorm", "SparseLayerNorm", "SparseGroupNorm",
           "SubMConv2d", "SparseConv2d", "SparseInverseConv2d", "SparseConvTranspose2d", "SparseMaxPool2d",
           "SparseAvgPool2d", "SubMConv1d", "SparseConv1d", "SparseInverseConv1d", "SparseConvTranspose1d",
           "SparseMaxPool1d", "SparseAvgPool1d"]

default_kernel_init = initializers.lecun_normal()  # as nnx.Conv and nn.Conv
_zeros = initializers.zeros_init()
_ones = initializers.ones_init()


def _hashable(value):
  """A hyper-parameter as nnx keeps it static: a list of ints becomes a tuple (nnx would hold a list as data)."""
  return tuple(value) if isinstance(value, list) else value


class _ConvParams(nnx.Module):
  """The "kernel" and "bias" parameters every sparse convolution holds, laid out as its linen twin's
  (`jsparse.nn.layers.ConvParams`): kernel_layout "DHWIO" (*kernel_size, in_features / feature_group_count,
  out_features) or "ODHWI" (out_features, *kernel_size, in_features / feature_group_count). Every convolution
  also takes kernel_sparsity: None or "2:4" (its forward prunes the kernel 2:4 over input channels, as the linen
  twin's does)."""

  spatial_ndim: ClassVar[int] = 3  # the rank of the tensors it takes: its 2D and 1D twins set 2 and 1

  def _call(self, op3d, x: SparseTensor, **kwargs):
    """op3d in the module's rank (`jsparse.spatial_rank.call_in_rank`), errors named after the module."""
    return call_in_rank(op3d, self.spatial_ndim, type(self).__name__, x, **kwargs)

  def _init_conv(self, in_features: int, out_features: int, kernel_size: tuple[int, ...], *, use_bias: bool,
                 dtype, param_dtype, precision, kernel_init, bias_init, implementation, kernel_layout,
                 rngs: nnx.Rngs, feature_group_count: int = 1, kernel_sparsity: str | None = None) -> None:
    name = type(self).__name__
    rules.check_kernel_sparsity(name, kernel_sparsity)
    in_features = rules.check_conv_features(name, in_features, kernel_layout, "in_features")
    out_features = rules.check_conv_features(name, out_features, kernel_layout, "out_features")
    groups = rules.check_feature_groups(name, feature_group_count, in_features, out_features)
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"{name}: rngs must be an nnx.Rngs (e.g. nnx.Rngs(0)), got {type(rngs).__name__}")
    shape = rules.kernel_shape(kernel_size, in_features, out_features, kernel_layout, groups)
    self.kernel = nnx.Param(rules.kernel_initializer(kernel_init, kernel_layout)(rngs.params(), shape, param_dtype))
    self.bias = (nnx.Param(bias_init(rngs.params(), (out_features,), param_dtype)) if use_bias
                 else nnx.data(None))
    self.in_features, self.out_features = in_features, out_features
    self.use_bias, self.dtype, self.param_dtype, self.precision = use_bias, dtype, param_dtype, precision
    self.implementation, self.kernel_layout, self.feature_group_count = implementation, kernel_layout, groups
    self.kernel_sparsity = kernel_sparsity

  def _conv_inputs(self, x) -> tuple[SparseTensor, jax.Array, jax.Array | None]:
    name = type(self).__name__
    x = rules.check_sparse(x, name)
    rules.check_kernel_inputs(name, tuple(self.kernel.shape), self.kernel_layout, x.num_channels,
                              self.feature_group_count)
    # A kernel put in after construction (a loaded checkpoint) is checked here, as flax checks a linen module's
    # parameters: the ops read the kernel size and output width off the kernel's shape, so another kernel size
    # (spconv's (3, 1, 1) for (1, 1, 3)) or the other layout ran as that convolution, silently.
    want = rules.kernel_shape(self.kernel_size, self.in_features, self.out_features, self.kernel_layout,
                              self.feature_group_count)
    if tuple(self.kernel.shape) != want:
      raise ValueError(f"{name}: its kernel has shape {tuple(self.kernel.shape)} but kernel_size={self.kernel_size}, "
                       f"in_features={self.in_features}, out_features={self.out_features} and "
                       f"kernel_layout='{self.kernel_layout}' make it {want}")
    if self.bias is not None and tuple(self.bias.shape) != (self.out_features,):
      raise ValueError(f"{name}: its bias has shape {tuple(self.bias.shape)} but out_features={self.out_features} "
                       f"makes it ({self.out_features},)")
    bias = None if self.bias is None else self.bias[...]
    kernel = rules.sparse_kernel(name, self.kernel[...], self.kernel_sparsity, self.kernel_layout)
    return rules.promote_conv(x, kernel, bias, self.dtype)


class SubMConv3d(_ConvParams):
  """Submanifold sparse 3D convolution: the nnx twin of `jsparse.nn.SubMConv3d` (`jsparse.submconv3d`).

  The output lives on the input's coordinates and equals nnx.Conv(in_features, out_features, kernel_size,
  padding="SAME", kernel_dilation=...) on `x.todense()` read at the active sites.

  Args:
    in_features, out_features: input and output channels.
    kernel_size: int or 3 ints, odd. strides: must be 1. padding: must be "SAME". kernel_dilation: int or 3 ints.
    use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as nnx.Conv (`dtype` None computes in the
      promoted dtype of the features and the parameters).
    implementation: None | "xla" | "pallas"; algorithm: "auto" or a forced Pallas algorithm; kernel_layout:
      "DHWIO" or "ODHWI"; feature_group_count: channel groups, as nnx.Conv (see `jsparse.submconv3d`).
    kernel_sparsity: None or "2:4" (the forward prunes the kernel 2:4 over input channels at each call, as
      `jsparse.nn.SubMConv3d`'s).
    rngs: an nnx.Rngs for the initial parameters.
  """

  def __init__(self, in_features: int, out_features: int, kernel_size: int | Sequence[int] = 3,
               strides: int | Sequence[int] = 1, padding: str = "SAME", kernel_dilation: int | Sequence[int] = 1,
               *, use_bias: bool = True, dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               precision: Any = None, kernel_init: Initializer = default_kernel_init,
               bias_init: Initializer = _zeros, implementation: str | None = None, algorithm: str = "auto",
               kernel_layout: str = "DHWIO", feature_group_count: int = 1,
               kernel_sparsity: str | None = None, rngs: nnx.Rngs):
    ks, dilation = rules.submanifold_geometry(type(self).__name__, kernel_size, strides, padding, kernel_dilation,
                                              self.spatial_ndim)
    self._init_conv(in_features, out_features, ks, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                    precision=precision, kernel_init=kernel_init, bias_init=bias_init,
                    implementation=implementation, kernel_layout=kernel_layout, rngs=rngs,
                    feature_group_count=feature_group_count, kernel_sparsity=kernel_sparsity)
    self.kernel_size, self.kernel_dilation, self.algorithm = ks, dilation, algorithm

  def __call__(self, x: SparseTensor) -> SparseTensor:
    """The convolution of x (its neighbour map is taken from, and attached to, x's caches)."""
    x, kernel, bias = self._conv_inputs(x)
    return self._call(submconv3d, x, weight=kernel, bias=bias, dilation=self.kernel_dilation,
                      implementation=self.implementation, precision=self.precision, algorithm=self.algorithm,
                      weight_layout=self.kernel_layout,
                      feature_group_count=self.feature_group_count)


class _StridedConv(_ConvParams):
  """The geometry of SparseConv3d and SparseInverseConv3d, read as their linen twins read it
  (`jsparse.layer_rules.strided_geometry`): padding "SAME" (default, lax's), "VALID" or symmetric ints."""

  def __init__(self, in_features: int, out_features: int, kernel_size: int | Sequence[int],
               strides: int | Sequence[int] = 1, padding: int | Sequence[int] | str = "SAME",
               kernel_dilation: int | Sequence[int] = 1, *, use_bias: bool = True, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, precision: Any = None,
               kernel_init: Initializer = default_kernel_init, bias_init: Initializer = _zeros,
               implementation: str | None = None, kernel_layout: str = "DHWIO", feature_group_count: int = 1,
               kernel_sparsity: str | None = None, rngs: nnx.Rngs):
    name, ndim = type(self).__name__, self.spatial_ndim
    ks = rules.triple(kernel_size, "kernel_size", name, ndim)
    self.kernel_size, self.strides = ks, rules.triple(strides, "strides", name, ndim)
    rules.check_conv_padding(padding, name, ndim)  # checked now, resolved against each input's grid at each call
    rules.check_sizes(name, ks, strides, padding, kernel_dilation, ndim)  # before the kernel is made from ks
    self.padding = _hashable(padding)
    self.kernel_dilation = rules.triple(kernel_dilation, "kernel_dilation", name, ndim)
    self._init_conv(in_features, out_features, ks, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                    precision=precision, kernel_init=kernel_init, bias_init=bias_init,
                    implementation=implementation, kernel_layout=kernel_layout, rngs=rngs,
                    feature_group_count=feature_group_count, kernel_sparsity=kernel_sparsity)

  def _geometry(self, x: SparseTensor) -> tuple[SparseTensor, tuple[int, ...]]:
    return rules.strided_geometry(type(self).__name__, x, self.kernel_size, self.strides, self.padding,
                                  self.kernel_dilation, self.spatial_ndim)


class SparseConv3d(_StridedConv):
  """Strided sparse convolution: the nnx twin of `jsparse.nn.SparseConv3d` (`jsparse.sparse_conv3d`).

  kernel_size is required (as nnx.Conv's). padding: "SAME" (default, as nnx.Conv: output grid
  ceil(X / stride), the odd cell of padding after the grid), "VALID" (= 0), an int or 3 ints (symmetric).
  out_capacity: static output rows (required under jit; None counts them, outside jit only); a call's
  `out_capacity=` argument overrides it (e.g. the input's capacity bucket).
  """

  def __init__(self, *args, out_capacity: int | None = None, **kwargs):
    super().__init__(*args, **kwargs)
    self.out_capacity = out_capacity

  def __call__(self, x: SparseTensor, out_capacity: int | None = None) -> SparseTensor:
    """The strided convolution of x; the output carries the pair map for SparseInverseConv3d."""
    x, kernel, bias = self._conv_inputs(x)
    x, padding = self._geometry(x)
    return self._call(sparse_conv.sparse_conv3d, x, weight=kernel, bias=bias, stride=self.strides, padding=padding,
                      dilation=self.kernel_dilation,
                      out_capacity=self.out_capacity if out_capacity is None else out_capacity,
                      implementation=self.implementation, precision=self.precision, weight_layout=self.kernel_layout,
                      feature_group_count=self.feature_group_count)


SparseConv3d.__init__.__signature__ = rules.signature_with_keyword(  # type: ignore[attr-defined]
    _StridedConv.__init__, "out_capacity", None, int | None)


class SparseInverseConv3d(_StridedConv):
  """The nnx twin of `jsparse.nn.SparseInverseConv3d` (`jsparse.sparse_inverse_conv3d`), called as
  `module(y, like=x)` where y lives on the output coordinates of a SparseConv3d of x with the same
  kernel_size / strides / padding / kernel_dilation (padding "SAME" by default, kernel_size required, as
  SparseConv3d's); the output is on x's coordinates. in_features: y's channels."""

  def __call__(self, y: SparseTensor, *, like: SparseTensor) -> SparseTensor:
    """y carried back onto like's coordinates."""
    y, kernel, bias = self._conv_inputs(y)
    like = rules.check_sparse(like, type(self).__name__)
    padded_like, padding = self._geometry(like)
    out = self._call(sparse_conv.sparse_inverse_conv3d, y, weight=kernel, bias=bias, like=padded_like,
                     stride=self.strides, padding=padding, dilation=self.kernel_dilation,
                     implementation=self.implementation, precision=self.precision, weight_layout=self.kernel_layout,
                     feature_group_count=self.feature_group_count)
    return rules.on_grid(out, like.spatial_shape, like.caches)


class SparseConvTranspose3d(_ConvParams):
  """Transposed sparse convolution: the nnx twin of `jsparse.nn.SparseConvTranspose3d`
  (`jsparse.sparse_conv_transpose3d`), PyTorch's ConvTranspose3d rule: input site j at kernel index v feeds
  output j*strides - padding + v*kernel_dilation, output grid (X-1)*strides - 2*padding +
  kernel_dilation*(k-1) + output_padding + 1 per axis. kernel_size None (default) is strides: generative
  upsampling, every site spawns its prod(strides) children, and `module(x, mask=None)` with mask bool
  [x.capacity, prod(strides)] keeps a subset (mask needs this form).
  kernel: (*kernel_size, in_features, out_features), or (out_features, *kernel_size, in_features) with
  kernel_layout="ODHWI"."""

  def __init__(self, in_features: int, out_features: int, strides: int | Sequence[int] = 2, *,
               kernel_size: int | Sequence[int] | None = None, padding: int | Sequence[int] | str = 0,
               output_padding: int | Sequence[int] = 0, kernel_dilation: int | Sequence[int] = 1,
               out_capacity: int | None = None, use_bias: bool = True, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, precision: Any = None,
               kernel_init: Initializer = default_kernel_init, bias_init: Initializer = _zeros,
               implementation: str | None = None, kernel_layout: str = "DHWIO", feature_group_count: int = 1,
               kernel_sparsity: str | None = None, rngs: nnx.Rngs):
    ks, st, pad, out_pad, dil = rules.transpose_geometry(type(self).__name__, kernel_size, strides, padding,
                                                         output_padding, kernel_dilation, self.spatial_ndim)
    self._init_conv(in_features, out_features, ks, use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                    precision=precision, kernel_init=kernel_init, bias_init=bias_init,
                    implementation=implementation, kernel_layout=kernel_layout, rngs=rngs,
                    feature_group_count=feature_group_count, kernel_sparsity=kernel_sparsity)
    self.kernel_size, self.strides, self.padding, self.output_padding = ks, st, pad, out_pad
    self.kernel_dilation, self.out_capacity = dil, out_capacity

  def __call__(self, x: SparseTensor, mask: jax.Array | None = None,
               out_capacity: int | None = None) -> SparseTensor:
    """The transposed convolution of x (with mask: the children of x's sites that it keeps)."""
    x, kernel, bias = self._conv_inputs(x)
    return self._call(sparse_conv.sparse_conv_transpose3d, x, weight=kernel, bias=bias, stride=self.strides,
                      padding=self.padding, output_padding=self.output_padding, dilation=self.kernel_dilation,
                      out_capacity=self.out_capacity if out_capacity is None else out_capacity, mask=mask,
                      implementation=self.implementation, precision=self.precision, weight_layout=self.kernel_layout,
                      feature_group_count=self.feature_group_count)


class _Pool(nnx.Module):
  """A parameter-free pooling module over `_op` (a pool of jsparse.pool); strides None means kernel_size."""

  spatial_ndim: ClassVar[int] = 3

  def __init__(self, kernel_size: int | Sequence[int] = 2, strides: int | Sequence[int] | None = None,
               padding: int | Sequence[int] | str = 0, *, out_capacity: int | None = None):
    rules.explicit_padding(padding, type(self).__name__, self.spatial_ndim)  # checked now, read at each call
    self.kernel_size, self.strides = _hashable(kernel_size), _hashable(strides)
    self.padding, self.out_capacity = _hashable(padding), out_capacity

  def __call__(self, x: SparseTensor) -> SparseTensor:
    """The pooled tensor."""
    name, ndim = type(self).__name__, self.spatial_ndim
    strides = None if self.strides is None else rules.triple(self.strides, "strides", name, ndim)
    return call_in_rank(self._op, ndim, name, rules.check_sparse(x, name),
                        kernel_size=rules.triple(self.kernel_size, "kernel_size", name, ndim), stride=strides,
                        padding=rules.explicit_padding(self.padding, name, ndim), out_capacity=self.out_capacity)


class SparseMaxPool3d(_Pool):
  """`jsparse.sparse_max_pool3d` (max over the active inputs of each window) as a parameter-free nnx module."""

  _op = staticmethod(pool.sparse_max_pool3d)


class SparseAvgPool3d(_Pool):
  """`jsparse.sparse_avg_pool3d` (mean over the active inputs of each window) as a parameter-free nnx module."""

  _op = staticmethod(pool.sparse_avg_pool3d)



# ---- the same modules on 2D and 1D SparseTensors (SparseTensor.spatial_ndim): sizes take 2 (1) ints, kernels
# (*kernel_size, in, out) have 2 (1) kernel axes, as nnx.Conv's; the 3D classes do the work.


class _Affine(nnx.Module):
  """The "scale" and "bias" [num_features] parameters of a normalisation (each optional, as flax's)."""

  def _init_affine(self, num_features: int, *, dtype, param_dtype, use_bias: bool, use_scale: bool, bias_init,
                   scale_init, rngs: nnx.Rngs) -> None:
    name = type(self).__name__
    num_features = rules.positive_int(num_features, name, "num_features")
    if not isinstance(rngs, nnx.Rngs):
      raise TypeError(f"{name}: rngs must be an nnx.Rngs (e.g. nnx.Rngs(0)), got {type(rngs).__name__}")
    shape = (num_features,)
    self.scale = nnx.Param(scale_init(rngs.params(), shape, param_dtype)) if use_scale else nnx.data(None)
    self.bias = nnx.Param(bias_init(rngs.params(), shape, param_dtype)) if use_bias else nnx.data(None)
    self.num_features, self.dtype, self.param_dtype = num_features, dtype, param_dtype
    self.use_bias, self.use_scale = use_bias, use_scale

  def _affine_inputs(self, x) -> tuple[SparseTensor, jax.Array | None, jax.Array | None, Any]:
    """(x, scale, bias, output dtype), after checking x's channels."""
    name = type(self).__name__
    x = rules.check_sparse(x, name)
    if x.num_channels != self.num_features:
      raise ValueError(f"{name}: built for {self.num_features} channels (num_features) but the input "
                       f"SparseTensor has {x.num_channels}")
    scale = None if self.scale is None else self.scale[...]
    bias = None if self.bias is None else self.bias[...]
    out_dtype = rules.norm_output_dtype(self.dtype, x, self.param_dtype, self.use_scale or self.use_bias)
    return x, scale, bias, out_dtype


class SparseBatchNorm(_Affine):
  """Batch normalisation over the valid rows: the nnx twin of `jsparse.nn.SparseBatchNorm` (nnx.BatchNorm's
  arguments). Running averages are the nnx.BatchStat variables "mean" and "var"; they move by `momentum`
  on every call with batch statistics (`use_running_average=False`, what `model.train()` sets; a batch without
  valid rows, with axis_name on every device, leaves them as they are) and are read
  when `use_running_average=True` (`model.eval()`). activation: e.g. nnx.relu, fused into the same pass.
  implementation: None | "xla" | "pallas": who takes the column sums of batch statistics on one device
  (`jsparse.norm.batch_norm`; None: XLA's, "pallas": the opt-in kernels, no faster on a GPU).
  """

  def __init__(self, num_features: int, *, use_running_average: bool | None = False, momentum: float = 0.99,
               epsilon: float = 1e-5, dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               use_bias: bool = True, use_scale: bool = True, bias_init: Initializer = _zeros,
               scale_init: Initializer = _ones, axis_name: str | None = None, axis_index_groups: Any = None,
               activation: Callable | None = None, implementation: str | None = None, rngs: nnx.Rngs):
    self._init_affine(num_features, dtype=dtype, param_dtype=param_dtype, use_bias=use_bias, use_scale=use_scale,
                      bias_init=bias_init, scale_init=scale_init, rngs=rngs)
    self.implementation = implementation
    self.mean = nnx.BatchStat(jnp.zeros((num_features,), jnp.float32))
    self.var = nnx.BatchStat(jnp.ones((num_features,), jnp.float32))
    self.use_running_average, self.momentum, self.epsilon = use_running_average, momentum, epsilon
    self.axis_name, self.axis_index_groups, self.activation = axis_name, axis_index_groups, activation

  def set_view(self, use_running_average: bool | None = None) -> None:
    """What `nnx.view(model, use_running_average=...)` sets (as nnx.BatchNorm's): without it the view left this
    layer training, on batch statistics that move the running averages, beside the flax layers it did switch."""
    if use_running_average is not None:
      self.use_running_average = use_running_average

  def __call__(self, x: SparseTensor, use_running_average: bool | None = None) -> SparseTensor:
    """Normalised x; the argument, when given, overrides the module's use_running_average."""
    use_ra = self.use_running_average if use_running_average is None else use_running_average
    if use_ra is None:
      raise ValueError("SparseBatchNorm: use_running_average is None both in the constructor and in the call; "
                       "set it in one of them (or call model.train() / model.eval())")
    x, scale, bias, out_dtype = self._affine_inputs(x)
    # Running statistics loaded from a checkpoint of another shape broadcast against the batch's in the update
    # (a [C, 1] var became [C, C]); name them instead.
    for name, stat in (("mean", self.mean), ("var", self.var)):
      if stat.shape != (self.num_features,):
        raise ValueError(f"SparseBatchNorm: its BatchStat '{name}' has shape {tuple(stat.shape)} but num_features "
                         f"is {self.num_features}")
    y, mean, var = rules.batch_norm_step(
        x, scale, bias, self.mean[...], self.var[...], use_running_average=use_ra, update_statistics=not use_ra,
        momentum=self.momentum, epsilon=self.epsilon, axis_name=self.axis_name,
        axis_index_groups=self.axis_index_groups, dtype=out_dtype, activation=self.activation,
        implementation=self.implementation)
    if not use_ra:
      self.mean[...], self.var[...] = mean, var
    return y


class SparseLayerNorm(_Affine):
  """Layer normalisation of each valid row over its channels: the nnx twin of `jsparse.nn.SparseLayerNorm`."""

  def __init__(self, num_features: int, *, epsilon: float = 1e-6, dtype: Dtype | None = None,
               param_dtype: Dtype = jnp.float32, use_bias: bool = True, use_scale: bool = True,
               bias_init: Initializer = _zeros, scale_init: Initializer = _ones, rngs: nnx.Rngs):
    self._init_affine(num_features, dtype=dtype, param_dtype=param_dtype, use_bias=use_bias, use_scale=use_scale,
                      bias_init=bias_init, scale_init=scale_init, rngs=rngs)
    self.epsilon = epsilon

  def __call__(self, x: SparseTensor) -> SparseTensor:
    """Each valid row normalised over its channels."""
    x, scale, bias, out_dtype = self._affine_inputs(x)
    return norm.layer_norm(x, scale, bias, epsilon=self.epsilon, dtype=out_dtype)


class SparseGroupNorm(_Affine):
  """Group normalisation per batch item over the valid rows: the nnx twin of `jsparse.nn.SparseGroupNorm`
  (nnx.GroupNorm's arguments: exactly one of num_groups / group_size, dividing num_features). activation: e.g.
  nnx.silu, fused into the same pass."""

  def __init__(self, num_features: int, num_groups: int | None = 32, group_size: int | None = None, *,
               epsilon: float = 1e-6, dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               use_bias: bool = True, use_scale: bool = True, bias_init: Initializer = _zeros,
               scale_init: Initializer = _ones, activation: Callable | None = None, rngs: nnx.Rngs):
    self._init_affine(num_features, dtype=dtype, param_dtype=param_dtype, use_bias=use_bias, use_scale=use_scale,
                      bias_init=bias_init, scale_init=scale_init, rngs=rngs)
    self.num_groups = rules.group_count(type(self).__name__, num_features, num_groups, group_size)
    self.group_size, self.epsilon, self.activation = self.num_features // self.num_groups, epsilon, activation

  def __call__(self, x: SparseTensor) -> SparseTensor:
    """x normalised per batch item and channel group (then the activation, if any)."""
    x, scale, bias, out_dtype = self._affine_inputs(x)
    return norm.group_norm(x, self.num_groups, scale, bias, epsilon=self.epsilon, dtype=out_dtype,
                           activation=self.activation)

SubMConv2d = rules.in_rank(SubMConv3d, 2, __name__)
SparseConv2d = rules.in_rank(SparseConv3d, 2, __name__)
SparseInverseConv2d = rules.in_rank(SparseInverseConv3d, 2, __name__)
SparseConvTranspose2d = rules.in_rank(SparseConvTranspose3d, 2, __name__)
SparseMaxPool2d = rules.in_rank(SparseMaxPool3d, 2, __name__)
SparseAvgPool2d = rules.in_rank(SparseAvgPool3d, 2, __name__)
SubMConv1d = rules.in_rank(SubMConv3d, 1, __name__)
SparseConv1d = rules.in_rank(SparseConv3d, 1, __name__)
SparseInverseConv1d = rules.in_rank(SparseInverseConv3d, 1, __name__)
SparseConvTranspose1d = rules.in_rank(SparseConvTranspose3d, 1, __name__)
SparseMaxPool1d = rules.in_rank(SparseMaxPool3d, 1, __name__)
SparseAvgPool1d = rules.in_rank(SparseAvgPool3d, 1, __name__)
