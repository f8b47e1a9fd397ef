"""Weight gradient of a submanifold convolution: a gather-gather GEMM over sites.

dW[v] = sum_i x[nbr[i, v]]^T dy[i] over the sites i that have a neighbour at offset v.

Programs tile (offset, Cin block, Cout block) and, with `split > 1`, also cut the site range into
`split` pieces whose float32 partial sums are added afterwards: with small channel counts the
(offset, Cin, Cout) tiles alone are too few to fill the GPU.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax import lax

from pallas_kernels.gemm_plan import PairLists
from pallas_kernels.tiling import TileConfig, clamp_pow2, dot_precision, gpu_num_sms, is_half


def default_config(num_rows: int, cin: int, cout: int, num_offsets: int, dtype) -> TileConfig:
  """Heuristic tiles. On the H200 suite the tuner chose 128x128 (Cin x Cout) tiles and a split that gives
  several programs per SM (e.g. 10 at 252k rows, 256 channels; 40 at 1M rows, 128 channels); half precision
  ran 1.2x faster with 4 warps and 4 stages than with 8 warps (benchmarks/tf32_probe.py)."""
  half = is_half(dtype)
  block_m = clamp_pow2(cin, 16, 128)
  block_n = clamp_pow2(cout, 16, 128 if half else 64)
  block_k = 64 if half else 32
  stages = 4 if half else 3
  tiles = num_offsets * -(-cin // block_m) * -(-cout // block_n)
  # Aim for ~4 programs per SM, but keep at least ~8 row chunks per program.
  want = max(1, -(-4 * gpu_num_sms() // tiles))
  split = max(1, min(want, num_rows // (8 * block_k)))
  return TileConfig(block_m, block_n, block_k, num_warps=4, num_stages=stages, split=split)


def _weight_grad_kernel(x_ref, dy_ref, nbr_ref, *refs, use_pairs, split, cin, cout, block_m, block_n, block_k,
                        dy_transposed, precision):
  refs = list(refs)
  o_ref = refs.pop()
  pair_rows_ref, pair_counts_ref, pair_sources_ref = refs if use_pairs else (None, None, None)
  num_rows = nbr_ref.shape[0]
  v = pl.program_id(0)
  ci = pl.program_id(1) * block_m + jnp.arange(block_m)
  co = pl.program_id(2) * block_n + jnp.arange(block_n)
  s = pl.program_id(3)
  ci_ok = ci < cin
  co_ok = co < cout
  # Rows (or, with pair lists, list entries) [start, stop) belong to this program.
  length = plgpu.load(pair_counts_ref.at[v]) if use_pairs else num_rows
  per = pl.cdiv(pl.cdiv(length, split), block_k) * block_k
  start = s * per
  stop = jnp.minimum(start + per, length)
  steps = pl.cdiv(jnp.maximum(stop - start, 0), block_k)
  rk = jnp.arange(block_k)

  def step(t, acc):
    idx = start + t * block_k + rk
    if use_pairs:  # both loads one indirection away from the loop counter (see gemm_plan.py)
      rows = plgpu.load(pair_rows_ref.at[v, idx], mask=idx < stop, other=0)
      nb = plgpu.load(pair_sources_ref.at[v, idx], mask=idx < stop, other=-1)
    else:
      rows = idx
      nb = plgpu.load(nbr_ref.at[rows, v], mask=rows < stop, other=-1)
    has = nb >= 0

    def matmul(acc):
      a = plgpu.load(x_ref.at[jnp.where(has, nb, 0)[:, None], ci[None, :]], mask=has[:, None] & ci_ok[None, :],
                     other=0)
      if dy_transposed:  # dy_ref is [Cout, M]: the tile is contiguous along the reduction (rows)
        b = plgpu.load(dy_ref.at[co[None, :], rows[:, None]], mask=has[:, None] & co_ok[None, :], other=0)
      else:
        b = plgpu.load(dy_ref.at[rows[:, None], co[None, :]], mask=has[:, None] & co_ok[None, :], other=0)
      return acc + jnp.dot(a.T, b, precision=precision, preferred_element_type=jnp.float32)

    if use_pairs:  # every listed row has a neighbour at v
      return matmul(acc)
    return lax.cond(jnp.max(has.astype(jnp.int32)) > 0, matmul, lambda acc: acc, acc)

  acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
  plgpu.store(o_ref.at[s, v, ci[:, None], co[None, :]], acc, mask=ci_ok[:, None] & co_ok[None, :])


@functools.partial(jax.jit, static_argnames=("config", "precision", "interpret", "out_dtype", "transpose_dy"))
def weight_grad(x, dy, nbr, *, pairs: PairLists | None = None, config: TileConfig | None = None, precision=None,
                interpret: bool = False, out_dtype=None, transpose_dy: bool = False):
  """dW [V, Cin, Cout] = per offset v, sum over sites i with nbr[i, v] >= 0 of outer(x[nbr[i, v]], dy[i]).

  x: [R, Cin] (gathered through nbr), dy: [M, Cout] (rows >= num must have nbr == -1), nbr: int32 [M, V].
  pairs: `gemm_plan.pair_lists(nbr)`: walk only the rows that have a neighbour at each offset (else all
    rows, skipping chunks with none at run time).
  transpose_dy: read dy through a [Cout, M] copy, so its tiles are contiguous along the reduction (an
    experiment for TF32, whose tensor-core path wants K-contiguous operands; benchmarks/tf32_probe.py).
  Accumulates in float32; returns out_dtype (default x.dtype).
  """
  m, num_offsets = nbr.shape
  cin, cout = x.shape[1], dy.shape[1]
  if dy.shape[0] != m:
    raise ValueError(f"weight_grad: dy has {dy.shape[0]} rows, nbr has {m}")
  cfg = config or default_config(m, cin, cout, num_offsets, x.dtype)
  kernel = functools.partial(
      _weight_grad_kernel, use_pairs=pairs is not None, split=cfg.split, cin=cin, cout=cout,
      block_m=cfg.block_m, block_n=cfg.block_n, block_k=cfg.block_k, dy_transposed=transpose_dy,
      precision=dot_precision(precision, x.dtype))
  dy = dy.astype(x.dtype)
  args = [x, dy.T if transpose_dy else dy, nbr]
  if pairs is not None:
    args += [pairs.rows, pairs.counts, pairs.sources]
  partial = pl.pallas_call(
      kernel,
      out_shape=jax.ShapeDtypeStruct((cfg.split, num_offsets, cin, cout), jnp.float32),
      grid=(num_offsets, pl.cdiv(cin, cfg.block_m), pl.cdiv(cout, cfg.block_n), cfg.split),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name="weight_grad",
  )(*args)
  return jnp.sum(partial, axis=0).astype(out_dtype or x.dtype)
