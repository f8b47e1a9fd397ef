"""The differentiable map-GEMM every convolution runs: out[i] = sum_v feats[nbr[i, v]] @ W_v (+ bias).

`map_gemm(feats, weight, bias, maps, spec)` is the one op behind submconv3d and the strided, inverse and
transposed convolutions (each of those only builds its maps). This module owns what happens inside: the
validated arguments (`ConvSpec`), the choice of a config per pass (`choose`: a tuned table entry, else the
heuristic), the plans those configs need, what the tuner records, and the custom_vjp. How one pass runs for a
config is `run_pass`, which the tuner and benchmarks/kernels.py call too.

The Pallas path is three bilinear GEMMs over one map, each a custom_vjp whose backward is the other two (and
itself), so gradients of any order run the same kernels:
  forward       y = F(x, W)      y[i] = sum_v x[nbr[i, v]] @ W_v (+ bias)
  input grad   dx = T(g, W)     dx[j] = sum_v g[t[j, v]] @ W_v^T  (t: the transposed map, t[j, v] = i iff nbr[i, v] = j)
  weight grad  dW = G(x, g)   dW_v = sum_i x[nbr[i, v]]^T g[i]
with vjp F = (T(h, W), G(x, h)), vjp T = (F(h, W), G(h, g)), vjp G = (T(g, H), F(x, H)). A submanifold map is
its own transpose with the offsets reversed (nbr[j, V-1-v] = i iff nbr[i, v] = j), so its input gradient reads
nbr itself with W_{V-1-v}^T at offset v (`RunOptions.input_grad_flips`): no transposed copy is made.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from jsparse import dispatch, tuning
from jsparse._types import PrecisionLike
from jsparse.gemm_xla import XlaPasses, before_next_layer, map_gemm_xla
from jsparse.pass_config import (PASSES, PassConfig, PassInputs, RunOptions, ShapeKey, check_algorithm, check_pass,
                                 heuristic)
from jsparse.size_errors import SizeError, WeightShape
from jsparse.sparsity import as_dense_weight
from pallas_kernels import gemm_plan
from pallas_kernels.weight_layout import WeightLayout

__all__ = ["map_gemm", "ConvSpec", "ConvMaps", "check_weight", "check_groups", "choose", "configs", "with_plans",
           "run_pass", "recording", "is_recording", "ConvCall"]


# ---- validated arguments -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ConvSpec:
  """A convolution's static arguments, validated once by the public op and passed down.

  kernel_size, dilation: 3 ints each (checked by the op: submanifold kernels are odd).
  implementation: the resolved `dispatch.Implementation`. weight_layout: a WeightLayout.
  precision: for float32, None (see `tiling.dot_precision`) / "tf32" / "highest" or a lax.Precision. algorithm: one of
  pass_config.ALGORITHMS ("auto" lets `choose` decide per pass). groups: feature_group_count (input and
  output channels split into that many groups, group j's outputs reading only group j's inputs).
  """

  kernel_size: tuple[int, int, int]
  dilation: tuple[int, int, int]
  implementation: dispatch.Implementation
  weight_layout: WeightLayout = WeightLayout.DHWIO
  precision: Any = None
  algorithm: str = "auto"
  groups: int = 1

  @classmethod
  def build(cls, kernel_size, dilation, implementation: str | None, weight_layout, precision: PrecisionLike = None,
            algorithm: str = "auto", groups: int = 1) -> "ConvSpec":
    """A spec from the op's arguments (kernel_size and dilation already checked by the op, groups by
    `check_weight`): resolves the implementation and the layout and checks the algorithm."""
    return cls(tuple(kernel_size), tuple(dilation), dispatch.resolve(implementation),
               WeightLayout.of(weight_layout), precision, check_algorithm(algorithm), check_groups(groups))


def check_groups(groups) -> int:
  """`groups` (feature_group_count) as a Python int if it is a positive integer (numpy ones included, as every
  other size), else ValueError naming the argument."""
  if isinstance(groups, (bool, np.bool_)) or not isinstance(groups, (int, np.integer)) or groups < 1:
    raise ValueError(f"feature_group_count must be a positive int, got {groups!r}")
  return int(groups)


def _check_real(name: str, value: jax.Array) -> None:
  # The cast to the features' dtype would drop a complex value's imaginary part without a word.
  if not (jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)):
    raise TypeError(f"{name} must be real (floating point or integer), got dtype {value.dtype}")


def check_weight(num_channels: int, dtype, weight, bias, weight_layout: WeightLayout, groups: int = 1):
  """Validates a 5-D weight in `weight_layout` and a (Cout,) bias against features of `num_channels` channels
  split into `groups` feature groups (the weight's input-channel extent is num_channels / groups, as
  lax.conv_general_dilated's feature_group_count); returns (kernel_size, the weight with its kernel axes
  flattened, in `dtype`, the bias in `dtype` or None). A `jsparse.sparsity.Compressed2to4` weight is
  decompressed (the dense path runs on it)."""
  groups = check_groups(groups)
  weight = as_dense_weight(weight, weight_layout)
  _check_real("weight", weight)
  if weight.ndim != 5:
    raise ValueError(f"weight must be {weight_layout.describe()} (weight_layout={weight_layout.value!r}), got "
                     f"shape {weight.shape}")
  # The shape as a 2D or 1D op quotes it: without the kernel axes it lifted (jsparse.size_errors).
  shape = WeightShape(tuple(weight.shape), weight_layout)
  if 0 in weight.shape:
    raise SizeError("weight must have nonzero kernel sizes and channel counts, got shape {shape}", shape=shape)
  kernel_size, cin, cout = weight_layout.split_shape(weight.shape)
  if groups > 1 and num_channels % groups:
    raise ValueError(f"feature_group_count={groups} must divide the input channels ({num_channels})")
  if groups > 1 and cout % groups:
    raise SizeError(f"feature_group_count={groups} must divide the output channels ({cout}, weight shape "
                    f"{{shape}}, weight_layout={weight_layout.value!r})", shape=shape)
  if cin * groups != num_channels:
    per_group = f" / feature_group_count={groups} = {num_channels // groups}" if groups > 1 else ""
    raise SizeError(f"weight expects {cin} input channels but the features have {num_channels}{per_group} "
                    f"(weight shape {{shape}}, weight_layout={weight_layout.value!r})", shape=shape)
  if bias is not None:
    bias = jnp.asarray(bias)
    _check_real("bias", bias)
    if bias.shape != (cout,):
      raise ValueError(f"bias must have shape ({cout},), got {bias.shape}")
    bias = bias.astype(dtype)
  return kernel_size, weight_layout.flatten(weight).astype(dtype), bias


# ---- maps ------------------------------------------------------------------------------------------------


class ConvMaps(NamedTuple):
  """The integer arrays a map-GEMM reads (no gradients flow into them).

  nbr: int32 [M, V], the input row output i reads at offset v, or -1; num: valid output rows.
  transposed: int32 [rows of feats, V] with transposed[j, v] = i iff nbr[i, v] = j (a strided convolution's
    `inv`), the input gradient's map, and num_in the valid input rows; None for a submanifold map, which is its
    own transpose with the offsets reversed (`input_grad_flips`).
  plans: {block_m: MaskedPlan} already built for nbr; pairs: PairLists already built (else built on demand).
  classes, transposed_classes: uint8 [rows] classes of nbr's / transposed's rows for their plans' row order
    (`gemm_plan.masked_plan(row_classes=...)`), or None (order by neighbour masks).
  """

  nbr: jax.Array
  num: jax.Array
  transposed: jax.Array | None = None
  num_in: jax.Array | None = None
  plans: dict | None = None
  pairs: gemm_plan.PairLists | None = None
  classes: jax.Array | None = None
  transposed_classes: jax.Array | None = None

  def plan(self, block_m: int, interpret: bool = False) -> gemm_plan.MaskedPlan:
    """The forward's masked plan for blocks of block_m rows (built, where missing, by the plan kernel, run in
    Pallas' interpret mode if asked)."""
    if self.plans and block_m in self.plans:
      return self.plans[block_m]
    # Another block size's plan has the rows' order already (it does not depend on block_m): no second sort.
    order = next(iter(self.plans.values())).order if self.plans else None
    return gemm_plan.masked_plan(self.nbr, self.num, block_m, row_classes=self.classes, order=order,
                                 interpret=interpret)

  def input_grad_map(self) -> tuple[jax.Array, jax.Array]:
    """(map, valid rows) the input gradient runs over: the transposed map, or a submanifold map itself."""
    return (self.nbr, self.num) if self.transposed is None else (self.transposed, self.num_in)

  @property
  def input_grad_flips(self) -> bool:
    """Whether the input gradient reads offset v of its map with W_{V-1-v} (a submanifold map, which is its own
    transpose with the offsets reversed) rather than W_v (a transposed map)."""
    return self.transposed is None

  def input_grad_plan(self, block_m: int, interpret: bool = False) -> gemm_plan.MaskedPlan:
    """The input gradient's masked plan (over the transposed map; a submanifold map's own plan)."""
    if self.transposed is None:
      return self.plan(block_m, interpret)
    return gemm_plan.masked_plan(self.transposed, self.num_in, block_m, row_classes=self.transposed_classes,
                                 interpret=interpret)

  def pair_lists(self, interpret: bool = False) -> gemm_plan.PairLists:
    """The weight gradient's pair lists (mirrored, half the offsets, for a submanifold map; built, where missing,
    by the pair-list kernels, run in Pallas' interpret mode if asked).

    A submanifold map's lists are read from its plan when it has one (the smallest block size's): the backward
    pass keeps that plan for the input gradient, and lists read from it free the map after the forward pass
    (on SECOND's ~1M-voxel training step the map and plan were each 121 MiB at the first level, both live at
    the peak). Where a tuned input gradient runs on another block size, both plans are kept, as the map and
    the plan were before."""
    if self.pairs is not None:
      return self.pairs
    if self.transposed is None and self.plans:
      return gemm_plan.pair_lists_from_plan(self.plans[min(self.plans)], mirrored=True, interpret=interpret)
    return gemm_plan.pair_lists(self.nbr, mirrored=self.transposed is None, interpret=interpret)


# ---- choosing configs, recording for the tuner ---------------------------------------------------------------


def choose(pass_name: str, num_rows: int, cin: int, cout: int, num_offsets: int, dtype,
           algorithm: str = "auto", groups: int = 1) -> PassConfig:
  """The config for one pass (cin, cout: the convolution's whole channel counts, split into `groups`): with
  algorithm "auto" a tuned entry if an active table has one for this shape, else (or for a named algorithm)
  `pass_config.heuristic`."""
  check_pass(pass_name)
  if algorithm == "auto":
    cfg = tuning.lookup(ShapeKey.of(pass_name, num_rows, cin, cout, num_offsets, dtype, groups))
    if cfg is not None:
      return cfg
  return heuristic(pass_name, num_rows, cin, cout, num_offsets, jnp.dtype(dtype), algorithm, groups=groups)


class ConvCall(NamedTuple):
  """What one Pallas map-GEMM reported while `recording`: its shapes, maps and options."""

  num_rows: int
  cin: int
  cout: int
  num_offsets: int
  dtype: jnp.dtype
  maps: ConvMaps
  precision: object
  weight_layout: WeightLayout
  groups: int = 1


_RECORD: contextvars.ContextVar[tuple[list, list | None] | None] = contextvars.ContextVar("jsparse_record",
                                                                                          default=None)


@contextlib.contextmanager
def recording(into: list, traced: list | None = None):
  """Appends a ConvCall to `into` for every Pallas map-GEMM run eagerly inside the block (used by autotune), and
  to `traced` (if given) the shapes (rows, cin, cout, offsets) of those that ran traced (e.g. under
  jax.checkpoint, which traces even under jax.disable_jit), whose maps have no values to tune with."""
  token = _RECORD.set((into, traced))
  try:
    yield into
  finally:
    _RECORD.reset(token)


def is_recording() -> bool:
  """Whether a `recording` block is open here (autotune records eager calls' concrete maps)."""
  return _RECORD.get() is not None


def _record(call: ConvCall) -> None:
  lists = _RECORD.get()
  if lists is None:
    return
  calls, traced = lists
  if not isinstance(call.maps.nbr, jax.core.Tracer):
    calls.append(call)
  elif traced is not None:
    traced.append((call.num_rows, call.cin, call.cout, call.num_offsets))


# ---- the op ------------------------------------------------------------------------------------------------


def run_pass(pass_name: str, cfg: PassConfig, inputs: PassInputs, options: RunOptions):
  """One pass as the convolution runs it (see pass_config.PassInputs for what each pass reads)."""
  return cfg.run(pass_name, inputs, options)


def configs(feats: jax.Array, weight: jax.Array, maps: ConvMaps, spec: ConvSpec) -> tuple[PassConfig, ...]:
  """The config of each pass (forward, input_grad, weight_grad) of the Pallas map-GEMM of these arguments."""
  m, v = maps.nbr.shape
  _, _, cout = spec.weight_layout.flat_dims(weight)
  cin, groups = feats.shape[1], spec.groups  # the whole input width (the weight holds one group's)
  return (choose("forward", m, cin, cout, v, feats.dtype, spec.algorithm, groups),
          choose("input_grad", feats.shape[0], cin, cout, v, feats.dtype, spec.algorithm, groups),
          choose("weight_grad", m, cin, cout, v, feats.dtype, spec.algorithm, groups))


def with_plans(feats: jax.Array, weight: jax.Array, maps: ConvMaps, spec: ConvSpec) -> ConvMaps:
  """`maps` holding every masked plan over `maps.nbr` that map_gemm(feats, weight, ., maps, spec) reads (built
  now where missing), so a caller that keeps them with the map (a NeighborCache) builds each plan once."""
  if not spec.implementation.is_pallas:
    return maps
  fwd, input_grad, _ = configs(feats, weight, maps, spec)
  wanted = [fwd] + ([input_grad] if maps.transposed is None else [])  # a submanifold map is its own transpose
  plans = dict(maps.plans or {})
  for cfg in wanted:
    if cfg.uses_plan and cfg.tiles.block_m not in plans:
      plans[cfg.tiles.block_m] = maps.plan(cfg.tiles.block_m, spec.implementation.interpret)
  return maps._replace(plans=plans)


def map_gemm(feats: jax.Array, weight: jax.Array, bias: jax.Array | None, maps: ConvMaps,
             spec: ConvSpec) -> jax.Array:
  """out[i] = sum_v feats[nbr[i, v]] @ W_v (+ bias) for i < maps.num, zero rows after; differentiable in
  feats, weight and bias (any order on the Pallas path).

  weight: flattened in spec.weight_layout ([V, Cin/groups, Cout] or [Cout, V, Cin/groups]) and in feats' dtype;
  bias (Cout,) or None. With spec.groups > 1, output channel block j (of Cout/groups) reads input channel
  block j only. XLA: gather + one matmul per pass (`gemm_xla.map_gemm_xla`: the input gradient over the
  input-gradient map, as on the Pallas path). Pallas: the configs `choose` picks per pass.
  """
  layout = spec.weight_layout
  if not spec.implementation.is_pallas:
    # Its custom_vjp keeps the inputs, not the gathered [rows, V x Cin] operand (V times its input): the backward
    # gathers again.
    options = XlaPasses(spec.precision, layout, spec.groups, maps.input_grad_flips)
    return map_gemm_xla(feats, weight, bias, maps.nbr, maps.num, *maps.input_grad_map(), options)
  m, v = maps.nbr.shape
  _, _, cout = layout.flat_dims(weight)
  _record(ConvCall(m, feats.shape[1], cout, v, jnp.dtype(feats.dtype), maps, spec.precision, layout, spec.groups))
  cfgs = configs(feats, weight, maps, spec)
  interpret = spec.implementation.interpret
  arrays = _PassArrays(maps.nbr, maps.num, *maps.input_grad_map(),
                       maps.plan(cfgs[0].tiles.block_m, interpret) if cfgs[0].uses_plan else None,
                       maps.input_grad_plan(cfgs[1].tiles.block_m, interpret) if cfgs[1].uses_plan else None,
                       maps.pair_lists(interpret) if cfgs[2].uses_plan else None)
  options = _Options(cfgs, RunOptions(spec.precision, spec.implementation.interpret, layout, spec.groups,
                                      maps.input_grad_flips))
  return _forward(feats, weight, bias, arrays, options)


class _PassArrays(NamedTuple):
  """The maps and the plans the chosen configs need, carried through the custom_vjp."""

  nbr: jax.Array
  num: jax.Array
  input_grad_nbr: jax.Array
  input_grad_num: jax.Array
  forward_plan: Any
  input_grad_plan: Any
  pairs: Any

  def inputs(self, pass_name: str, lhs, rhs, bias=None) -> PassInputs:
    if pass_name == "forward":
      return PassInputs(lhs, rhs, self.nbr, self.num, bias, plan=self.forward_plan)
    if pass_name == "input_grad":
      return PassInputs(lhs, rhs, self.input_grad_nbr, self.input_grad_num, plan=self.input_grad_plan)
    return PassInputs(lhs, rhs, self.nbr, self.num, pairs=self.pairs)


class _Options(NamedTuple):
  """Static options (hashable, for custom_vjp's nondiff_argnums): a config per pass and how to run them."""

  configs: tuple
  run: RunOptions

  def run_pass(self, pass_name: str, inputs: PassInputs):
    return run_pass(pass_name, self.configs[PASSES.index(pass_name)], inputs, self.run)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _forward(feats, w, bias, arrays: _PassArrays, opts: _Options):
  return opts.run_pass("forward", arrays.inputs("forward", feats, w, bias))


def _forward_fwd(feats, w, bias, arrays, opts):
  return _forward(feats, w, bias, arrays, opts), (feats, w, bias, arrays)


def _forward_bwd(opts, residuals, g):
  feats, w, bias, arrays = residuals
  # Outputs at padding rows are constant zeros, so g there must not count: the maps never point at padding
  # rows and never list them, and the bias gradient masks them.
  d_feats = _input_grad(g, w, arrays, opts)
  d_w = _weight_grad(feats, g, arrays, opts).astype(w.dtype)
  if opts.configs[PASSES.index("weight_grad")].kind == "explicit":  # it gathers its operand into memory
    d_feats, d_w = before_next_layer(d_feats, d_w)
  d_bias = None
  if bias is not None:
    valid = jnp.arange(g.shape[0]) < arrays.num
    d_bias = jnp.sum(jnp.where(valid[:, None], g, 0), axis=0, dtype=jnp.float32).astype(bias.dtype)
  return d_feats, d_w, d_bias, None


_forward.defvjp(_forward_fwd, _forward_bwd)


def _bilinear_pass(pass_name: str, backward):
  """A custom_vjp op f(a, b, arrays, opts) running `pass_name`, whose vjp is backward(opts, a, b, arrays, ct)."""

  @functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
  def op(a, b, arrays: _PassArrays, opts: _Options):
    return opts.run_pass(pass_name, arrays.inputs(pass_name, a, b))

  def op_fwd(a, b, arrays, opts):
    return op(a, b, arrays, opts), (a, b, arrays)

  op.defvjp(op_fwd, lambda opts, residuals, ct: backward(opts, *residuals, ct))
  return op


def _input_grad_bwd(opts, g, w, arrays, h):
  return _forward(h, w, None, arrays, opts), _weight_grad(h, g, arrays, opts).astype(w.dtype), None


def _weight_grad_bwd(opts, feats, g, arrays, d_w):
  d_feats = _input_grad(g, d_w.astype(feats.dtype), arrays, opts)
  d_g = _forward(feats, d_w.astype(feats.dtype), None, arrays, opts).astype(g.dtype)
  return d_feats, d_g, None


# T(g, W): the input gradient for the output gradient g, [rows of feats, Cin].
_input_grad = _bilinear_pass("input_grad", _input_grad_bwd)
# G(x, g): the weight gradient, in the flattened weight's layout and feats' dtype.
_weight_grad = _bilinear_pass("weight_grad", _weight_grad_bwd)
