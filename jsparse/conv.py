"""Submanifold sparse convolution: the differentiable op and its implementations."""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from jsparse import autotuning, dispatch, tuning
from jsparse._types import ArrayLike, PrecisionLike, Size3
from jsparse.neighbors import NeighborCache, cache_key, check_dilation, check_kernel_size, neighbor_map
from jsparse.sparse_tensor import SparseTensor, check_same_sites, check_sparse_tensor
from pallas_kernels import gather_gemm as gather_gemm_lib
from pallas_kernels import weight_grad as weight_grad_lib
from pallas_kernels.tiling import dot_precision


# A convolution weight's two layouts: flax / lax's (Kx, Ky, Kz, Cin, Cout), and PyTorch / spconv / FlexGEMM's
# (Cout, Kx, Ky, Kz, Cin); the kernels' names for them, once the kernel axes are flattened into V.
WEIGHT_LAYOUTS = {"DHWIO": "vio", "ODHWI": "ovi"}


def submconv3d(x: SparseTensor, weight: ArrayLike, bias: ArrayLike | None = None, *, dilation: Size3 = 1,
               cache: NeighborCache | None = None, implementation: str | None = None,
               precision: PrecisionLike = None, algorithm: str = "auto",
               weight_layout: str = "DHWIO") -> SparseTensor:
  """Submanifold 3D convolution: a SparseTensor on the same coordinates as `x`.

  At every valid site u: y[u] = sum_i weight[i]^T x[u + (i - centre) * dilation] + bias, summing over the
  kernel positions i whose shifted site is active; this equals
  `lax.conv_general_dilated(x.todense(), weight, (1, 1, 1), "SAME", rhs_dilation=dilation,
  dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))` read at the valid sites.

  weight: (Kx, Ky, Kz, Cin, Cout), odd kernel sizes (flax's layout), or with weight_layout="ODHWI"
    (Cout, Kx, Ky, Kz, Cin) (PyTorch / spconv / FlexGEMM's layout: their checkpoints load without a
    transpose). Both give the same results. On the GPU the forward reads an ODHWI weight in place, where a
    float32 DHWIO forward reads a transposed copy (one layer's weight, live at the inference peak); the input
    gradient is the other way round. bias: (Cout,) or None.
  cache: a NeighborCache for x's coordinates from `neighbor_map(x, kernel_size, dilation)`. If None, the map
    that x carries for this kernel (x.caches, attached by an earlier convolution on these coordinates) is
    used, or a new one is built; the output carries it on, so a stack of layers builds it once.
  implementation: None (Pallas kernels on a GPU, XLA elsewhere), "pallas" or "xla".
  precision: for float32 inputs, None/"tf32" (TF32 matmuls on the GPU) or "highest" (full fp32).
  algorithm (Pallas only): "auto" (chosen per pass), "explicit" (gather, then one matmul), "implicit"
    (gather fused into the GEMM), "masked" (rows sorted so blocks skip unused offsets), or their
    "_splitk" variants (the reduction split across programs). All give the same result.
  The output has x's dtype; the weight is cast to it; products accumulate in float32.
  """
  check_sparse_tensor(x)
  kernel_size, w, b = check_weight(x, weight, bias, weight_layout)
  kernel_size = check_kernel_size(kernel_size)
  dil = check_dilation(dilation)
  tuning.check_algorithm(algorithm)
  layout = WEIGHT_LAYOUTS[weight_layout]
  num_offsets, cin, cout = weight_dims(w, layout)
  key = cache_key(kernel_size, dil, implementation)
  passed = cache is not None
  if cache is None:
    cache = x.caches.get(key)
  if cache is None:
    cache = neighbor_map(x, kernel_size, dil, implementation)
  elif cache.kernel_size != kernel_size or cache.dilation != dil or cache.capacity != x.capacity:
    raise ValueError(
        f"cache was built for kernel_size={cache.kernel_size}, dilation={cache.dilation}, capacity={cache.capacity}"
        f" but this conv has kernel_size={kernel_size}, dilation={dil}, capacity={x.capacity}")
  elif passed and cache.coords is not None:
    # A map carried in x.caches is x's by construction (replacing coords drops them); a passed one may not be.
    check_same_sites("submconv3d", "cache (a NeighborCache)", cache.coords, cache.num, x.coords, x.num,
                     ": build it with neighbor_map of this input")
  impl = dispatch.resolve(implementation)
  # The output shares x's coordinates, so it carries the map on, and the map's hash-table overflow flag.
  x = dataclasses.replace(x.with_cache(key, cache), overflow=x.overflow | cache.overflow)
  if not impl.is_pallas:
    return x.replace(feats=submconv_xla(x.feats, w, b, cache.nbr, x.num, precision=precision,
                                        weight_layout=weight_layout))
  # Under jsparse.autotune (eager), report this call's shapes and map so its passes can be tuned.
  autotuning.record_call(autotuning.ConvCall(x.capacity, cin, cout, num_offsets, jnp.dtype(x.dtype), cache.nbr,
                                             x.num, precision, weight_layout=layout))
  configs = [tuning.choose(p, x.capacity, cin, cout, num_offsets, x.dtype, algorithm) for p in tuning.PASSES]
  opts = _PallasOptions(precision, impl.interpret, *configs, weight_layout=layout)
  maps = _MapArrays(cache.nbr, x.num, _plan_for(cache, configs[0]), _plan_for(cache, configs[1]),
                    cache.pair_lists() if configs[2].masked else None)
  return x.replace(feats=_submconv_pallas(x.feats, w, b, maps, opts))


def check_weight(x: SparseTensor, weight, bias, weight_layout: str = "DHWIO"):
  """Validates a (Kx, Ky, Kz, Cin, Cout) weight ("DHWIO"; or (Cout, Kx, Ky, Kz, Cin), "ODHWI") and a (Cout,)
  bias against x; returns (kernel_size, the weight with its kernel axes flattened, [V, Cin, Cout] or
  [Cout, V, Cin], in x's dtype, bias in x's dtype or None)."""
  if weight_layout not in WEIGHT_LAYOUTS:
    raise ValueError(f"weight_layout must be one of {tuple(WEIGHT_LAYOUTS)}, got {weight_layout!r}")
  weight = jnp.asarray(weight)
  _check_real("weight", weight)
  cout_major = weight_layout == "ODHWI"
  if weight.ndim != 5:
    want = "(Cout, Kx, Ky, Kz, Cin)" if cout_major else "(Kx, Ky, Kz, Cin, Cout)"
    raise ValueError(f"weight must be {want} (weight_layout={weight_layout!r}), got shape {weight.shape}")
  if 0 in weight.shape:
    raise ValueError(f"weight must have nonzero kernel sizes and channel counts, got shape {weight.shape}")
  if cout_major:
    cout, kernel_size, cin = weight.shape[0], tuple(weight.shape[1:4]), weight.shape[4]
  else:
    kernel_size, cin, cout = tuple(weight.shape[:3]), weight.shape[3], weight.shape[4]
  if cin != x.num_channels:
    raise ValueError(f"weight expects {cin} input channels but the features have {x.num_channels} "
                     f"(weight shape {weight.shape}, weight_layout={weight_layout!r})")
  if bias is not None:
    bias = jnp.asarray(bias)
    _check_real("bias", bias)
    if bias.shape != (cout,):
      raise ValueError(f"bias must have shape ({cout},), got {bias.shape}")
    bias = bias.astype(x.dtype)
  flat = weight.reshape(cout, -1, cin) if cout_major else weight.reshape(-1, cin, cout)
  return kernel_size, flat.astype(x.dtype), bias


def _check_real(name: str, value: jax.Array) -> None:
  # The cast to the features' dtype would drop a complex value's imaginary part without a word.
  if not (jnp.issubdtype(value.dtype, jnp.floating) or jnp.issubdtype(value.dtype, jnp.integer)):
    raise TypeError(f"{name} must be real (floating point or integer), got dtype {value.dtype}")


def weight_dims(w, layout: str) -> tuple[int, int, int]:
  """(V, Cin, Cout) of a flattened weight in the kernels' layout "vio" ([V, Cin, Cout]) or "ovi" ([Cout, V, Cin])."""
  if layout == "ovi":
    return w.shape[1], w.shape[2], w.shape[0]
  return tuple(w.shape)


def _plan_for(cache: NeighborCache, config: tuning.PassConfig):
  return cache.plan(config.tiles.block_m) if config.masked else None


def gather_rows(feats, rows, fill=0):
  """feats[rows] with `fill` where rows is -1 (rows: int array of any shape; result rows.shape + [C])."""
  if feats.shape[0] == 0:  # a gather from no rows is an error even where every index is masked: read a zero row
    feats = jnp.pad(feats, ((0, 1), (0, 0)))
  return jnp.where((rows >= 0)[..., None], feats[jnp.maximum(rows, 0)], jnp.asarray(fill, feats.dtype))


def submconv_xla(feats: jax.Array, w: jax.Array, bias: jax.Array | None, nbr: jax.Array, num: ArrayLike, *,
                precision: PrecisionLike = None, weight_layout: str = "DHWIO") -> jax.Array:
  """Explicit gather + one matmul: [M, V*Cin] @ [V*Cin, Cout]. Works on every backend; JAX differentiates it.

  w: [V, Cin, Cout], or [Cout, V, Cin] with weight_layout="ODHWI" (the 5-D layouts with the kernel axes flattened).
  """
  m, v = nbr.shape
  gathered = gather_rows(feats, nbr).reshape(m, v * feats.shape[1])
  if WEIGHT_LAYOUTS[weight_layout] == "ovi":  # contract with [Cout, V*Cin]'s second axis: no transpose
    out = jax.lax.dot_general(gathered, w.reshape(w.shape[0], -1), (((1,), (1,)), ((), ())),
                              precision=dot_precision(precision, feats.dtype), preferred_element_type=jnp.float32)
  else:
    out = jnp.dot(gathered, w.reshape(-1, w.shape[-1]), precision=dot_precision(precision, feats.dtype),
                  preferred_element_type=jnp.float32)
  if bias is not None:
    out = out + bias.astype(jnp.float32)
  valid = jnp.arange(m) < num
  return jnp.where(valid[:, None], out, 0).astype(feats.dtype)


class _MapArrays(NamedTuple):
  """The integer arrays a Pallas convolution reads (no gradients flow into them)."""

  nbr: jax.Array
  num: jax.Array
  forward_plan: Any
  input_grad_plan: Any  # a masked plan for the input-gradient map (`transposed`, else `nbr`)
  pairs: Any
  # For maps between different coordinates (strided / inverse convolutions, sparse_conv.py): the input
  # gradient's map over the input rows, transposed[j, V-1-v] = i iff nbr[i, v] = j, and the number of
  # valid input rows. None for submanifold maps, which are their own transpose.
  transposed: Any = None
  num_in: Any = None


class _PallasOptions(NamedTuple):
  """Static options of the Pallas path (hashable, for custom_vjp's nondiff_argnums)."""

  precision: Any
  interpret: bool
  forward: tuning.PassConfig
  input_grad: tuning.PassConfig
  weight_grad: tuning.PassConfig
  weight_layout: str = "vio"  # the kernels' name of w's layout: "vio" [V, Cin, Cout] or "ovi" [Cout, V, Cin]

  @property
  def xla_weight_layout(self) -> str:
    return "ODHWI" if self.weight_layout == "ovi" else "DHWIO"


# The Pallas path is three bilinear GEMMs over one map, each a custom_vjp whose backward is the other two (and
# itself), so gradients of any order (a gradient penalty, Hessian-vector products) run the same kernels:
#   forward       y = F(x, W)      y[i] = sum_v x[nbr[i, v]] @ W_v (+ bias)
#   input grad   dx = T(g, W)     dx[j] = sum_v g[t[j, v]] @ W_{V-1-v}^T  (t: the transposed map)
#   weight grad  dW = G(x, g)   dW_v = sum_i x[nbr[i, v]]^T g[i]
# with vjp F = (T(h, W), G(x, h)), vjp T = (F(h, W), G(h, g)), vjp G = (T(g, H), F(x, H)).


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _submconv_pallas(feats, w, bias, maps: _MapArrays, opts: _PallasOptions):
  cfg = opts.forward
  if cfg.algorithm == "explicit":
    return submconv_xla(feats, w, bias, maps.nbr, maps.num, precision=opts.precision,
                        weight_layout=opts.xla_weight_layout)
  return gather_gemm_lib.conv_forward(feats, w, maps.nbr, maps.num, bias, plan=maps.forward_plan, config=cfg.tiles,
                                      precision=opts.precision, interpret=opts.interpret,
                                      weight_layout=opts.weight_layout)


def _submconv_pallas_fwd(feats, w, bias, maps, opts):
  return _submconv_pallas(feats, w, bias, maps, opts), (feats, w, bias, maps)


def _submconv_pallas_bwd(opts, residuals, g):
  feats, w, bias, maps = residuals
  # Outputs at padding rows are constant zeros, so g there must not count: the maps never point at
  # padding rows and never list them, and the bias gradient masks them.
  d_feats = _conv_input_grad(g, w, maps, opts)
  d_w = _conv_weight_grad(feats, g, maps, opts).astype(w.dtype)
  d_bias = None
  if bias is not None:
    valid = jnp.arange(g.shape[0]) < maps.num
    d_bias = jnp.sum(jnp.where(valid[:, None], g, 0), axis=0, dtype=jnp.float32).astype(bias.dtype)
  return d_feats, d_w, d_bias, None


_submconv_pallas.defvjp(_submconv_pallas_fwd, _submconv_pallas_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _conv_input_grad(g, w, maps: _MapArrays, opts: _PallasOptions):
  """T(g, W): the input gradient of `_submconv_pallas` for the output gradient g, [rows of feats, Cin]."""
  t_map = maps.nbr if maps.transposed is None else maps.transposed
  t_num = maps.num if maps.num_in is None else maps.num_in
  if opts.input_grad.algorithm == "explicit":  # the XLA forward over the transposed map, W_{V-1-v}^T per offset
    w_t = jnp.swapaxes(w, 1, 2) if opts.weight_layout == "vio" else jnp.transpose(w, (1, 0, 2))
    return submconv_xla(g, jnp.flip(w_t, 0), None, t_map, t_num, precision=opts.precision)
  # The same gather-GEMM over the transposed map (for submanifold maps, the map itself), reading offset
  # V-1-v's matrix transposed.
  return gather_gemm_lib.conv_input_grad(g, w, t_map, t_num, plan=maps.input_grad_plan, config=opts.input_grad.tiles,
                                         precision=opts.precision, interpret=opts.interpret,
                                         weight_layout=opts.weight_layout)


def _conv_input_grad_fwd(g, w, maps, opts):
  return _conv_input_grad(g, w, maps, opts), (g, w, maps)


def _conv_input_grad_bwd(opts, residuals, h):
  g, w, maps = residuals
  return _submconv_pallas(h, w, None, maps, opts), _conv_weight_grad(h, g, maps, opts).astype(w.dtype), None


_conv_input_grad.defvjp(_conv_input_grad_fwd, _conv_input_grad_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _conv_weight_grad(feats, g, maps: _MapArrays, opts: _PallasOptions):
  """G(x, g): the weight gradient of `_submconv_pallas`, in the flattened weight's layout and feats' dtype."""
  if opts.weight_grad.algorithm == "explicit":  # gathered rows^T @ g per offset, as the XLA forward's transpose
    valid = jnp.arange(g.shape[0]) < maps.num
    spec = "mvc,mo->ovc" if opts.weight_layout == "ovi" else "mvc,mo->vco"
    d_w = jnp.einsum(spec, gather_rows(feats, maps.nbr), jnp.where(valid[:, None], g, 0).astype(feats.dtype),
                     precision=dot_precision(opts.precision, feats.dtype), preferred_element_type=jnp.float32)
    return d_w.astype(feats.dtype)
  # With pair lists the map is not passed: the backward pass then keeps the lists alive, not the map too.
  nbr = maps.nbr if maps.pairs is None else None
  return weight_grad_lib.weight_grad(feats, g, nbr, pairs=maps.pairs, config=opts.weight_grad.tiles,
                                     precision=opts.precision, interpret=opts.interpret, out_dtype=feats.dtype,
                                     weight_layout=opts.weight_layout)


def _conv_weight_grad_fwd(feats, g, maps, opts):
  return _conv_weight_grad(feats, g, maps, opts), (feats, g, maps)


def _conv_weight_grad_bwd(opts, residuals, d_w):
  feats, g, maps = residuals
  d_feats = _conv_input_grad(g, d_w.astype(feats.dtype), maps, opts)
  d_g = _submconv_pallas(feats, d_w.astype(feats.dtype), None, maps, opts).astype(g.dtype)
  return d_feats, d_g, None


_conv_weight_grad.defvjp(_conv_weight_grad_fwd, _conv_weight_grad_bwd)
