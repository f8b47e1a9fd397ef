"""2:4 structured-sparse convolution weights: pruning, masks, checks, compression, and fixed-mask training.

A 2:4 weight keeps at most two non-zeros in every group of four consecutive elements along the reduction axis
of the convolution's GEMM. In the swapped-operand form of the forward GEMM, out^T = W^T gather(x)^T, the
weight is the MMA's left operand A, of shape [Cout, V * Cin] (V kernel offsets), and the sparse tensor-core
instructions (`mma.sp` / `wgmma.sp`) need A sparse along its reduction axis, the flattened (offset, Cin) axis
with Cin fastest. That axis reads the same from both weight layouts: "DHWIO" (*kernel, Cin, Cout) and "ODHWI"
(Cout, *kernel, Cin) both flatten to (offset, Cin) per output channel.

Two groupings are offered (`axis`):
- "cin" (default, what a gather-fused sparse kernel needs): groups of 4 consecutive input channels within one
  kernel offset; requires Cin % 4 == 0. The implicit GEMM gathers each offset's K slice from a different
  neighbour row (or masks it whole when the neighbour is missing), so a group must never straddle two offsets.
- "flat": groups of 4 over the flattened offset x Cin axis; requires V * Cin % 4 == 0. When Cin % 4 == 0 the
  groups are exactly those of "cin" (the same masks and values); it differs only for layers such as a
  2x2x2 strided convolution on 1 to 3 channels, whose groups then straddle offsets: usable by a kernel that
  materialises the gather (explicit GEMM), not by the gather-fused one.

Compressed format (`Compressed2to4`), the A operand in row-major order, one row per output channel:
- values: the two kept elements of every group in increasing position order, in the weight's dtype;
  [Cout, V, Cin // 2] for axis="cin", [Cout, V * Cin // 2] for axis="flat" (the same bytes when both apply).
- metadata: uint16 words, [Cout, V, ceil(Cin / 16)] for "cin" (each offset starts a new word, so a kernel's
  K block of one offset reads whole words), [Cout, ceil(V * Cin / 16)] for "flat". Word w of a row describes
  groups 4w .. 4w + 3 of that row (16 dense elements): group j of the word sits in bits 4j .. 4j + 3, its
  lower kept position in the low two bits and its higher kept position in the high two bits (positions
  0 to 3 within the group, lower < higher). This is the per-row bit order of the f16/bf16 `mma.sp`
  metadata: m16n8k16 consumes one word per row, m16n8k32 two consecutive words read as one little-endian
  uint32. Groups that pad a row's last word read positions (0, 1) (nibble 0x4) over zero values. Which
  threads of a warp hold which rows' words (the sparsity selector) is the kernel's business when it loads
  them; cuSPARSELt and CUTLASS additionally interleave these nibbles per tile, which this format does not.
- A group with fewer than two non-zeros stores zeros at the positions it keeps (the lowest free ones).

Training with a fixed mask (NVIDIA ASP's recipe: prune a trained network, then fine-tune with the mask held):
`masks_2to4(params)` builds masks for a flax parameter tree, `apply_masks(params, masks)` prunes (use it on the
parameters once, and inside the loss so the forward sees the masked weight), and `keep_2to4(optimizer, masks)`
wraps an optax optimizer so that pruned entries receive exactly zero updates. The convolution modules'
`kernel_sparsity="2:4"` option instead prunes each kernel in the forward (`prune_2to4` of the stored values).

The convolutions (`jsparse.submconv3d`, `jsparse.sparse_conv3d`, `jsparse.sparse_inverse_conv3d`,
`jsparse.sparse_conv_transpose3d` and their 2D / 1D forms) accept a `Compressed2to4` as their weight. Inside a
`jsparse.sparse24.native_2to4()` block (opt-in: the kernel is slower than the dense one), on a GPU, with float16 /
bfloat16 features, an axis="cin" weight, Cin % 32 == 0 and Cout % 16 == 0, the 3D forms run their
forward on a native sparse tensor-core kernel (`mma.sp`, CUDA C++ compiled with nvcc on first use, reached
through jax.ffi; `jsparse.sparse24` says when and how); everywhere else they decompress the weight and run the
dense path. Gradients always come from the dense path. `native_status()` says whether the native kernel is
available here, and why not.
"""
from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Any, Callable, Literal

import jax
import jax.numpy as jnp
import numpy as np

from jsparse.eager import host_check
from jsparse._types import ArrayLike
from jsparse.sparse_tensor import report
from pallas_kernels.weight_layout import WeightLayout

if TYPE_CHECKING:  # optax (a dependency of flax) is imported when keep_2to4 is called, not with jsparse
  import optax

__all__ = ["Compressed2to4", "prune_2to4", "mask_2to4", "is_2to4", "compress_2to4", "decompress_2to4",
           "as_dense_weight", "masks_2to4", "apply_masks", "keep_2to4", "native_status"]

Axis = Literal["cin", "flat"]
AXES = ("cin", "flat")
GROUP = 4          # elements per group along the reduction axis
KEPT = 2           # non-zeros a group may hold
GROUPS_PER_WORD = 4  # 4-bit group descriptors per uint16 metadata word
PAD_NIBBLE = 0b0100  # positions (0, 1): the descriptor of an all-zero padding group


def _layout_dims(shape: tuple[int, ...], layout: WeightLayout) -> tuple[int, int, int]:
  """(V, Cin, Cout) of a weight of `shape` in `layout`; any number (>= 0) of kernel axes."""
  if layout.cout_major:
    return math.prod(shape[1:-1]), shape[-1], shape[0]
  return math.prod(shape[:-2]), shape[-2], shape[-1]


def _check_weight_shape(shape: tuple[int, ...], layout: WeightLayout, axis: str, what: str = "weight"):
  """Validates the axis name and the divisibility it needs; returns (V, Cin, Cout)."""
  if axis not in AXES:
    raise ValueError(f"axis must be one of {AXES}, got {axis!r}")
  if len(shape) < 2:
    raise ValueError(f"{what} must have at least 2 axes ({layout.describe()} for a 3D convolution in "
                     f"weight_layout={layout.value!r}), got shape {shape}")
  v, cin, cout = _layout_dims(shape, layout)
  if axis == "cin" and cin % GROUP:
    raise ValueError(f"{what}: axis='cin' groups {GROUP} consecutive input channels per kernel offset, but Cin="
                     f"{cin} (shape {shape}, weight_layout={layout.value!r}) is not a multiple of {GROUP}")
  if axis == "flat" and (v * cin) % GROUP:
    raise ValueError(f"{what}: axis='flat' groups {GROUP} consecutive elements of the offset x Cin axis, but "
                     f"V * Cin = {v} * {cin} (shape {shape}, weight_layout={layout.value!r}) is not a multiple "
                     f"of {GROUP}")
  return v, cin, cout


def _groups(weight: jax.Array, layout: WeightLayout) -> jax.Array:
  """The weight as the MMA's A operand cut into groups: [Cout, V * Cin // 4, 4] (Cin fastest)."""
  v, cin, cout = _layout_dims(weight.shape, layout)
  rows = weight.reshape(cout, v * cin) if layout.cout_major else weight.reshape(v * cin, cout).T
  return rows.reshape(cout, v * cin // GROUP, GROUP)


def _ungroup(groups: jax.Array, shape: tuple[int, ...], layout: WeightLayout) -> jax.Array:
  """The inverse of `_groups`: a weight of `shape` in `layout`."""
  cout = groups.shape[0]
  rows = groups.reshape(cout, -1)
  return rows.reshape(shape) if layout.cout_major else rows.T.reshape(shape)


def _group_keep(groups: jax.Array) -> jax.Array:
  """bool [..., 4]: the two largest |w| of each group, ties to the lower position; NaN ranks as the largest.

  |w| is compared exactly: in float32 or wider (a float32 cast tied float64 weights 1 + 1e-10 and 1 + 2e-10, and
  int weights past 2**24), and for integers as the unsigned magnitude (|int32 min| does not fit int32)."""
  if jnp.issubdtype(groups.dtype, jnp.inexact):
    mag = jnp.abs(groups.astype(jnp.promote_types(groups.dtype, jnp.float32)))
    mag = jnp.where(jnp.isnan(mag), jnp.inf, mag)
  elif jnp.issubdtype(groups.dtype, jnp.signedinteger):
    unsigned = groups.astype(jnp.dtype(f"uint{jnp.iinfo(groups.dtype).bits}"))
    mag = jnp.where(groups < 0, -unsigned, unsigned)  # modular negation: exact, int min included
  else:
    mag = groups.astype(jnp.uint8) if groups.dtype == jnp.bool_ else groups
  a, b = mag[..., :, None], mag[..., None, :]  # a: element i, b: element j
  lower = jnp.arange(GROUP)[None, :] < jnp.arange(GROUP)[:, None]  # [i, j]: j sits before i
  rank = jnp.sum((b > a) | ((b == a) & lower), axis=-1)  # elements that beat element i
  return rank < KEPT


def mask_2to4(weight: ArrayLike, *, weight_layout: WeightLayout | str = "DHWIO", axis: Axis = "cin") -> jax.Array:
  """bool array of weight's shape: True at the two largest-magnitude elements of every group of 4 along the
  reduction axis (see the module docstring for `axis`); ties go to the lower position (lower Cin), NaN counts as
  the largest magnitude.

  weight: (*kernel, Cin, Cout) for weight_layout="DHWIO" or (Cout, *kernel, Cin) for "ODHWI", any number of
  kernel axes (3D, 2D, 1D convolutions; none for a dense (Cin, Cout) kernel).
  ValueError naming `weight` when the grouped axis is not a multiple of 4.
  """
  layout = WeightLayout.of(weight_layout)
  weight = jnp.asarray(weight)
  _check_weight_shape(weight.shape, layout, axis)
  return _ungroup(_group_keep(_groups(weight, layout)), weight.shape, layout)


def prune_2to4(weight: ArrayLike, *, weight_layout: WeightLayout | str = "DHWIO", axis: Axis = "cin") -> jax.Array:
  """Magnitude 2:4 pruning: weight with all but the two largest |w| of every group of 4 along the reduction
  axis set to zero (`mask_2to4` picks them). Same shape and dtype; differentiable (gradient zero where pruned)."""
  weight = jnp.asarray(weight)
  mask = mask_2to4(weight, weight_layout=weight_layout, axis=axis)
  return jnp.where(mask, weight, jnp.zeros((), weight.dtype))


def is_2to4(weight: ArrayLike, *, weight_layout: WeightLayout | str = "DHWIO", axis: Axis = "cin") -> jax.Array:
  """A bool scalar: every group of 4 along the reduction axis holds at most two non-zeros (NaN counts as
  non-zero). ValueError naming `weight` when the grouped axis is not a multiple of 4."""
  layout = WeightLayout.of(weight_layout)
  weight = jnp.asarray(weight)
  _check_weight_shape(weight.shape, layout, axis)
  return jnp.all(jnp.sum(_groups(weight, layout) != 0, axis=-1) <= KEPT)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Compressed2to4:
  """A 2:4 weight as the sparse MMA stores it (layout in the module docstring); a pytree whose leaves are
  `values` and `metadata` (uint16: differentiate with respect to `values`, or pass allow_int=True).

  values: the kept elements, [Cout, V, Cin // 2] (axis "cin") or [Cout, V * Cin // 2] (axis "flat").
  metadata: uint16 position words, [Cout, V, ceil(Cin / 16)] or [Cout, ceil(V * Cin / 16)].
  shape: the dense weight's shape; layout: its WeightLayout; axis: "cin" or "flat".
  Build one with `compress_2to4`; `decompress_2to4` (or `todense`) gives the dense weight back exactly.
  """

  values: jax.Array
  metadata: jax.Array
  shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
  layout: WeightLayout = dataclasses.field(metadata=dict(static=True))
  axis: str = dataclasses.field(default="cin", metadata=dict(static=True))

  @property
  def dtype(self):
    """The weight's dtype (that of `values`)."""
    return self.values.dtype

  def todense(self) -> jax.Array:
    """The dense weight (`decompress_2to4`)."""
    return decompress_2to4(self)


def _compressed_shapes(shape: tuple[int, ...], layout: WeightLayout, axis: str):
  """(values shape, metadata shape, groups per metadata row segment) of a weight of `shape`."""
  v, cin, cout = _layout_dims(shape, layout)
  if axis == "cin":
    words = -(-(cin // GROUP) // GROUPS_PER_WORD)
    return (cout, v, cin // 2), (cout, v, words), cin // GROUP
  words = -(-(v * cin // GROUP) // GROUPS_PER_WORD)
  return (cout, v * cin // 2), (cout, words), v * cin // GROUP


def compress_2to4(weight: ArrayLike, *, weight_layout: WeightLayout | str = "DHWIO",
                  axis: Axis = "cin") -> Compressed2to4:
  """The 2:4 weight as kept values and packed 2-bit positions (a `Compressed2to4`, format in the module
  docstring). The weight must be 2:4 along `axis` (`prune_2to4` makes it so): ValueError naming `weight`
  otherwise when the weight is concrete. Under jit the two largest of each group are kept, and inside
  `jsparse.error_checks()` a group with more non-zeros is reported to `jax.experimental.checkify`.
  `decompress_2to4` returns it exactly, dtype included."""
  layout = WeightLayout.of(weight_layout)
  weight = jnp.asarray(weight)
  _check_weight_shape(weight.shape, layout, axis)
  groups = _groups(weight, layout)  # [Cout, G, 4]
  crowded = jnp.sum(jnp.sum(groups != 0, axis=-1) > KEPT)
  report(crowded > 0, f"compress_2to4: weight is not 2:4 along axis={axis!r} ({{groups}} groups of 4 hold more "
         f"than 2 non-zeros; prune it with jsparse.sparsity.prune_2to4 first)", groups=crowded)
  keep = _group_keep(groups)
  first = jnp.argmax(keep, axis=-1)                      # lower kept position
  second = GROUP - 1 - jnp.argmax(keep[..., ::-1], axis=-1)  # higher kept position
  pair = jnp.stack([first, second], axis=-1)
  values = jnp.take_along_axis(groups, pair, axis=-1)  # [Cout, G, 2]
  nibbles = (first | (second << 2)).astype(jnp.uint32)  # [Cout, G]
  values_shape, meta_shape, segment = _compressed_shapes(weight.shape, layout, axis)
  nibbles = nibbles.reshape(meta_shape[:-1] + (segment,))
  pad = meta_shape[-1] * GROUPS_PER_WORD - segment
  nibbles = jnp.pad(nibbles, [(0, 0)] * (nibbles.ndim - 1) + [(0, pad)], constant_values=PAD_NIBBLE)
  nibbles = nibbles.reshape(meta_shape + (GROUPS_PER_WORD,))
  shifts = jnp.arange(GROUPS_PER_WORD, dtype=jnp.uint32) * 4
  words = jnp.sum(nibbles << shifts, axis=-1).astype(jnp.uint16)  # disjoint bits: the sum is an OR
  return Compressed2to4(values.reshape(values_shape), words, tuple(weight.shape), layout, axis)


def decompress_2to4(compressed: Compressed2to4) -> jax.Array:
  """The dense weight of a `Compressed2to4` (its `shape`, `layout` and dtype), zeros where pruned; exact, and
  differentiable with respect to `compressed.values`. Concrete metadata with a group descriptor whose kept
  positions are not increasing raises ValueError naming `compressed.metadata` (under jit it is not checked)."""
  if not isinstance(compressed, Compressed2to4):
    raise TypeError(f"compressed must be a Compressed2to4, got {type(compressed).__name__}")
  layout = WeightLayout.of(compressed.layout, "compressed.layout")
  shape = tuple(compressed.shape)
  _check_weight_shape(shape, layout, compressed.axis, "compressed.shape")
  values_shape, meta_shape, segment = _compressed_shapes(shape, layout, compressed.axis)
  if tuple(compressed.values.shape) != values_shape:
    raise ValueError(f"compressed.values must have shape {values_shape} for a weight of shape {shape} "
                     f"(axis={compressed.axis!r}), got {tuple(compressed.values.shape)}")
  if tuple(compressed.metadata.shape) != meta_shape or compressed.metadata.dtype != jnp.uint16:
    raise ValueError(f"compressed.metadata must be uint16 of shape {meta_shape}, got "
                     f"{compressed.metadata.dtype} {tuple(compressed.metadata.shape)}")
  words = compressed.metadata.astype(jnp.uint32)[..., None]
  nibbles = (words >> (jnp.arange(GROUPS_PER_WORD, dtype=jnp.uint32) * 4)) & 0xF
  nibbles = nibbles.reshape(meta_shape[:-1] + (-1,))[..., :segment]
  cout = values_shape[0]
  nibbles = nibbles.reshape(cout, -1, 1)  # [Cout, G, 1]
  first, second = nibbles & 3, nibbles >> 2
  host_check("compressed.metadata", compressed.metadata)
  if not isinstance(compressed.metadata, jax.core.Tracer) and not bool(jnp.all(first < second)):
    # A nibble with first >= second (e.g. a zeroed word) dropped one of the group's two values, or swapped them.
    group = tuple(int(i) for i in np.argwhere(~np.asarray(first < second))[0][:2])
    raise ValueError(f"compressed.metadata: group {group[1]} of output channel {group[0]} has kept positions "
                     "(lower, higher) that are not increasing; every 4-bit group descriptor must hold lower < "
                     "higher (the format in the jsparse.sparsity docstring)")
  values = compressed.values.reshape(cout, -1, KEPT)
  position = jnp.arange(GROUP, dtype=jnp.uint32)
  zero = jnp.zeros((), values.dtype)
  groups = jnp.where(position == first, values[..., :1], jnp.where(position == second, values[..., 1:], zero))
  return _ungroup(groups, shape, layout)


def as_dense_weight(weight: ArrayLike | Compressed2to4, weight_layout: WeightLayout | str = "DHWIO") -> jax.Array:
  """A convolution's weight argument as a dense array: a `Compressed2to4` decompressed (ValueError naming
  `weight_layout` when the compressed weight was made in another layout), anything else through jnp.asarray."""
  if not isinstance(weight, Compressed2to4):
    return jnp.asarray(weight)
  layout, made_in = WeightLayout.of(weight_layout), WeightLayout.of(weight.layout, "weight.layout")
  if made_in is not layout:
    raise ValueError(f"weight_layout={layout.value!r} but the Compressed2to4 weight was compressed in "
                     f"{made_in.value!r}: pass weight_layout={made_in.value!r}")
  return decompress_2to4(weight)


def native_status() -> tuple[bool, str]:
  """(available, reason): whether convolutions on a `Compressed2to4` weight can run their forward on the native
  2:4 sparse tensor-core kernel here (nvcc found, the kernel built, a CUDA backend), and why not
  (`jsparse.sparse24.native_status`; builds the kernel on first call, never raises). The cuSPARSELt route of
  1x1x1 convolutions has its own query, `jsparse.sparse24.cusparselt_status`."""
  from jsparse import sparse24  # sparse24 imports this module

  return sparse24.native_status()


# ---- training with a fixed mask ----------------------------------------------------------------------------


def _is_conv_kernel(path, leaf) -> bool:
  """The default selection: flax's convolution kernels ("kernel" leaves with kernel axes)."""
  name = getattr(path[-1], "key", getattr(path[-1], "name", None)) if path else None
  return name == "kernel" and getattr(leaf, "ndim", 0) >= 3


def masks_2to4(params: Any, *, weight_layout: WeightLayout | str = "DHWIO", axis: Axis = "cin",
               include: Callable[[tuple, Any], bool] | None = None) -> Any:
  """A mask tree for `params` (same structure): `mask_2to4` of every selected leaf, None for the others.

  include(path, leaf) -> bool selects the leaves to prune (path: jax.tree_util key path). The default selects
  the convolution kernels, leaves named "kernel" with three or more axes, whose grouped axis is a multiple of 4
  (a first layer on 1 to 3 channels stays dense); a leaf `include` selects must fit (ValueError otherwise).
  weight_layout: the layout of the selected kernels ("ODHWI" for modules with kernel_layout="ODHWI").
  """
  layout = WeightLayout.of(weight_layout)
  if axis not in AXES:
    raise ValueError(f"axis must be one of {AXES}, got {axis!r}")

  def fits(leaf) -> bool:
    try:
      _check_weight_shape(tuple(leaf.shape), layout, axis)
    except ValueError:
      return False
    return True

  def mask_of(path, leaf):
    selected = include(path, leaf) if include is not None else (_is_conv_kernel(path, leaf) and fits(leaf))
    return mask_2to4(leaf, weight_layout=layout, axis=axis) if selected else None

  return jax.tree_util.tree_map_with_path(mask_of, params)


def apply_masks(params: Any, masks: Any) -> Any:
  """params with every masked leaf zeroed where its mask is False (leaves whose mask is None unchanged).
  Differentiable: use it on the parameters inside the loss so that the forward sees the pruned weights."""
  def apply(mask, leaf):
    return leaf if mask is None else jnp.where(mask, leaf, jnp.zeros((), leaf.dtype))

  return jax.tree.map(apply, masks, params, is_leaf=lambda m: m is None)


def keep_2to4(inner: optax.GradientTransformation, masks: Any) -> optax.GradientTransformationExtraArgs:
  """`inner` (an optax optimizer) with pruned entries held at zero: the gradients are masked before `inner`
  sees them (its state, e.g. Adam's moments, stays zero there) and its updates after (so weight decay or any
  other term cannot move them), so parameters pruned with `apply_masks` stay exactly 2:4 through training.
  masks: from `masks_2to4` (None leaves are left alone)."""
  import optax

  inner = optax.with_extra_args_support(inner)

  def init(params):
    return inner.init(params)

  def update(updates, state, params=None, **extra_args):
    updates, state = inner.update(apply_masks(updates, masks), state, params, **extra_args)
    return apply_masks(updates, masks), state

  return optax.GradientTransformationExtraArgs(init, update)
