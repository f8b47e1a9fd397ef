"""The map-GEMM's passes in plain XLA (gather, then one matmul): every backend runs them and JAX
differentiates them; the Pallas path's "explicit" algorithm is these."""
from __future__ import annotations

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


def submconv_xla(feats: jax.Array, w: jax.Array, bias: jax.Array | None, nbr: jax.Array, num: ArrayLike, *,
                 precision: PrecisionLike = None, weight_layout: WeightLayout | str = "DHWIO") -> jax.Array:
  """Advanced (array level): out[i] = sum_v feats[nbr[i, v]] @ W_v (+ bias) for i < num, as [M, V*Cin] @
  [V*Cin, Cout]; zero rows from num on.

  w: the flattened weight, [V, Cin, Cout] (DHWIO) or [Cout, V, Cin] (ODHWI). nbr: int32 [M, V], -1 = none.
  """
  m, v = nbr.shape
  gathered = gather_rows(feats, nbr).reshape(m, v * feats.shape[1])
  if WeightLayout.of(weight_layout).cout_major:  # contract with [Cout, V*Cin]'s second axis: no transpose
    out = jax.lax.dot_general(gathered, w.reshape(w.shape[0], -1), (((1,), (1,)), ((), ())),
                              precision=dot_precision(precision, feats.dtype), preferred_element_type=jnp.float32)
  else:
    out = jnp.dot(gathered, w.reshape(-1, w.shape[-1]), precision=dot_precision(precision, feats.dtype),
                  preferred_element_type=jnp.float32)
  if bias is not None:
    out = out + bias.astype(jnp.float32)
  valid = jnp.arange(m) < num
  return jnp.where(valid[:, None], out, 0).astype(feats.dtype)


def input_grad_xla(g, w, t_map, t_num, *, precision, weight_layout: WeightLayout):
  """dx[j] = sum_v g[t_map[j, v]] @ W_{V-1-v}^T: the forward over the transposed map with the flipped,
  transposed weight."""
  w_t = jnp.transpose(w, (1, 0, 2)) if weight_layout.cout_major else jnp.swapaxes(w, 1, 2)
  return submconv_xla(g, jnp.flip(w_t, 0), None, t_map, t_num, precision=precision)


def weight_grad_xla(feats, g, nbr, num, *, precision, weight_layout: WeightLayout):
  """dW_v = sum_i feats[nbr[i, v]]^T g[i] over the valid rows i, in the flattened weight's layout."""
  valid = jnp.arange(g.shape[0]) < num
  spec = "mvc,mo->ovc" if weight_layout.cout_major else "mvc,mo->vco"
  d_w = jnp.einsum(spec, gather_rows(feats, nbr), jnp.where(valid[:, None], g, 0).astype(feats.dtype),
                   precision=dot_precision(precision, feats.dtype), preferred_element_type=jnp.float32)
  return d_w.astype(feats.dtype)
