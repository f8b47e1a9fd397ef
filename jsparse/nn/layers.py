"""flax.linen modules on SparseTensors: submanifold convolution and normalisations.

Names, argument names and defaults follow flax's `nn.Conv`, `nn.BatchNorm`, `nn.LayerNorm` and
`nn.GroupNorm`, and parameters have the same names and layouts, so a parameter tree of these modules can be
applied to their dense twins (and the other way round).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax.linen import initializers

from jsparse import layer_rules as rules
from jsparse import norm
from jsparse.conv import submconv3d
from jsparse.sparse_tensor import SparseTensor
from jsparse.spatial_rank import call_in_rank

Dtype = Any
Initializer = Callable[..., jax.Array]

__all__ = ["SubMConv3d", "SubMConv2d", "SubMConv1d", "SparseBatchNorm", "SparseLayerNorm", "SparseGroupNorm"]

default_kernel_init = nn.linear.default_kernel_init  # lecun_normal, as nn.Conv


class ConvParams(nn.Module):
  """What every sparse convolution module shares with nn.Conv besides its geometry: the fields `use_bias,
  dtype, param_dtype, precision, kernel_init, bias_init` (as nn.Conv) and `implementation` (None | "xla" |
  "pallas", see `jsparse.submconv3d`), keyword-only so that each module lists just its own geometry fields
  (features, kernel_size, strides, ...) in nn.Conv's positional order; and the creation of nn.Conv's
  "kernel" (*kernel_size, in_features, features) and "bias" (features,) parameters.

  kernel_layout: "DHWIO" (default, nn.Conv's (*kernel_size, in_features, features)) or "ODHWI" ((features,
  *kernel_size, in_features): PyTorch / spconv / FlexGEMM's layout, so their checkpoints load as they are;
  on the GPU its forward reads the kernel in place, where a float32 "DHWIO" forward reads a transposed copy,
  so inference peaks lower). The same initialiser fan-in/fan-out either way (flax reads them off the shape:
  for "ODHWI" it is given the "DHWIO" shape and the result is transposed once, at init).

  feature_group_count: as nn.Conv: input and output channels in that many groups, each output group reading
  its input group only; the kernel's input extent is in_features / feature_group_count (depthwise:
  feature_group_count = in_features).

  kernel_sparsity: None (default) or "2:4": the forward uses `jsparse.sparsity.prune_2to4` of the kernel (the
  two largest |w| of every 4 consecutive input channels per offset; the kernel's input extent must be a
  multiple of 4), recomputed from the stored kernel at each call; the parameters keep their names and shapes.
  With kernels pruned once and `jsparse.sparsity.keep_2to4` it is fixed-mask (ASP) fine-tuning; the dense
  kernels run (no speed path)."""

  spatial_ndim: ClassVar[int] = 3  # the rank of the tensors it takes: its 2D and 1D twins set 2 and 1
  use_bias: bool = dataclasses.field(default=True, kw_only=True)
  dtype: Dtype | None = dataclasses.field(default=None, kw_only=True)
  param_dtype: Dtype = dataclasses.field(default=jnp.float32, kw_only=True)
  precision: Any = dataclasses.field(default=None, kw_only=True)
  kernel_init: Initializer = dataclasses.field(default=default_kernel_init, kw_only=True)
  bias_init: Initializer = dataclasses.field(default=initializers.zeros_init(), kw_only=True)
  implementation: str | None = dataclasses.field(default=None, kw_only=True)
  kernel_layout: str = dataclasses.field(default="DHWIO", kw_only=True)
  feature_group_count: int = dataclasses.field(default=1, kw_only=True)
  kernel_sparsity: str | None = dataclasses.field(default=None, kw_only=True)

  def conv_params(self, x: SparseTensor, kernel_size) -> tuple[SparseTensor, jax.Array, jax.Array | None]:
    """(x with promoted feats, kernel, bias) in the compute dtype (flax's promotion rule; `dtype` None
    promotes the features' and the parameters' dtypes)."""
    name = type(self).__name__
    rules.check_conv_features(name, self.features, self.kernel_layout)
    cin = x.num_channels
    groups = rules.check_feature_groups(name, self.feature_group_count, cin, self.features)
    if self.has_variable("params", "kernel"):
      where = f" '{'/'.join(self.path)}'" if self.path else ""
      rules.check_kernel_inputs(name + where, self.get_variable("params", "kernel").shape, self.kernel_layout, cin,
                                groups)
    kernel = self.param("kernel", rules.kernel_initializer(self.kernel_init, self.kernel_layout),
                        rules.kernel_shape(kernel_size, cin, self.features, self.kernel_layout, groups),
                        self.param_dtype)
    bias = self.param("bias", self.bias_init, (self.features,), self.param_dtype) if self.use_bias else None
    kernel = rules.sparse_kernel(name, kernel, self.kernel_sparsity, self.kernel_layout)
    return rules.promote_conv(x, kernel, bias, self.dtype)


class SubMConv3d(ConvParams):
  """Submanifold sparse 3D convolution (spconv's SubMConv3d) as a flax module.

  The output lives on the input's coordinates. It equals `nn.Conv(features, kernel_size, padding="SAME",
  kernel_dilation=...)` applied to `x.todense()` and read at the active sites, with the same "kernel"
  ((*kernel_size, in_features, features)) and "bias" parameters.

  Attributes (as nn.Conv):
    features: number of output channels.
    kernel_size: int or 3 ints, odd.
    strides: must be 1: a submanifold convolution keeps its sites (use SparseConv3d to downsample).
    padding: must be "SAME" (the output sites are the input sites).
    kernel_dilation: int or 3 ints.
    use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as nn.Conv. `dtype` None computes in
      the promoted dtype of the features and the parameters (flax's rule).
    implementation: None | "xla" | "pallas" (see `jsparse.submconv3d`).
    algorithm: "auto" or a forced Pallas algorithm (see `jsparse.submconv3d`).
    feature_group_count: as nn.Conv (kernel (*kernel_size, in_features / feature_group_count, features)).

  Differences from nn.Conv: kernel_size defaults to 3 (nn.Conv requires it) and must be odd; strides and
  padding admit only their defaults; no input_dilation or mask; the input and output are
  SparseTensors (`jsparse.nn.ToDense` gives the dense array).

  The neighbour map is taken from (and attached to) the SparseTensor's `caches`, so a stack of these
  layers on the same coordinates builds it once. Inside `nn.scan` / `lax.cond`, give the carried tensor its
  maps before the loop, `jsparse.with_maps(x, kernel_size)`, so that the layer does not change its structure.
  """

  features: int
  kernel_size: int | Sequence[int] = 3
  strides: int | Sequence[int] = 1
  padding: str = "SAME"
  kernel_dilation: int | Sequence[int] = 1
  algorithm: str = "auto"

  def _checked_config(self):
    return rules.submanifold_geometry(type(self).__name__, self.kernel_size, self.strides, self.padding,
                                      self.kernel_dilation, self.spatial_ndim)

  @nn.compact
  def __call__(self, x: SparseTensor) -> SparseTensor:
    rules.check_sparse(x, type(self).__name__)
    kernel_size, dilation = self._checked_config()
    x, kernel, bias = self.conv_params(x, kernel_size)
    return call_in_rank(submconv3d, self.spatial_ndim, type(self).__name__, x, weight=kernel, bias=bias,
                        dilation=dilation, implementation=self.implementation, precision=self.precision,
                        algorithm=self.algorithm, weight_layout=self.kernel_layout,
                        feature_group_count=self.feature_group_count)


class _AffineNormAttributes(nn.Module, kw_only=True):
  """The attributes every normalisation shares with flax's (keyword-only, after each norm's own)."""

  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  use_bias: bool = True
  use_scale: bool = True
  bias_init: Initializer = initializers.zeros_init()
  scale_init: Initializer = initializers.ones_init()


class SparseBatchNorm(_AffineNormAttributes):
  """Batch normalisation over the valid rows of a SparseTensor (nn.BatchNorm's attributes and collections).

  Statistics are per channel over every valid row of the batch (padding rows excluded); running averages
  live in the "batch_stats" collection as "mean" and "var" (update with `mutable=["batch_stats"]`); a batch
  without valid rows (with axis_name: on every device) leaves them as they are.
  axis_name: under shard_map/pmap, pools the rows of all devices (psum of sums and counts, so devices with
  different voxel counts are weighted by their rows).
  implementation: None | "xla" | "pallas": who takes the column sums of batch statistics on one device
  (`jsparse.norm.batch_norm`; None: XLA's, "pallas": the opt-in kernels, no faster on a GPU).
  """

  use_running_average: bool | None = None
  momentum: float = 0.99
  epsilon: float = 1e-5
  axis_name: str | None = None
  axis_index_groups: Any = None
  activation: Callable | None = None  # e.g. nn.relu, applied in the same pass as the normalisation
  implementation: str | None = None

  @nn.compact
  def __call__(self, x: SparseTensor, use_running_average: bool | None = None) -> SparseTensor:
    rules.check_sparse(x, type(self).__name__)
    use_running_average = nn.merge_param("use_running_average", self.use_running_average, use_running_average)
    c = (x.num_channels,)
    _check_channels(self, x, ("params", "scale"), ("params", "bias"), ("batch_stats", "mean"), ("batch_stats", "var"))
    ra_mean = self.variable("batch_stats", "mean", lambda s: jnp.zeros(s, jnp.float32), c)
    ra_var = self.variable("batch_stats", "var", lambda s: jnp.ones(s, jnp.float32), c)
    scale, bias = _affine(self, c)
    # As flax: no cross-device reduction and no running-average update while initialising.
    initializing = self.is_initializing()
    update = not (use_running_average or initializing)
    y, mean, var = rules.batch_norm_step(
        x, scale, bias, ra_mean.value, ra_var.value, use_running_average=use_running_average,
        update_statistics=update, momentum=self.momentum, epsilon=self.epsilon,
        axis_name=None if initializing else self.axis_name, axis_index_groups=self.axis_index_groups,
        dtype=_out_dtype(self, x), activation=self.activation, implementation=self.implementation)
    if update:  # an apply without mutable batch_stats may only read them
      ra_mean.value, ra_var.value = mean, var
    return y


class SparseLayerNorm(_AffineNormAttributes):
  """Layer normalisation of each valid row over its channels (nn.LayerNorm's attributes)."""

  epsilon: float = 1e-6

  @nn.compact
  def __call__(self, x: SparseTensor) -> SparseTensor:
    rules.check_sparse(x, type(self).__name__)
    _check_channels(self, x, ("params", "scale"), ("params", "bias"))
    scale, bias = _affine(self, (x.num_channels,))
    return norm.layer_norm(x, scale, bias, epsilon=self.epsilon, dtype=_out_dtype(self, x))


class SparseGroupNorm(_AffineNormAttributes):
  """Group normalisation per batch item over the valid rows (nn.GroupNorm's attributes).

  Exactly one of num_groups / group_size is set (as flax); channels must divide evenly into groups.
  activation: e.g. nn.silu, applied in the same pass as the normalisation (its backward recomputes the
  normalised rows instead of keeping them: `jsparse.norm.group_norm`).
  """

  num_groups: int | None = 32
  group_size: int | None = None
  epsilon: float = 1e-6
  activation: Callable | None = None

  @nn.compact
  def __call__(self, x: SparseTensor) -> SparseTensor:
    name = type(self).__name__
    rules.check_sparse(x, name)
    c = x.num_channels
    _check_channels(self, x, ("params", "scale"), ("params", "bias"))
    num_groups = rules.group_count(name, c, self.num_groups, self.group_size)
    scale, bias = _affine(self, (c,))
    return norm.group_norm(x, num_groups, scale, bias, epsilon=self.epsilon, dtype=_out_dtype(self, x),
                           activation=self.activation)


def _check_channels(module: nn.Module, x: SparseTensor, *variables: tuple[str, str]) -> None:
  """x's channels against those of the module's existing per-channel variables, named as the nnx twins name a
  mismatch: flax compares only parameters (in its own words), and a batch norm without scale and bias would
  broadcast (a 1-channel input) or fail deep inside against running statistics of another width."""
  for collection, name in variables:
    if module.has_variable(collection, name):
      have = module.get_variable(collection, name).shape
      if have != (x.num_channels,):
        where = f" '{'/'.join(module.path)}'" if module.path else ""
        raise ValueError(f"{type(module).__name__}{where}: its {collection} '{name}' has shape {tuple(have)} "
                         f"but the input SparseTensor has {x.num_channels} channels")


def _affine(module: nn.Module, shape):
  scale = module.param("scale", module.scale_init, shape, module.param_dtype) if module.use_scale else None
  bias = module.param("bias", module.bias_init, shape, module.param_dtype) if module.use_bias else None
  return scale, bias


def _out_dtype(module: nn.Module, x: SparseTensor):
  return rules.norm_output_dtype(module.dtype, x, module.param_dtype, module.use_scale or module.use_bias)


# ---- SubMConv3d on 2D and 1D SparseTensors (SparseTensor.spatial_ndim)


SubMConv2d = rules.in_rank(SubMConv3d, 2, __name__)
SubMConv1d = rules.in_rank(SubMConv3d, 1, __name__)
