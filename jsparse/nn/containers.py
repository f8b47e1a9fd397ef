"""flax.linen modules that sequence and convert SparseTensors: Sequential, TensorFn, ToDense, SparseDropout."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax

from jsparse import layer_rules as rules
from jsparse.sparse_tensor import SparseTensor

__all__ = ["Sequential", "SparseDropout", "TensorFn", "ToDense"]


class TensorFn(nn.Module):
  """Wraps a function of SparseTensors (e.g. `functools.partial(jsparse.sparse_max_pool3d, kernel_size=2)`) so
  that `Sequential` passes it the tensor rather than the features."""

  fn: Callable[[SparseTensor], Any]

  def __call__(self, x: SparseTensor) -> Any:
    return self.fn(x)


class Sequential(nn.Module):
  """Applies `layers` in order to a SparseTensor (flax's nn.Sequential for sparse networks).

  Each layer is one of:
  - a flax Module: called with the tensor (the output of the previous layer), plus those of Sequential's
    keyword arguments that its `__call__` names, so that `Sequential(...)(x, use_running_average=False,
    deterministic=False)` reaches every SparseBatchNorm and SparseDropout (and a nested Sequential gets all);
    `use_running_average` and `train` are one flag under two names (`train = not use_running_average`), so either
    also reaches the blocks and models that take `train` (SparseResNetBlock, SparseUNet), or the batch norms;
    a keyword that no layer names raises TypeError;
  - any other callable: a function of feature arrays (`nn.relu`, `jax.nn.gelu`, `functools.partial(...)`),
    applied to the valid rows' features by `jsparse.norm.activation` (padding rows stay zero even where
    fn(0) != 0). Wrap a function of SparseTensors in `TensorFn` instead.
  Outputs that are not SparseTensors (e.g. of ToDense or jsparse.global_pool) end the chain.
  """

  layers: Sequence[Callable[..., Any]]

  @nn.compact
  def __call__(self, x: SparseTensor, **kwargs: Any) -> Any:
    return rules.apply_layers(type(self).__name__, self.layers, x, kwargs, nn.Module)


class ToDense(nn.Module):
  """The dense array of a SparseTensor: [B, X, Y, Z, C] (flax's channels-last), or [B, C, X, Y, Z] with
  channels_first=True (spconv's `dense()`, PyTorch's NCDHW). Inactive sites are zero."""

  channels_first: bool = False

  def __call__(self, x: SparseTensor) -> jax.Array:
    return rules.check_sparse(x, type(self).__name__).todense(channels_first=self.channels_first)


class SparseDropout(nn.Module):
  """flax's nn.Dropout on a SparseTensor's features (`jsparse.topology.dropout`): same attributes and the
  "dropout" rng stream, e.g. `model.apply(v, x, deterministic=False, rngs={"dropout": key})`. Padding rows
  stay zero; the sites and maps are the input's."""

  rate: float
  deterministic: bool | None = None
  rng_collection: str = "dropout"

  @nn.compact
  def __call__(self, x: SparseTensor, deterministic: bool | None = None, rng: jax.Array | None = None) -> SparseTensor:
    rules.check_sparse(x, type(self).__name__)
    deterministic = nn.merge_param("deterministic", self.deterministic, deterministic)
    return rules.dropout_step(x, self.rate, deterministic,
                              lambda: self.make_rng(self.rng_collection) if rng is None else rng)
