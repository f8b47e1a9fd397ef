"""What the flax.linen modules (jsparse.nn) and the flax.nnx modules (jsparse.nnx) share besides the functional
ops they call: hyper-parameter checks, the strided convolutions' padding (nn.Conv's "SAME" included), the
kernel's layout and initialisation, dtype promotion, the batch norm step with its running averages, and the
containers' passing of flags and feature functions to their layers. Each function is written once here so
that the two module families cannot drift apart (their parameters are interchangeable, see
`jsparse.nnx.linen_to_nnx`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import dtypes as flax_dtypes
from jax import lax

from jsparse import norm, sparse_conv, topology
from jsparse._types import WeightLayout
from jsparse.neighbors import lift_triple
from jsparse.size_errors import sizes_in_rank
from jsparse.sparse_tensor import SparseTensor, check_feats_dtype
from jsparse.sparsity import prune_2to4

NORM_KINDS = ("batch", "group", None)


def check_sparse(x, module: str) -> SparseTensor:
  if not isinstance(x, SparseTensor):
    raise TypeError(f"{module} takes a jsparse.SparseTensor, got {type(x).__name__}")
  return x


def triple(value, name: str, module: str, ndim: int = 3) -> tuple[int, ...]:
  """A module's size (an int or `ndim` ints) as a tuple of `ndim` ints; `ndim` is the module's spatial_ndim."""
  try:
    return lift_triple(value, name, ndim)[3 - ndim:]
  except (TypeError, ValueError) as e:
    raise type(e)(f"{module}: {e}") from None


@contextlib.contextmanager
def op_errors(module: str, ndim: int):
  """The ValueErrors of the ops' own checks run inside, after the module's name and quoting the module's rank
  (`jsparse.size_errors`)."""
  try:
    with sizes_in_rank(ndim):
      yield
  except ValueError as e:
    raise ValueError(f"{module}: {e}") from None


def submanifold_geometry(module: str, kernel_size, strides, padding, kernel_dilation, ndim: int = 3):
  """(kernel_size, dilation) of a submanifold convolution (`ndim` ints each), after checking what nn.Conv
  would accept but a submanifold convolution cannot (even kernels, strides, padding other than "SAME")."""
  ks = triple(kernel_size, "kernel_size", module, ndim)
  if any(k % 2 == 0 for k in ks):
    raise ValueError(f"{module}: kernel_size must be odd (a submanifold kernel is centred), got {ks}")
  if triple(strides, "strides", module, ndim) != (1,) * ndim:
    raise ValueError(f"{module}: strides must be 1 (a submanifold convolution keeps the input sites), got "
                     f"{strides!r}; use SparseConv{ndim}d to downsample")
  if not (isinstance(padding, str) and padding.upper() == "SAME"):
    raise ValueError(f"{module}: padding must be 'SAME' (the output sites are the input sites), got {padding!r}")
  check_sizes(module, ks, 1, 0, kernel_dilation, ndim)
  return ks, triple(kernel_dilation, "kernel_dilation", module, ndim)


def check_sizes(module: str, kernel_size, strides, padding, kernel_dilation, ndim: int = 3) -> None:
  """The op's own checks of a convolution's sizes (kernel_size, strides, dilation >= 1, explicit padding >= 0; "SAME"
  counts as 0), run by the module: its kernel parameter is made from kernel_size before the op runs, and a
  negative extent failed inside jnp's broadcasting, naming neither the module nor the argument."""
  lifted = lambda value, name, fill: (fill,) * (3 - ndim) + triple(value, name, module, ndim)
  pad = 0 if is_same_padding(padding) else explicit_padding(padding, module, ndim)
  # Lifted before op_errors: triple's errors already name the module (op_errors would name it twice).
  sizes = (lifted(kernel_size, "kernel_size", 1), lifted(strides, "strides", 1), lifted(pad, "padding", 0),
           lifted(kernel_dilation, "kernel_dilation", 1))
  with op_errors(module, ndim):
    sparse_conv.kernel_arguments(*sizes)


def is_same_padding(value) -> bool:
  return isinstance(value, str) and value.upper() == "SAME"


def explicit_padding(value, module: str, ndim: int = 3) -> tuple[int, ...]:
  """Symmetric padding per axis (`ndim` ints) from ints or "VALID" (the pools' padding, and a convolution's
  once "SAME" is resolved by `strided_geometry`)."""
  if isinstance(value, str):
    if value.upper() == "VALID":
      return (0,) * ndim
    raise ValueError(f"{module}: padding must be ints or 'VALID', got {value!r}")
  return triple(value, "padding", module, ndim)


def check_conv_padding(value, module: str, ndim: int = 3) -> None:
  """A strided convolution's padding: "SAME", "VALID", an int or `ndim` ints."""
  if isinstance(value, str):
    if value.upper() not in ("SAME", "VALID"):
      raise ValueError(f"{module}: padding must be 'SAME', 'VALID' or ints, got {value!r}")
    return
  explicit_padding(value, module, ndim)


def same_padding(spatial_shape, kernel_size, strides, dilation) -> tuple[tuple[int, ...], tuple[int, ...]]:
  """(low padding, extra high padding) per axis of lax's "SAME": total = max((ceil(X/s) - 1)*s + (k-1)*d + 1
  - X, 0), low = total // 2, high = total - low, so the extra (high - low) is 0 or 1."""
  low, extra = [], []
  for n, k, s, d in zip(spatial_shape, kernel_size, strides, dilation):
    total = max((-(-n // s) - 1) * s + (k - 1) * d + 1 - n, 0)
    low.append(total // 2)
    extra.append(total - 2 * (total // 2))
  return tuple(low), tuple(extra)


def on_grid(x: SparseTensor, spatial_shape, caches=None) -> SparseTensor:
  """x on a grid of another extent (the same sites): the symmetric padding of the core ops plus one empty slice
  at the high end of an axis is "SAME"'s uneven padding. Maps keyed by the old grid are dropped."""
  if tuple(spatial_shape) == x.spatial_shape:
    return x
  return dataclasses.replace(x, spatial_shape=tuple(spatial_shape), caches={} if caches is None else caches)


def strided_geometry(module: str, x: SparseTensor, kernel_size, strides, padding, kernel_dilation,
                     ndim: int = 3) -> tuple[SparseTensor, tuple[int, ...]]:
  """(x on the padded grid, symmetric padding: `ndim` ints) of a strided convolution (or of the SparseConv3d
  whose output an inverse convolution carries back onto x): "SAME" is lax's, "VALID" is 0, ints are symmetric
  padding. x's spatial_shape has 3 entries whatever its rank; the lifted axes (extent 1) need no padding."""
  check_conv_padding(padding, module, ndim)
  check_sizes(module, kernel_size, strides, padding, kernel_dilation, ndim)  # first: a stride of 0 divides below
  if not is_same_padding(padding):
    return x, explicit_padding(padding, module, ndim)
  lifted = lambda value, name: (1,) * (3 - ndim) + triple(value, name, module, ndim)
  ks, st = lifted(kernel_size, "kernel_size"), lifted(strides, "strides")
  dil = lifted(kernel_dilation, "kernel_dilation")
  low, extra = same_padding(x.spatial_shape, ks, st, dil)
  return on_grid(x, [n + e for n, e in zip(x.spatial_shape, extra)]), low[3 - ndim:]


def transpose_geometry(module: str, kernel_size, strides, padding, output_padding, kernel_dilation, ndim: int = 3):
  """(kernel_size, strides, padding, output_padding, dilation), `ndim` ints each, of a transposed convolution
  module: kernel_size None means strides (generative upsampling); padding is PyTorch's (ints, or "VALID" = 0:
  flax's "SAME" has no PyTorch counterpart); output_padding must be smaller than the stride or the dilation."""
  st = triple(strides, "strides", module, ndim)
  ks = st if kernel_size is None else triple(kernel_size, "kernel_size", module, ndim)
  pad = explicit_padding(padding, module, ndim)
  out_pad = triple(output_padding, "output_padding", module, ndim)
  dil = triple(kernel_dilation, "kernel_dilation", module, ndim)
  ones, zeros = (1,) * (3 - ndim), (0,) * (3 - ndim)
  with op_errors(module, ndim):  # the op's own checks, on a grid that is large enough for any padding
    sparse_conv.transpose_geometry((2 * max(pad) + 1,) * 3, ones + ks, ones + st, zeros + pad, zeros + out_pad,
                                   ones + dil)
  return ks, st, pad, out_pad, dil


def positive_int(value, module: str, name: str) -> int:
  """A module's count (features, groups) as a Python int: numpy integers pass, as they do for flax's modules and
  for every size of the ops (kernel_size, strides, feature_group_count); bools and non-integers do not."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value <= 0:
    raise ValueError(f"{module}: {name} must be a positive int, got {value!r}")
  return int(value)


def check_conv_features(module: str, features, kernel_layout: str, name: str = "features") -> int:
  features = positive_int(features, module, name)
  WeightLayout.of(kernel_layout, f"{module}: kernel_layout")
  return features


def check_feature_groups(module: str, groups, in_features: int, features: int) -> int:
  """nn.Conv's feature_group_count: a positive int dividing the input and output channels."""
  groups = positive_int(groups, module, "feature_group_count")
  if in_features % groups or features % groups:
    raise ValueError(f"{module}: feature_group_count={groups} must divide the input channels ({in_features}) and "
                     f"the output channels ({features})")
  return groups


def kernel_shape(kernel_size, in_features: int, features: int, kernel_layout: str,
                 groups: int = 1) -> tuple[int, ...]:
  """"DHWIO": nn.Conv's (*kernel_size, in_features / groups, features); "ODHWI": (features, *kernel_size,
  in_features / groups)."""
  if kernel_layout == "ODHWI":
    return (features, *kernel_size, in_features // groups)
  return (*kernel_size, in_features // groups, features)


def kernel_initializer(kernel_init: Callable, kernel_layout: str) -> Callable:
  """kernel_init for `kernel_shape(..., kernel_layout)`: an "ODHWI" kernel is drawn in the "DHWIO" shape and
  transposed once, so the initialiser reads the same fan-in and fan-out in either layout."""
  if kernel_layout != "ODHWI":
    return kernel_init
  return lambda key, shape, dtype: jnp.moveaxis(kernel_init(key, (*shape[1:], shape[0]), dtype), -1, 0)


KERNEL_SPARSITIES = (None, "2:4")


def check_kernel_sparsity(module: str, kernel_sparsity) -> None:
  if kernel_sparsity not in KERNEL_SPARSITIES:
    raise ValueError(f"{module}: kernel_sparsity must be one of {KERNEL_SPARSITIES}, got {kernel_sparsity!r}")


def sparse_kernel(module: str, kernel: jax.Array, kernel_sparsity, kernel_layout: str) -> jax.Array:
  """The kernel a convolution module computes with: as stored, or for kernel_sparsity="2:4" its magnitude 2:4
  pruning over input channels (`jsparse.sparsity.prune_2to4`), recomputed from the stored values each call."""
  check_kernel_sparsity(module, kernel_sparsity)
  if kernel_sparsity is None:
    return kernel
  try:
    return prune_2to4(kernel, weight_layout=kernel_layout)
  except ValueError as e:
    raise ValueError(f"{module}: kernel_sparsity='2:4' prunes groups of 4 input channels: {e}") from None


def check_kernel_inputs(module: str, kernel_shape_: tuple[int, ...], kernel_layout: str, cin: int,
                        groups: int = 1) -> None:
  """A kernel whose input-channel extent is not the input's channel count (over feature_group_count), named as
  such (flax would report it as an initialiser shape mismatch, or a matmul as a dimension error)."""
  have = kernel_shape_[-1 if kernel_layout == "ODHWI" else -2] if len(kernel_shape_) >= 3 else None
  if have is not None and have * groups != cin:
    per_group = f" (feature_group_count={groups}: {have * groups} in all)" if groups > 1 else ""
    raise ValueError(f"{module}: its kernel {tuple(kernel_shape_)} ({kernel_layout}) expects {have} input channels"
                     f"{per_group} but the input SparseTensor has {cin}")


def promote_conv(x: SparseTensor, kernel, bias, dtype) -> tuple[SparseTensor, jax.Array, jax.Array | None]:
  """(x, kernel, bias) in the compute dtype by flax's rule (`dtype` None promotes the features' and the
  parameters' dtypes). An integer or bool dtype is refused here, naming it (the features check would name feats)."""
  if dtype is not None:
    check_feats_dtype(dtype, "dtype")
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
  num_groups = None if num_groups is None else positive_int(num_groups, module, "num_groups")
  group_size = None if group_size is None else positive_int(group_size, module, "group_size")
  if group_size is not None:
    if channels % group_size:
      raise ValueError(f"{module}: the number of channels ({channels}) must be divisible by group_size "
                       f"({group_size})")
    return channels // group_size
  if channels % num_groups:
    raise ValueError(f"{module}: the number of channels ({channels}) must be divisible by num_groups ({num_groups})")
  return num_groups


def level_widths(module: str, features) -> tuple[int, ...]:
  """A U-Net's widths per level (`features`) as a non-empty tuple of positive ints: an int or an empty tuple
  failed in the model's indexing (TypeError / IndexError) without naming the argument."""
  try:
    widths = () if isinstance(features, (str, bytes)) else tuple(features)
  except TypeError:
    widths = ()
  if not widths:
    raise ValueError(f"{module}: features must be a non-empty sequence of ints (the widths per level, finest "
                     f"first), got {features!r}")
  return tuple(positive_int(width, module, "features") for width in widths)


def check_norm_kind(module: str, kind) -> None:
  if kind not in NORM_KINDS:
    raise ValueError(f"{module}: norm must be 'batch', 'group' or None, got {kind!r}")


def batch_norm_step(x: SparseTensor, scale, bias, running_mean, running_var, *, use_running_average: bool,
                    update_statistics: bool, momentum: float, epsilon: float, axis_name, axis_index_groups,
                    dtype, activation: Callable | None,
                    implementation: str | None = None) -> tuple[SparseTensor, Any, Any]:
  """One SparseBatchNorm call: (y, new running mean, new running var).

  With running averages the statistics pass through unchanged. With batch statistics they move towards the
  batch's (float32, no gradient) by `momentum` when update_statistics, as flax's BatchNorm does, unless the
  batch has no valid rows (on any device of `axis_name`): its statistics are then placeholders (0 and 0), and
  the running averages stay as they are.
  implementation: who takes batch statistics' column sums (`norm.batch_norm`).
  """
  if use_running_average:
    y = norm.batch_norm(x, scale, bias, mean=running_mean, var=running_var, epsilon=epsilon, dtype=dtype,
                        activation=activation)
    return y, running_mean, running_var
  if axis_name is None:  # one device: the fused train-mode batch norm, statistics included
    y, (mean, var) = norm.batch_norm(x, scale, bias, epsilon=epsilon, dtype=dtype, activation=activation,
                                     return_statistics=True, implementation=implementation)
    rows = x.num
  else:  # what batch_norm does with axis_name, keeping the pooled row count that the statistics' psum brings
    mean, var, rows = norm.batch_statistics(x, axis_name=axis_name, axis_index_groups=axis_index_groups,
                                            return_count=True)
    y = norm.batch_norm(x, scale, bias, mean=mean, var=var, epsilon=epsilon, dtype=dtype, activation=activation,
                        implementation=implementation)
  if not update_statistics:
    return y, running_mean, running_var
  mean, var = lax.stop_gradient(mean), lax.stop_gradient(var)
  # Averaging an empty batch's placeholders in would shrink the running variance towards 0 (an eval after a
  # pruning step that left no sites would divide by it); with axis_name, "empty" means on every device.
  has_rows = rows > 0
  return (y, jnp.where(has_rows, momentum * running_mean + (1 - momentum) * mean, running_mean),
          jnp.where(has_rows, momentum * running_var + (1 - momentum) * var, running_var))


def accepted_kwargs(fn: Callable, kwargs: dict) -> dict:
  """The entries of kwargs that fn's signature takes by name (all of them if it takes **kwargs)."""
  try:
    params = inspect.signature(fn).parameters.values()
  except (TypeError, ValueError):
    return {}
  if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
    return dict(kwargs)
  names = {p.name for p in params if p.kind in (inspect.Parameter.KEYWORD_ONLY,
                                                inspect.Parameter.POSITIONAL_OR_KEYWORD)}
  return {k: v for k, v in kwargs.items() if k in names}


# The two spellings of one mode: batch norm's use_running_average and the blocks' and models' train.
_MODE_FLAGS = ("use_running_average", "train")


def _with_mode_flags(module: str, kwargs: dict) -> dict:
  """kwargs with the mode flag given also under its other name, so that Sequential(...)(x,
  use_running_average=True) puts a SparseResNetBlock (which takes `train`) in eval mode too (it trained on the
  batch's statistics silently), and `train=False` reaches a SparseBatchNorm."""
  given = {name: kwargs[name] for name in _MODE_FLAGS if kwargs.get(name) is not None}
  if len(given) == 2:
    if bool(given["train"]) == bool(given["use_running_average"]):
      raise ValueError(f"{module}: train={given['train']} and use_running_average={given['use_running_average']} "
                       "contradict each other (train means use_running_average=False); pass one of them")
    return kwargs
  if "use_running_average" in given:
    return {**kwargs, "train": not given["use_running_average"]}
  if "train" in given:
    return {**kwargs, "use_running_average": not given["train"]}
  return kwargs


def apply_layers(module: str, layers: Sequence[Callable[..., Any]], x: SparseTensor, kwargs: dict,
                 module_type: type) -> Any:
  """What Sequential does in either family: each layer of `module_type` gets the tensor and the keyword
  arguments its `__call__` names; any other callable is a function of the valid rows' features
  (`jsparse.norm.activation`); a keyword that no layer names raises TypeError."""
  if not layers:
    raise ValueError(f"{module}: layers is empty")
  check_sparse(x, module)
  unused = set(kwargs)
  for index, layer in enumerate(layers):
    if not isinstance(x, SparseTensor):
      raise TypeError(f"{module}: layer {index} ({type(layer).__name__}) gets a {type(x).__name__}: only the "
                      "last layer may return something other than a SparseTensor")
    if isinstance(layer, module_type):
      accepted = accepted_kwargs(layer.__call__, _with_mode_flags(module, kwargs))
      unused -= {flag for name in accepted for flag in (_MODE_FLAGS if name in _MODE_FLAGS else (name,))}
      x = layer(x, **accepted)
    elif callable(layer):
      x = norm.activation(x, layer)
    else:
      raise TypeError(f"{module}: layer {index} is a {type(layer).__name__}, not a module or a callable")
  if unused:  # a misspelt flag would otherwise be dropped silently
    raise TypeError(f"{module}: no layer takes the keyword argument(s) {sorted(unused)}")
  return x


def dropout_step(x: SparseTensor, rate: float, deterministic: bool, make_key: Callable[[], jax.Array]) -> SparseTensor:
  """SparseDropout in either family: the input as it is when deterministic or rate is 0, else
  `jsparse.topology.dropout` with a key drawn (only then) by make_key."""
  if deterministic or rate == 0.0:
    return topology.dropout(x, rate, deterministic=True)
  return topology.dropout(x, rate, rng=make_key())


def in_rank(layer: type, ndim: int, module: str) -> type:
  """`layer` (a 3D jsparse layer) on `ndim`-D SparseTensors: its subclass with `spatial_ndim = ndim`, named with
  "{ndim}d" for "3d" (sizes then take ndim ints, kernels have ndim kernel axes; the 3D code does the work)."""
  name = layer.__name__.replace("3d", f"{ndim}d")
  doc = (f"`{layer.__name__}` on {ndim}D SparseTensors (`SparseTensor.spatial_ndim == {ndim}`): sizes take {ndim} "
         f"int(s) and the kernel has {ndim} kernel axis/axes in place of 3; everything else as `{layer.__name__}`.")
  return type(name, (layer,), {"spatial_ndim": ndim, "__doc__": doc, "__module__": module, "__qualname__": name})


def signature_with_keyword(fn: Callable, name: str, default: Any, annotation: Any) -> inspect.Signature:
  """fn's signature with one more keyword-only parameter first among the keywords: the signature a subclass's
  `__init__(self, *args, name=default, **kwargs)` really accepts, for help() and the API reference."""
  sig = inspect.signature(fn)
  params = list(sig.parameters.values())
  at = next((i for i, p in enumerate(params) if p.kind is inspect.Parameter.KEYWORD_ONLY), len(params))
  params.insert(at, inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=default, annotation=annotation))
  return sig.replace(parameters=params)
