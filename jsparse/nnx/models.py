"""The nnx twins of jsparse.nn.models: the same blocks, made of jsparse.nnx layers, with the same submodule
names as the linen ones so that `jsparse.nnx.linen_to_nnx` carries a trained linen model's variables over."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx

from jsparse import norm
from jsparse.layer_rules import check_norm_kind, level_widths
from jsparse.nnx.layers import SparseBatchNorm, SparseConv3d, SparseGroupNorm, SparseInverseConv3d, SubMConv3d
from jsparse.sparse_conv import concat
from jsparse.sparse_tensor import SparseTensor

__all__ = ["SparseResNetBlock", "SparseUNet"]


def _use_running_average(train: bool | None) -> bool | None:
  return None if train is None else not train


class SparseResNetBlock(nnx.Module):
  """The nnx twin of `jsparse.nn.SparseResNetBlock`: y = act(norm2(conv2(act(norm1(conv1(x))))) + shortcut(x))
  with SubMConv3d(kernel_size) convolutions; the shortcut is the identity when in_features == features and a
  1x1x1 projection ("proj", no bias, then "proj_norm") otherwise.

  norm: "batch" (SparseBatchNorm, training mode unless `model.eval()` or the call's `train=False`), "group"
  (SparseGroupNorm with `num_groups`) or None (the convolutions then have biases).
  """

  def __init__(self, in_features: int, features: int, kernel_size: int = 3, *, norm: str | None = "batch",
               num_groups: int = 8, activation: Callable[[jax.Array], jax.Array] = nnx.relu,
               dtype: Any = None, param_dtype: Any = jnp.float32, implementation: str | None = None,
               bn_momentum: float = 0.99, axis_name: str | None = None, rngs: nnx.Rngs):
    check_norm_kind(type(self).__name__, norm)
    with_bias = norm is None  # a norm right after the conv makes its bias redundant
    common = dict(dtype=dtype, param_dtype=param_dtype, rngs=rngs)

    def conv(cin: int, k: int) -> SubMConv3d:
      return SubMConv3d(cin, features, k, use_bias=with_bias, implementation=implementation, **common)

    def make_norm(fused_activation=None):
      if norm == "batch":
        return SparseBatchNorm(features, momentum=bn_momentum, axis_name=axis_name, activation=fused_activation,
                               implementation=implementation, **common)
      if norm == "group":
        return SparseGroupNorm(features, num_groups, activation=fused_activation, **common)
      return nnx.data(None)

    # norm1 applies the activation in its own pass (its backward recomputes rather than keeps the normalised rows).
    self.conv1, self.norm1 = conv(in_features, kernel_size), make_norm(activation)
    self.conv2, self.norm2 = conv(features, kernel_size), make_norm()
    if in_features != features:
      self.proj, self.proj_norm = conv(in_features, 1), make_norm()
    else:
      self.proj, self.proj_norm = nnx.data(None), nnx.data(None)
    self.activation = activation

  def _norm(self, module, h: SparseTensor, train: bool | None) -> SparseTensor:
    if module is None:
      return h
    if isinstance(module, SparseBatchNorm):
      return module(h, use_running_average=_use_running_average(train))
    return module(h)

  def __call__(self, x: SparseTensor, train: bool | None = None) -> SparseTensor:
    """The block on x's sites; train (None: the batch norms' own mode) picks batch or running statistics."""
    h = self._norm(self.norm1, self.conv1(x), train)
    if self.norm1 is None:
      h = norm.activation(h, self.activation)
    h = self._norm(self.norm2, self.conv2(h), train)
    shortcut = x if self.proj is None else self._norm(self.proj_norm, self.proj(x), train)
    out = h.replace(feats=h.feats + shortcut.feats.astype(h.dtype))
    return norm.activation(out, self.activation)


class SparseUNet(nnx.Module):
  """The nnx twin of `jsparse.nn.SparseUNet`: at each level a residual block, then a 2x2x2 stride-2
  SparseConv3d down; on the way up a SparseInverseConv3d back onto the skip's coordinates, concatenation with
  the skip, and a block; a 1x1x1 "head" gives `out_features` channels on x's coordinates.

  in_features: the input's channels; features: widths per level, finest first.
  """

  def __init__(self, in_features: int, features: tuple[int, ...] = (16, 32, 64), out_features: int = 1, *,
               norm: str | None = "group", num_groups: int = 8,
               activation: Callable[[jax.Array], jax.Array] = nnx.relu, dtype: Any = None,
               param_dtype: Any = jnp.float32, implementation: str | None = None, rngs: nnx.Rngs):
    features = level_widths(type(self).__name__, features)
    common = dict(dtype=dtype, param_dtype=param_dtype, implementation=implementation, rngs=rngs)

    def block(cin: int, width: int) -> SparseResNetBlock:
      return SparseResNetBlock(cin, width, norm=norm, num_groups=num_groups, activation=activation, **common)

    self.stem = SubMConv3d(in_features, features[0], **common)
    # Named attributes (not lists) so that the variable paths are the linen model's.
    for level, width in enumerate(features[1:]):
      setattr(self, f"down_block{level}", block(features[level], features[level]))
      setattr(self, f"down{level}", SparseConv3d(features[level], width, kernel_size=2, strides=2,
                                                 padding="VALID", **common))
    self.bottom = block(features[-1], features[-1])
    for level in range(len(features) - 1):
      setattr(self, f"up{level}", SparseInverseConv3d(features[level + 1], features[level], kernel_size=2,
                                                      strides=2, padding="VALID", **common))
      setattr(self, f"up_block{level}", block(2 * features[level], features[level]))
    self.head = SubMConv3d(features[0], out_features, kernel_size=1, **common)
    self.features, self.activation = features, activation

  def __call__(self, x: SparseTensor, train: bool | None = None) -> SparseTensor:
    """The network's output on x's coordinates."""
    act = lambda t: norm.activation(t, self.activation)  # noqa: E731
    h = act(self.stem(x))
    skips = []
    for level in range(len(self.features) - 1):
      h = getattr(self, f"down_block{level}")(h, train)
      skips.append(h)
      # Kernel == stride gives every coarse site a fine input: the fine capacity always suffices.
      h = act(getattr(self, f"down{level}")(h, out_capacity=h.capacity))
    h = self.bottom(h, train)
    for level in reversed(range(len(self.features) - 1)):
      skip = skips[level]
      h = act(getattr(self, f"up{level}")(h, like=skip))
      h = getattr(self, f"up_block{level}")(concat(h, skip), train)
    return self.head(h)
