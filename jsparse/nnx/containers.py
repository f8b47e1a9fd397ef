"""flax.nnx twins of the jsparse.nn containers: Sequential, TensorFn, ToDense, SparseDropout.

They run the same code as the linen containers (`jsparse.layer_rules.apply_layers` and `dropout_step`), so
a keyword argument reaches the same layers and a feature function is lifted the same way in either family.
"""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
from flax import nnx

from jsparse import layer_rules as rules
from jsparse.sparse_tensor import SparseTensor
from jsparse.topology import check_rate

__all__ = ["Sequential", "SparseDropout", "TensorFn", "ToDense"]


class TensorFn(nnx.Module):
  """Wraps a function of SparseTensors (e.g. `functools.partial(jsparse.sparse_max_pool3d, kernel_size=2)`) so
  that `Sequential` passes it the tensor rather than the features."""

  def __init__(self, fn: Callable[[SparseTensor], Any]):
    if not callable(fn):
      raise TypeError(f"TensorFn: fn must be callable, got {type(fn).__name__}")
    self.fn = fn

  def __call__(self, x: SparseTensor) -> Any:
    """fn(x)."""
    return self.fn(x)


class Sequential(nnx.Module):
  """Applies `layers` in order to a SparseTensor: the nnx twin of `jsparse.nn.Sequential`, built as
  `Sequential(layer, layer, ...)` (as nnx.Sequential).

  Each layer is one of:
  - an nnx Module: called with the tensor, plus those of the call's keyword arguments that its `__call__`
    names (`model(x, deterministic=True)` reaches every SparseDropout, `use_running_average=` every
    SparseBatchNorm, a nested Sequential gets all); a keyword that no layer names raises TypeError. Without
    keywords the modules follow their own attributes, which `model.train()` / `model.eval()` set;
  - any other callable: a function of feature arrays (`nnx.relu`, `functools.partial(...)`), applied to the
    valid rows' features by `jsparse.norm.activation` (padding rows stay zero). Wrap a function of
    SparseTensors in `TensorFn` instead.
  Outputs that are not SparseTensors (e.g. of ToDense) end the chain. The layers are the attributes
  `layers_0`, `layers_1`, ... (linen's names for them), so parameters move to and from a `jsparse.nn.Sequential`
  of the twin layers with `linen_to_nnx` / `nnx_to_linen`.
  """

  def __init__(self, *layers: Callable[..., Any]):
    if not layers:
      raise ValueError("Sequential: layers is empty")
    for index, layer in enumerate(layers):
      if isinstance(layer, nn.Module):
        raise TypeError(f"Sequential: layer {index} is a flax.linen module ({type(layer).__name__}); use its "
                        "jsparse.nnx twin")
      if not callable(layer):
        raise TypeError(f"Sequential: layer {index} is a {type(layer).__name__}, not a module or a callable")
    # Named as linen names the entries of its `layers` field, so that linen_to_nnx / nnx_to_linen map them.
    for index, layer in enumerate(layers):
      setattr(self, f"layers_{index}", layer)
    self.num_layers = len(layers)

  @property
  def layers(self) -> list[Callable[..., Any]]:
    """The layers in order."""
    return [getattr(self, f"layers_{index}") for index in range(self.num_layers)]

  def __call__(self, x: SparseTensor, **kwargs: Any) -> Any:
    """The last layer's output."""
    return rules.apply_layers(type(self).__name__, self.layers, x, kwargs, nnx.Module)


class ToDense(nnx.Module):
  """The dense array of a SparseTensor: [B, X, Y, Z, C] (channels-last), or [B, C, X, Y, Z] with
  channels_first=True (spconv's `dense()`). Inactive sites are zero."""

  def __init__(self, channels_first: bool = False):
    self.channels_first = channels_first

  def __call__(self, x: SparseTensor) -> jax.Array:
    """x.todense(channels_first=...)."""
    return rules.check_sparse(x, type(self).__name__).todense(channels_first=self.channels_first)


class SparseDropout(nnx.Module):
  """nnx.Dropout on a SparseTensor's features (`jsparse.topology.dropout`), the nnx twin of
  `jsparse.nn.SparseDropout`: the same arguments as nnx.Dropout (no broadcast_dims), `deterministic` set by
  `model.train()` / `model.eval()` or overridden per call, keys from the `rng_collection` stream of the
  `rngs` given at construction or per call (an nnx.Rngs, an RngStream or a key). Padding rows stay zero; the
  sites and maps are the input's."""

  def __init__(self, rate: float, *, deterministic: bool = False, rng_collection: str = "dropout",
               rngs: nnx.Rngs | nnx.RngStream | None = None):
    rate = check_rate(rate, "SparseDropout: rate")
    self.rate, self.deterministic, self.rng_collection = rate, deterministic, rng_collection
    if isinstance(rngs, nnx.Rngs):
      self.rngs = rngs[rng_collection].fork()
    elif isinstance(rngs, nnx.RngStream):
      self.rngs = rngs.fork()
    elif rngs is None:
      self.rngs = nnx.data(None)
    else:
      raise TypeError(f"SparseDropout: rngs must be an nnx.Rngs, an nnx.RngStream or None, got "
                      f"{type(rngs).__name__}")

  def set_view(self, deterministic: bool | None = None) -> None:
    """What `nnx.view(model, deterministic=...)` sets."""
    if deterministic is not None:
      self.deterministic = deterministic

  def _key(self, rngs) -> jax.Array:
    rngs = self.rngs if rngs is None else rngs
    if rngs is None:
      raise ValueError("SparseDropout: deterministic is False but no rngs were given, neither at construction "
                       "nor in the call")
    if isinstance(rngs, nnx.Rngs):
      return rngs[self.rng_collection]()
    if isinstance(rngs, nnx.RngStream):
      return rngs()
    if isinstance(rngs, jax.Array):
      return rngs
    raise TypeError(f"SparseDropout: rngs must be an nnx.Rngs, an nnx.RngStream or a key, got {type(rngs).__name__}")

  def __call__(self, x: SparseTensor, *, deterministic: bool | None = None,
               rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None) -> SparseTensor:
    """x with features dropped at `rate` and the rest scaled by 1 / (1 - rate), unless deterministic."""
    rules.check_sparse(x, type(self).__name__)
    deterministic = self.deterministic if deterministic is None else deterministic
    return rules.dropout_step(x, self.rate, deterministic, lambda: self._key(rngs))
