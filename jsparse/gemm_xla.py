"""The map-GEMM's passes in plain XLA (gather, then one matmul): every backend runs them; the XLA path
differentiates them through `map_gemm_xla`'s custom_vjp (gathers only, no scatter-add), and the Pallas path's
"explicit" algorithm is these."""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from jsparse._types import ArrayLike, PrecisionLike
from pallas_kernels.tiling import dot_precision
from pallas_kernels.weight_layout import WeightLayout


def gather_rows(feats: jax.Array, rows: jax.Array, fill=0) -> jax.Array:
  """feats[rows] with `fill` where rows is -1 (rows: int array of any shape; result rows.shape + [C])."""
  if feats.shape[0] == 0:  # a gather from no rows is an error even where every index is masked: read a zero row
    feats = jnp.pad(feats, ((0, 1), (0, 0)))
  return jnp.where((rows >= 0)[..., None], feats[jnp.maximum(rows, 0)], jnp.asarray(fill, feats.dtype))


@jax.custom_jvp
def _gather_rows_f32_sum(feats: jax.Array, rows: jax.Array) -> jax.Array:
  """gather_rows(feats, rows) whose transpose (the input gradient's scatter-add over every row's offsets)
  sums in float32: JAX's own transpose of the gather adds in feats' dtype, so float16 partial sums of an
  input gradient overflowed to inf where the Pallas path and the final value stayed finite. The primal
  gather is unchanged; the tangent goes through float32 (a custom_jvp, so forward mode works too). Since
  `map_gemm_xla` differentiates the XLA path by gathers, this serves `submconv_xla` called directly and the
  second derivatives of its weight gradient."""
  return gather_rows(feats, rows)


@_gather_rows_f32_sum.defjvp
def _gather_rows_f32_sum_jvp(primals, tangents):
  feats, rows = primals
  t = tangents[0]
  return gather_rows(feats, rows), gather_rows(t.astype(jnp.float32), rows).astype(t.dtype)


def submconv_xla(feats: jax.Array, w: jax.Array, bias: jax.Array | None, nbr: jax.Array, num: ArrayLike, *,
                 precision: PrecisionLike = None, weight_layout: WeightLayout | str = "DHWIO",
                 groups: int = 1) -> jax.Array:
  """Advanced (array level): out[i] = sum_v feats[nbr[i, v]] @ W_v (+ bias) for i < num, as [M, V*Cin] @
  [V*Cin, Cout]; zero rows from num on.

  w: the flattened weight, [V, Cin/groups, Cout] (DHWIO) or [Cout, V, Cin/groups] (ODHWI). nbr: int32 [M, V],
  -1 = none. groups > 1: output channel block j of Cout/groups reads input channel block j of Cin/groups, as
  one batched matmul over the group axis.
  """
  m, v = nbr.shape
  cout_major = WeightLayout.of(weight_layout).cout_major
  if groups > 1:
    gathered = _gather_rows_f32_sum(feats, nbr).reshape(m, v, groups, feats.shape[1] // groups)
    cin_g = gathered.shape[-1]
    if cout_major:
      grouped, spec = w.reshape(groups, -1, v, cin_g), "mvgc,govc->mgo"
    else:
      grouped, spec = w.reshape(v, cin_g, groups, -1), "mvgc,vcgo->mgo"
    out = jnp.einsum(spec, gathered, grouped, precision=dot_precision(precision, feats.dtype),
                     preferred_element_type=jnp.float32)
    out = out.reshape(m, out.shape[1] * out.shape[2])  # explicit sizes: m may be 0
  elif cout_major:  # contract with [Cout, V*Cin]'s second axis: no transpose
    gathered = _gather_rows_f32_sum(feats, nbr).reshape(m, v * feats.shape[1])
    out = jax.lax.dot_general(gathered, w.reshape(w.shape[0], -1), (((1,), (1,)), ((), ())),
                              precision=dot_precision(precision, feats.dtype), preferred_element_type=jnp.float32)
  else:
    gathered = _gather_rows_f32_sum(feats, nbr).reshape(m, v * feats.shape[1])
    out = jnp.dot(gathered, w.reshape(-1, w.shape[-1]), precision=dot_precision(precision, feats.dtype),
                  preferred_element_type=jnp.float32)
  if bias is not None:
    out = out + bias.astype(jnp.float32)
  valid = jnp.arange(m) < num
  return jnp.where(valid[:, None], out, 0).astype(feats.dtype)


def transposed_weight(w, weight_layout: WeightLayout, groups: int = 1, flip_offsets: bool = True):
  """The input gradient's weight: [V, Cout/groups, Cin] (DHWIO, flattened) with W'_v = W_{V-1-v}^T per group
  (W_v^T without flip_offsets)."""
  if groups == 1:
    w_t = jnp.transpose(w, (1, 0, 2)) if weight_layout.cout_major else jnp.swapaxes(w, 1, 2)
  else:
    w_t = _grouped_transpose(w, weight_layout, groups)
  return jnp.flip(w_t, 0) if flip_offsets else w_t


def _grouped_transpose(w, weight_layout: WeightLayout, groups: int):
  """[V, Cout/groups, Cin]: each group's block of the flattened weight transposed."""
  if weight_layout.cout_major:  # [G, Cout/G, V, Cin/G] -> [V, Cout/G, G, Cin/G]
    cout, v, cin_g = w.shape
    w_t = jnp.transpose(w.reshape(groups, cout // groups, v, cin_g), (2, 1, 0, 3))
  else:  # [V, Cin/G, G, Cout/G] -> [V, Cout/G, G, Cin/G]
    v, cin_g, cout = w.shape
    w_t = jnp.transpose(w.reshape(v, cin_g, groups, cout // groups), (0, 3, 2, 1))
  return w_t.reshape(v, w_t.shape[1], groups * cin_g)


def input_grad_xla(g, w, t_map, t_num, *, precision, weight_layout: WeightLayout, groups: int = 1,
                   flip_offsets: bool = True):
  """dx[j] = sum_v g[t_map[j, v]] @ W_{V-1-v}^T (per group) over a submanifold map, or W_v^T over a transposed
  map without flip_offsets (gather_gemm.conv_input_grad): the forward over that map with the transposed weight."""
  return submconv_xla(g, transposed_weight(w, weight_layout, groups, flip_offsets), None, t_map, t_num,
                      precision=precision, groups=groups)


def weight_grad_xla(feats, g, nbr, num, *, precision, weight_layout: WeightLayout, groups: int = 1):
  """dW_v = sum_i feats[nbr[i, v]]^T g[i] over the valid rows i (per group), in the flattened weight's layout."""
  valid = jnp.arange(g.shape[0]) < num
  g = jnp.where(valid[:, None], g, 0).astype(feats.dtype)
  kw = dict(precision=dot_precision(precision, feats.dtype), preferred_element_type=jnp.float32)
  if groups == 1:
    spec = "mvc,mo->ovc" if weight_layout.cout_major else "mvc,mo->vco"
    return jnp.einsum(spec, _gather_rows_f32_sum(feats, nbr), g, **kw).astype(feats.dtype)
  m, v = nbr.shape
  gathered = _gather_rows_f32_sum(feats, nbr).reshape(m, v, groups, feats.shape[1] // groups)
  spec = "mvgc,mgo->govc" if weight_layout.cout_major else "mvgc,mgo->vcgo"
  d_w = jnp.einsum(spec, gathered, g.reshape(m, groups, g.shape[1] // groups), **kw)
  shape = (-1, v, gathered.shape[-1]) if weight_layout.cout_major else (v, gathered.shape[-1], -1)
  return d_w.reshape(shape).astype(feats.dtype)


def weight_grad_apart(feats, g, nbr, num, **kw):
  """weight_grad_xla tied to the cotangent: its gather then cannot be merged with the forward's identical one,
  which would keep that [rows, offsets x Cin] operand alive from the forward to the backward."""
  feats, g = jax.lax.optimization_barrier((feats, g))
  return weight_grad_xla(feats, g, nbr, num, **kw)


def before_next_layer(d_feats, d_w):
  """Holds a layer's input gradient back until its gathered weight gradient is done. Without it XLA's GPU sibling
  fusion (the layers' gathers share the map) gathers every layer's [rows, offsets x Cin] operand in one
  multi-output fusion after the last input gradient, so all of them are alive at once."""
  return jax.lax.optimization_barrier((d_feats, d_w))


class XlaPasses(NamedTuple):
  """Static options of `map_gemm_xla` (hashable, for custom_vjp's nondiff_argnums)."""

  precision: PrecisionLike
  weight_layout: WeightLayout
  groups: int
  flip_offsets: bool  # the input gradient reads offset v with W_{V-1-v} (a submanifold map), else W_v


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def map_gemm_xla(feats, w, bias, nbr, num, t_map, t_num, opts: XlaPasses):
  """`submconv_xla` differentiated as the Pallas path is: the input gradient runs over the input-gradient map
  t_map (the map itself for a submanifold map, with the offsets flipped; a strided map's transpose) with the
  transposed weight, and the weight gradient gathers the features. Both are gathers and one matmul: JAX's own
  transpose of the gather is a scatter-add, which XLA runs with atomics on the GPU (sums that change in the last
  bits from run to run) and which the brief keeps out of every hot path. Reverse mode to any order; no forward
  mode (a custom_vjp)."""
  return submconv_xla(feats, w, bias, nbr, num, precision=opts.precision, weight_layout=opts.weight_layout,
                      groups=opts.groups)


def _map_gemm_xla_fwd(feats, w, bias, nbr, num, t_map, t_num, opts):
  return map_gemm_xla(feats, w, bias, nbr, num, t_map, t_num, opts), (feats, w, bias, nbr, num, t_map, t_num)


def _map_gemm_xla_bwd(opts, residuals, g):
  feats, w, bias, nbr, num, t_map, t_num = residuals
  # Outputs at padding rows are constant zeros, so g there must not count: t_map never lists them,
  # weight_grad_xla masks them, and so does the bias gradient (as on the Pallas path).
  # The input gradient is the forward over t_map with the transposed weight (held DHWIO); its own input-gradient
  # map is nbr again, so a gradient of this gradient runs the same way.
  transposed = XlaPasses(opts.precision, WeightLayout.DHWIO, opts.groups, opts.flip_offsets)
  w_t = transposed_weight(w, opts.weight_layout, opts.groups, opts.flip_offsets)
  d_feats = map_gemm_xla(g.astype(feats.dtype), w_t.astype(feats.dtype), None, t_map, t_num, nbr, num, transposed)
  d_w = weight_grad_apart(feats, g, nbr, num, precision=opts.precision, weight_layout=opts.weight_layout,
                          groups=opts.groups).astype(w.dtype)
  d_feats, d_w = before_next_layer(d_feats, d_w)
  d_bias = None
  if bias is not None:
    valid = (jnp.arange(g.shape[0]) < num)[:, None]
    d_bias = jnp.sum(jnp.where(valid, g, 0), axis=0, dtype=jnp.float32).astype(bias.dtype)
  return d_feats.astype(feats.dtype), d_w, d_bias, None, None, None, None


map_gemm_xla.defvjp(_map_gemm_xla_fwd, _map_gemm_xla_bwd)

