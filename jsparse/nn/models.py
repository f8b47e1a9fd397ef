"""Building blocks made of jsparse.nn layers (worked examples as much as library code)."""
from __future__ import annotations

from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp

from jsparse import norm
from jsparse.layer_rules import check_norm_kind, level_widths
from jsparse.nn.layers import SparseBatchNorm, SparseGroupNorm, SubMConv3d
from jsparse.sparse_tensor import SparseTensor

__all__ = ["SparseResNetBlock", "SparseUNet"]


class _BlockAttributes(nn.Module, kw_only=True):
  """What every block of this module passes on to its layers (keyword-only, after each block's own)."""

  num_groups: int = 8
  activation: Callable[[jax.Array], jax.Array] = nn.relu
  dtype: Any = None
  param_dtype: Any = jnp.float32
  implementation: str | None = None


class SparseResNetBlock(_BlockAttributes):
  """A pre-activation-free basic residual block on a fixed set of sites:

    y = act(norm2(conv2(act(norm1(conv1(x))))) + shortcut(x))

  with SubMConv3d(features, kernel_size) convolutions; the shortcut is the identity when the widths match and
  a 1x1x1 SubMConv3d projection (no bias, then the same norm) when they differ. All three convolutions use the
  same coordinates, so the kernel_size map is built once (by conv1) and the 1x1x1 map is trivial.

  norm: "batch" (SparseBatchNorm; pass `train`), "group" (SparseGroupNorm with `num_groups`) or None.
  """

  features: int
  kernel_size: int = 3
  norm: str | None = "batch"
  bn_momentum: float = 0.99
  axis_name: str | None = None

  def _norm(self, name: str, activation=None):
    """The block's norm `name` as f(x, train), with `activation` fused into its pass (or applied alone when the
    block has no norm)."""
    check_norm_kind("SparseResNetBlock", self.norm)
    if self.norm is None:
      return lambda x, train: x if activation is None else norm.activation(x, activation)
    if self.norm == "batch":
      bn = SparseBatchNorm(momentum=self.bn_momentum, dtype=self.dtype, param_dtype=self.param_dtype,
                           axis_name=self.axis_name, activation=activation, implementation=self.implementation,
                           name=name)
      return lambda x, train: bn(x, use_running_average=not train)
    gn = SparseGroupNorm(num_groups=self.num_groups, dtype=self.dtype, param_dtype=self.param_dtype,
                         activation=activation, name=name)
    return lambda x, train: gn(x)

  @nn.compact
  def __call__(self, x: SparseTensor, train: bool = True) -> SparseTensor:
    conv = lambda k, name, bias: SubMConv3d(self.features, k, use_bias=bias, dtype=self.dtype,
                                            param_dtype=self.param_dtype, implementation=self.implementation,
                                            name=name)
    with_bias = self.norm is None  # a norm right after the conv makes its bias redundant
    h = conv(self.kernel_size, "conv1", with_bias)(x)
    h = self._norm("norm1", self.activation)(h, train)
    h = conv(self.kernel_size, "conv2", with_bias)(h)
    h = self._norm("norm2")(h, train)
    if x.num_channels != self.features:
      shortcut = self._norm("proj_norm")(conv(1, "proj", with_bias)(x), train)
    else:
      shortcut = x
    out = h.replace(feats=h.feats + shortcut.feats.astype(h.dtype))
    return norm.activation(out, self.activation)


class SparseUNet(_BlockAttributes):
  """A small sparse U-Net: at each level a residual block, then a 2x2x2 stride-2 SparseConv3d down; on the
  way up a SparseInverseConv3d back onto the skip's coordinates, concatenation with the skip, and a block.

  Output: a SparseTensor on x's coordinates with `out_features` channels (a 1x1x1 head).
  features: widths per level, finest first. Down-sampling with kernel == stride gives every coarse site at
  least one fine input, so the coarse capacity never needs to exceed the fine one (no overflow possible).
  """

  features: tuple[int, ...] = (16, 32, 64)
  out_features: int = 1
  norm: str | None = "group"

  @nn.compact
  def __call__(self, x: SparseTensor, train: bool = True) -> SparseTensor:
    from jsparse.nn.sparse_conv_layers import SparseConv3d, SparseInverseConv3d
    from jsparse.sparse_conv import concat

    features = level_widths(type(self).__name__, self.features)
    common = dict(dtype=self.dtype, param_dtype=self.param_dtype, implementation=self.implementation)
    block = lambda f, name: SparseResNetBlock(f, norm=self.norm, num_groups=self.num_groups,
                                              activation=self.activation, name=name, **common)
    act = lambda t: norm.activation(t, self.activation)
    h = act(SubMConv3d(features[0], name="stem", **common)(x))
    skips = []
    for level, width in enumerate(features[1:]):
      h = block(features[level], f"down_block{level}")(h, train)
      skips.append(h)
      # padding 0 (spconv's k2 s2 down-sampling); "SAME" differs only on odd extents, where it keeps the last slice.
      h = act(SparseConv3d(width, kernel_size=2, strides=2, padding="VALID", out_capacity=h.capacity,
                           name=f"down{level}", **common)(h))
    h = block(features[-1], "bottom")(h, train)
    for level in reversed(range(len(features) - 1)):
      skip = skips[level]
      h = act(SparseInverseConv3d(features[level], kernel_size=2, strides=2, padding="VALID",
                                  name=f"up{level}", **common)(h, like=skip))
      h = block(features[level], f"up_block{level}")(concat(h, skip), train)
    return SubMConv3d(self.out_features, kernel_size=1, name="head", **common)(h)
