"""Implicit GEMM with the gather fused in: out[i] = sum_v x[nbr[i, v]] @ W[v] (+ bias).

One kernel serves two passes of a submanifold convolution:
- forward: x = input features, W[v] = weight[v] ([Cin, Cout]);
- input gradient: x = output gradient, and the weight is read as W[V-1-v]^T (`transpose_weight=True`):
  if j is i's neighbour at offset v then i is j's at V-1-v, so the same map serves both passes.

The reduction runs over (offset, channel chunk) pairs flattened into one loop so that Triton pipelines
the loads across offsets. A program whose rows have no neighbour at an offset skips that offset's
matmuls (`skip_empty=True`), which is where sparse inputs save most of the work.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.tiling import TileConfig, clamp_pow2, dot_precision, is_half


def default_config(num_rows: int, k: int, n: int, dtype) -> TileConfig:
  """Heuristic tiles (used when no tuned config is given)."""
  half = is_half(dtype)
  block_n = clamp_pow2(n, 16, 128)
  block_k = clamp_pow2(k, 16, 64 if half else 32)
  block_m = 128 if (num_rows >= 32768 and block_n >= 64) else 64
  warps = 8 if block_m * block_n >= 128 * 128 else 4
  return TileConfig(block_m, block_n, block_k, num_warps=warps, num_stages=3 if half else 2)


def _gather_gemm_kernel(num_ref, x_ref, w_ref, nbr_ref, *rest, num_offsets, k_dim, n_dim, block_m, block_n,
                        block_k, transpose_weight, skip_empty, has_bias, precision):
  if has_bias:
    bias_ref, o_ref = rest
  else:
    (o_ref,) = rest
  num_rows = o_ref.shape[0]
  rows = pl.program_id(0) * block_m + jnp.arange(block_m)
  row_ok = rows < num_ref[0]
  cols = pl.program_id(1) * block_n + jnp.arange(block_n)
  col_ok = cols < n_dim
  k_steps = pl.cdiv(k_dim, block_k)
  ks = jnp.arange(block_k)

  def step(t, acc):
    v = lax.div(t, k_steps)
    k0 = lax.rem(t, k_steps) * block_k
    nb = plgpu.load(nbr_ref.at[rows, v], mask=row_ok, other=-1)
    has = nb >= 0

    def matmul(acc):
      kk = k0 + ks
      k_ok = kk < k_dim
      src = jnp.where(has, nb, 0)
      a = plgpu.load(x_ref.at[src[:, None], kk[None, :]], mask=has[:, None] & k_ok[None, :], other=0)
      if transpose_weight:
        b = plgpu.load(w_ref.at[num_offsets - 1 - v, cols[None, :], kk[:, None]],
                       mask=k_ok[:, None] & col_ok[None, :], other=0)
      else:
        b = plgpu.load(w_ref.at[v, kk[:, None], cols[None, :]], mask=k_ok[:, None] & col_ok[None, :], other=0)
      return acc + jnp.dot(a, b, precision=precision, preferred_element_type=jnp.float32)

    if skip_empty:
      return lax.cond(jnp.max(has.astype(jnp.int32)) > 0, matmul, lambda acc: acc, acc)
    return matmul(acc)

  acc = lax.fori_loop(0, num_offsets * k_steps, step, jnp.zeros((block_m, block_n), jnp.float32))
  if has_bias:
    bias = plgpu.load(bias_ref.at[cols], mask=col_ok, other=0).astype(jnp.float32)
    acc = jnp.where(row_ok[:, None], acc + bias[None, :], 0.0)
  out_ok = (rows < num_rows)[:, None] & col_ok[None, :]
  plgpu.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=out_ok)


@functools.partial(jax.jit, static_argnames=("transpose_weight", "skip_empty", "config", "precision", "interpret"))
def gather_gemm(x, weight, nbr, num, bias=None, *, transpose_weight: bool = False, skip_empty: bool = True,
                config: TileConfig | None = None, precision=None, interpret: bool = False):
  """out[i] = sum_v x[nbr[i, v]] @ W_v (+ bias) for i < num, zero rows for i >= num.

  x: [R, K] rows to gather (nbr entries index them; -1 = none).
  weight: [V, K, N] (W_v = weight[v]), or with transpose_weight [V, N, K] (W_v = weight[V-1-v]^T).
  nbr: int32 [M, V]; num: int32 scalar (rows >= num are written as zeros); bias: [N] or None.
  Returns [M, N] in x's dtype, accumulated in float32.
  """
  m, num_offsets = nbr.shape
  k_dim = x.shape[1]
  if transpose_weight:
    v_w, n_dim, k_w = weight.shape
  else:
    v_w, k_w, n_dim = weight.shape
  if v_w != num_offsets or k_w != k_dim:
    raise ValueError(f"gather_gemm: weight {weight.shape} does not match x {x.shape} and nbr {nbr.shape}")
  cfg = config or default_config(m, k_dim, n_dim, x.dtype)
  kernel = functools.partial(
      _gather_gemm_kernel, num_offsets=num_offsets, k_dim=k_dim, n_dim=n_dim, block_m=cfg.block_m,
      block_n=cfg.block_n, block_k=cfg.block_k, transpose_weight=transpose_weight, skip_empty=skip_empty,
      has_bias=bias is not None, precision=dot_precision(precision, x.dtype))
  args = [jnp.reshape(num, (1,)).astype(jnp.int32), x, weight.astype(x.dtype), nbr]
  if bias is not None:
    args.append(bias)
  return pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((m, n_dim), x.dtype),
      grid=(pl.cdiv(m, cfg.block_m), pl.cdiv(n_dim, cfg.block_n)),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name="gather_gemm_t" if transpose_weight else "gather_gemm",
  )(*args)
