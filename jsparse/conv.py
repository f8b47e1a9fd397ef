"""Submanifold sparse convolution: the differentiable op and its implementations."""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jsparse import dispatch
from jsparse.neighbors import NeighborCache, check_dilation, check_kernel_size, neighbor_map
from jsparse.sparse_tensor import SparseTensor
from pallas_kernels import gather_gemm as gather_gemm_lib
from pallas_kernels import weight_grad as weight_grad_lib
from pallas_kernels.tiling import TileConfig, dot_precision


def submconv3d(x: SparseTensor, weight, bias=None, *, dilation=1, cache: NeighborCache | None = None,
               implementation: str | None = None, precision=None) -> SparseTensor:
  """Submanifold 3D convolution: a SparseTensor on the same coordinates as `x`.

  At every valid site u: y[u] = sum_i weight[i]^T x[u + (i - centre) * dilation] + bias, summing over the
  kernel positions i whose shifted site is active; this equals
  `lax.conv_general_dilated(x.todense(), weight, (1, 1, 1), "SAME", rhs_dilation=dilation,
  dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))` read at the valid sites.

  weight: (Kx, Ky, Kz, Cin, Cout), odd kernel sizes (flax's layout). bias: (Cout,) or None.
  cache: a NeighborCache for x's coordinates from `neighbor_map(x, kernel_size, dilation)`; built here if
    None. Share one cache across the layers that run on the same coordinates.
  implementation: None (Pallas kernels on a GPU, XLA elsewhere), "pallas" or "xla".
  precision: for float32 inputs, None/"tf32" (TF32 matmuls on the GPU) or "highest" (full fp32).
  The output has x's dtype; the weight is cast to it; products accumulate in float32.
  """
  weight = jnp.asarray(weight)
  if weight.ndim != 5:
    raise ValueError(f"weight must be (Kx, Ky, Kz, Cin, Cout), got shape {weight.shape}")
  kernel_size = check_kernel_size(weight.shape[:3])
  dil = check_dilation(dilation)
  cin, cout = weight.shape[3], weight.shape[4]
  if cin != x.num_channels:
    raise ValueError(f"weight expects {cin} input channels but the features have {x.num_channels}")
  if bias is not None:
    bias = jnp.asarray(bias)
    if bias.shape != (cout,):
      raise ValueError(f"bias must have shape ({cout},), got {bias.shape}")
  if cache is None:
    cache = neighbor_map(x, kernel_size, dil, implementation)
  elif cache.kernel_size != kernel_size or cache.dilation != dil or cache.capacity != x.capacity:
    raise ValueError(
        f"cache was built for kernel_size={cache.kernel_size}, dilation={cache.dilation}, capacity={cache.capacity}"
        f" but this conv has kernel_size={kernel_size}, dilation={dil}, capacity={x.capacity}")
  impl = dispatch.resolve(implementation)
  w = weight.reshape(math.prod(kernel_size), cin, cout).astype(x.dtype)
  b = None if bias is None else bias.astype(x.dtype)
  if impl.is_pallas:
    feats = _submconv_pallas(x.feats, w, b, cache.nbr, x.num, _PallasOptions(precision, impl.interpret))
  else:
    feats = submconv_xla(x.feats, w, b, cache.nbr, x.num, precision=precision)
  return x.replace(feats=feats)


def submconv_xla(feats, w, bias, nbr, num, *, precision=None):
  """Explicit gather + one matmul: [M, V*Cin] @ [V*Cin, Cout]. Works on every backend; JAX differentiates it."""
  m, v = nbr.shape
  has = nbr >= 0
  gathered = jnp.where(has[..., None], feats[jnp.maximum(nbr, 0)], 0)
  out = jnp.dot(gathered.reshape(m, v * feats.shape[1]), w.reshape(-1, w.shape[-1]),
                precision=dot_precision(precision, feats.dtype), preferred_element_type=jnp.float32)
  if bias is not None:
    out = out + bias.astype(jnp.float32)
  valid = jnp.arange(m) < num
  return jnp.where(valid[:, None], out, 0).astype(feats.dtype)


class _PallasOptions(tuple):
  """Static options of the Pallas path (hashable, for custom_vjp's nondiff_argnums)."""

  def __new__(cls, precision=None, interpret=False, forward: TileConfig | None = None,
              input_grad: TileConfig | None = None, weight_grad: TileConfig | None = None):
    return super().__new__(cls, (precision, interpret, forward, input_grad, weight_grad))

  precision = property(lambda self: self[0])
  interpret = property(lambda self: self[1])
  forward = property(lambda self: self[2])
  input_grad = property(lambda self: self[3])
  weight_grad = property(lambda self: self[4])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _submconv_pallas(feats, w, bias, nbr, num, opts: _PallasOptions):
  return gather_gemm_lib.gather_gemm(feats, w, nbr, num, bias, config=opts.forward, precision=opts.precision,
                                     interpret=opts.interpret)


def _submconv_pallas_fwd(feats, w, bias, nbr, num, opts):
  out = _submconv_pallas(feats, w, bias, nbr, num, opts)
  return out, (feats, w, bias, nbr, num)


def _submconv_pallas_bwd(opts, residuals, g):
  feats, w, bias, nbr, num = residuals
  # Input gradient: the same gather-GEMM over the same map, reading weight[V-1-v]^T.
  d_feats = gather_gemm_lib.gather_gemm(g, w, nbr, num, transpose_weight=True, config=opts.input_grad,
                                        precision=opts.precision, interpret=opts.interpret)
  d_w = weight_grad_lib.weight_grad(feats, g, nbr, config=opts.weight_grad, precision=opts.precision,
                                    interpret=opts.interpret, out_dtype=w.dtype)
  d_bias = None
  if bias is not None:
    valid = jnp.arange(g.shape[0]) < num
    d_bias = jnp.sum(jnp.where(valid[:, None], g, 0), axis=0, dtype=jnp.float32).astype(bias.dtype)
  return d_feats, d_w, d_bias, None, None


_submconv_pallas.defvjp(_submconv_pallas_fwd, _submconv_pallas_bwd)
