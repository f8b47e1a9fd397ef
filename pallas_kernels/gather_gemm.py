"""Implicit GEMM with the gather fused in: out[i] = sum_v x[nbr[i, v]] @ W[v] (+ bias).

One kernel serves two passes of a submanifold convolution:
- forward: x = input features, W_v = the [Cin, Cout] matrix of offset v;
- input gradient: x = output gradient, W_v = the transpose of offset V-1-v's matrix (`flip_offsets=True`):
  if j is i's neighbour at offset v then i is j's at V-1-v, so the same map serves both passes.
The kernel reads W_v out of a weight stored in any axis order (`weight_axes`), so both of the layouts a
convolution weight comes in serve both passes without a copy where the read is K-contiguous:
- "vio" ([V, Cin, Cout], flax's (Kx, Ky, Kz, Cin, Cout) kernel): K-contiguous for the input gradient;
- "ovi" ([Cout, V, Cin], PyTorch / spconv / FlexGEMM's (Cout, Kx, Ky, Kz, Cin)): K-contiguous for the forward.
`conv_forward` / `conv_input_grad` pick the read (or a K-contiguous copy, `reads_weight_k_major`) per layout.

The reduction runs over (offset, channel chunk) pairs flattened into one loop so that Triton pipelines
the loads across offsets. Sparse inputs save work by skipping offsets: with a masked plan
(`gemm_plan.masked_plan`) a block loops only over the offsets its rows use; without one, a block whose rows
have no neighbour at an offset skips that offset's matmuls at run time (`skip_empty=True`). With
`config.split > 1` the reduction is also split across programs (split-K), for few rows or few channels.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gemm_plan import MaskedPlan, default_block_m
from pallas_kernels.mma import mma
from pallas_kernels.out_struct import out_struct, same_vma
from pallas_kernels.tiling import TileConfig, check_weight_layout, clamp_pow2, dot_precision, is_half


def default_config(num_rows: int, k: int, n: int, dtype) -> TileConfig:
  """Heuristic tiles (used when no tuned config is given).

  From H200 measurements (benchmarks/tf32_probe.py; docs/perf_notes.md): 5 stages (with the plan's gathered
  rows Triton then prefetches two steps ahead) and a row block's column blocks launched side by side.
  Half precision: 128x256x64 tiles with 8 warps once N >= 256 (397 TFLOP/s at RES 256, C 256), else
  128x128x64; float32 (TF32): 128x128x32 with 4 warps (159 TFLOP/s there).
  """
  half = is_half(dtype)
  block_m = default_block_m(num_rows)
  block_n = clamp_pow2(n, 16, 256 if half and block_m == 128 else 128)
  block_k = clamp_pow2(k, 16, 64 if half else 32)
  warps = 8 if half and block_m * block_n >= 128 * 128 else 4
  return TileConfig(block_m, block_n, block_k, num_warps=warps, num_stages=5, columns_fastest=True)


def reads_weight_k_major(num_rows: int, config: TileConfig, dtype) -> bool:
  """Whether a pass whose stored weight is N-contiguous (the forward of a "vio" weight, the input gradient of an
  "ovi" one) reads it through a K-contiguous copy (`config.weight_k_major`, or this rule).

  Tensor cores want the weight tile contiguous along the reduction. Hopper's TF32 MMA has no other mode
  (an N-contiguous float32 tile is restaged through registers: 1.3-1.9x slower forwards on an H200 once
  there are many row blocks), so float32 reads the copy by default; half precision gains up to 1.1x, worth
  the per-call transpose once there are enough row blocks re-reading the weight (docs/perf_notes.md). On a
  few rows the copy costs about what it saves, so the tuner may choose either.
  """
  if config.weight_k_major is not None:
    return config.weight_k_major
  return jnp.dtype(dtype) == jnp.float32 or -(-num_rows // config.block_m) >= 16


def swaps_operands(config: TileConfig, dtype, k_contiguous: bool) -> bool:
  """Whether `gather_gemm` accumulates the transposed product W^T x^T (`config.swap_operands`, or this rule).

  Float32 (TF32) reading a K-contiguous weight: the swapped product was 4-12% faster on an H200 (RES 64 C 1024:
  2.81 -> 2.50 ms; RES 256 C 256: 1.76 -> 1.69 ms; docs/perf_notes.md). Reading the weight straight, it is
  3-5x slower (Hopper's TF32 MMA then restages the weight tile), and in half precision (straight read)
  14-19% slower.
  """
  if config.swap_operands is not None:
    return config.swap_operands
  return jnp.dtype(dtype) == jnp.float32 and k_contiguous


def conv_forward(x, weight, nbr, num, bias=None, *, plan: MaskedPlan | None = None, config: TileConfig,
                 precision=None, interpret: bool = False, weight_layout: str = "vio"):
  """The forward pass of a convolution, out[i] = sum_v x[nbr[i, v]] @ W_v (+ bias), W_v [Cin, Cout].

  weight_layout "ovi" (weight [Cout, V, Cin]): read K-contiguous in place. "vio" (weight [V, Cin, Cout]): read
  straight, or through w_k = weight transposed to [V, Cout, Cin] as `reads_weight_k_major` picks (a plain
  last-two-axes transpose: XLA's tiled transpose; flipping the offsets as well made it a slow generic copy).
  """
  kw = dict(plan=plan, config=config, precision=precision, interpret=interpret)
  if check_weight_layout(weight_layout) == "ovi":
    return gather_gemm(x, weight, nbr, num, bias, weight_axes="nvk", **kw)
  if reads_weight_k_major(nbr.shape[0], config, x.dtype):
    return gather_gemm(x, jnp.swapaxes(weight, 1, 2), nbr, num, bias, weight_axes="vnk", **kw)
  return gather_gemm(x, weight, nbr, num, bias, weight_axes="vkn", **kw)


def conv_input_grad(g, weight, t_map, t_num, *, plan: MaskedPlan | None = None, config: TileConfig, precision=None,
                    interpret: bool = False, weight_layout: str = "vio"):
  """The input gradient of a convolution: dx[j] = sum_v g[t_map[j, v]] @ W_{V-1-v}^T over the transposed map
  (for a submanifold map, the map itself), W_v [Cin, Cout] as in `conv_forward`.

  weight_layout "vio": read K-contiguous in place. "ovi": straight, or through a [V, Cin, Cout] copy as
  `reads_weight_k_major` picks (the mirror of the forward's rule).
  """
  kw = dict(plan=plan, config=config, precision=precision, interpret=interpret, flip_offsets=True)
  if check_weight_layout(weight_layout) == "vio":
    return gather_gemm(g, weight, t_map, t_num, weight_axes="vnk", **kw)
  if reads_weight_k_major(t_map.shape[0], config, g.dtype):
    return gather_gemm(g, jnp.transpose(weight, (1, 2, 0)), t_map, t_num, weight_axes="vnk", **kw)
  return gather_gemm(g, weight, t_map, t_num, weight_axes="kvn", **kw)


def _gather_gemm_kernel(num_ref, x_ref, w_ref, *refs, num_rows, num_offsets, k_dim, n_dim, block_m, block_n,
                        block_k, split, weight_axes, flip_offsets, masked, skip_empty, has_bias, precision,
                        columns_fastest, swap_operands):
  refs = list(refs)
  o_ref = refs.pop()
  # The masked path reads only the plan (its gathered rows), not the neighbour map.
  nbr_ref = None if masked else refs.pop(0)
  order_ref, offsets_ref, counts_ref, block_rows_ref = (
      (refs.pop(0), refs.pop(0), refs.pop(0), refs.pop(0)) if masked else (None,) * 4)
  bias_ref = refs.pop(0) if has_bias else None
  row_axis, col_axis = (1, 0) if columns_fastest else (0, 1)
  block = pl.program_id(row_axis)
  lanes = block * block_m + jnp.arange(block_m)
  lane_ok = lanes < num_rows
  if masked:
    # Lanes past the last row get an out-of-range row: their stores are masked (GPU) or dropped
    # (interpret mode emulates a masked store with a scatter, where a duplicate row 0 would clobber row 0).
    rows = plgpu.load(order_ref.at[lanes], mask=lane_ok, other=num_rows)
    num_used = plgpu.load(counts_ref.at[block])
  else:
    rows = lanes
    num_used = num_offsets
  row_ok = lane_ok & (rows < num_ref[0])
  cols = pl.program_id(col_axis) * block_n + jnp.arange(block_n)
  col_ok = cols < n_dim
  k_steps = pl.cdiv(k_dim, block_k)
  ks = jnp.arange(block_k)
  # This program's share of the (offset, channel chunk) steps.
  total = num_used * k_steps
  if split > 1:
    per = pl.cdiv(total, split)
    t_start = pl.program_id(2) * per
    t_stop = jnp.minimum(t_start + per, total)
  else:
    t_start, t_stop = 0, total

  def step(t, acc):
    j = lax.div(t, k_steps)
    k0 = lax.rem(t, k_steps) * block_k
    if masked:  # the plan holds the gathered rows: one load away from the loop counter (gemm_plan.py)
      v = plgpu.load(offsets_ref.at[block, j])
      nb = plgpu.load(block_rows_ref.at[block, j, jnp.arange(block_m)])
    else:
      v = j
      nb = plgpu.load(nbr_ref.at[rows, v], mask=row_ok, other=-1)
    has = nb >= 0

    def matmul(acc):
      kk = k0 + ks
      k_ok = kk < k_dim
      src = jnp.where(has, nb, 0)
      a = plgpu.load(x_ref.at[src[:, None], kk[None, :]], mask=has[:, None] & k_ok[None, :], other=0)
      # The [block_k, block_n] tile of W_v, whatever the weight's axis order.
      index = {"v": num_offsets - 1 - v if flip_offsets else v, "k": kk[:, None], "n": cols[None, :]}
      b = plgpu.load(w_ref.at[tuple(index[axis] for axis in weight_axes)], mask=k_ok[:, None] & col_ok[None, :],
                     other=0)
      if swap_operands:  # acc^T += W^T a^T: the weight tile becomes the MMA's left operand (see gather_gemm)
        return mma(b.T, a.T, acc, precision)
      return mma(a, b, acc, precision)

    if skip_empty:
      return lax.cond(jnp.max(has.astype(jnp.int32)) > 0, matmul, lambda acc: acc, acc)
    return matmul(acc)

  acc_shape = (block_n, block_m) if swap_operands else (block_m, block_n)
  acc = lax.fori_loop(t_start, t_stop, step, jnp.zeros(acc_shape, jnp.float32))
  if swap_operands:
    acc = acc.T
  out_ok = lane_ok[:, None] & col_ok[None, :]
  if split > 1:  # float32 partial sums; the wrapper adds them up
    plgpu.store(o_ref.at[pl.program_id(2), rows[:, None], cols[None, :]], acc, mask=out_ok)
    return
  if has_bias:
    bias = plgpu.load(bias_ref.at[cols], mask=col_ok, other=0).astype(jnp.float32)
    acc = jnp.where(row_ok[:, None], acc + bias[None, :], 0.0)
  plgpu.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=out_ok)


@functools.partial(jax.jit, static_argnames=("weight_axes", "flip_offsets", "skip_empty", "config", "precision",
                                             "interpret"))
def gather_gemm(x, weight, nbr, num, bias=None, *, plan: MaskedPlan | None = None, weight_axes: str = "vkn",
                flip_offsets: bool = False, skip_empty: bool = True, config: TileConfig | None = None,
                precision=None, interpret: bool = False):
  """out[i] = sum_v x[nbr[i, v]] @ W_v (+ bias) for i < num, zero rows for i >= num.

  x: [R, K] rows to gather (nbr entries index them; -1 = none).
  weight: W_v for every offset, its axes named by weight_axes, a permutation of "vkn" (offset, reduction,
    output column): "vkn" = [V, K, N] (W_v = weight[v]), "vnk" = [V, N, K] (W_v = weight[v]^T), "nvk" =
    [N, V, K], "kvn" = [K, V, N], ... A K-contiguous read ("..k") is what tensor cores want.
  flip_offsets: W_v is the matrix stored for offset V-1-v (the input gradient's read).
  nbr: int32 [M, V]; num: int32 scalar (rows >= num are written as zeros); bias: [N] or None.
  plan: a `gemm_plan.masked_plan(nbr, num, config.block_m)`: process rows in its order and, per block,
    only the offsets its rows use ("masked" implicit GEMM). None: every block loops over every offset
    ("implicit"), skipping offsets no row of the block uses when skip_empty.
  config.split > 1 splits each block's (offset, channel) reduction over that many programs ("split-K");
    their float32 partial sums are added here.
  config.swap_operands (or `swaps_operands`'s rule): accumulate the transposed product W_v^T x^T, the weight
    tile as the MMA's left operand and the gathered rows as its right one.
  Returns [M, N] in x's dtype, accumulated in float32.
  """
  m, num_offsets = nbr.shape
  k_dim = x.shape[1]
  if sorted(weight_axes) != ["k", "n", "v"] or weight.ndim != 3:
    raise ValueError(f"gather_gemm: weight_axes must order 'v', 'k', 'n' for a 3-D weight, got {weight_axes!r} "
                     f"for shape {weight.shape}")
  dims = dict(zip(weight_axes, weight.shape))
  n_dim = dims["n"]
  if dims["v"] != num_offsets or dims["k"] != k_dim:
    raise ValueError(f"gather_gemm: weight {weight.shape} ({weight_axes}) does not match x {x.shape} and nbr "
                     f"{nbr.shape}")
  if min(m, n_dim, x.shape[0], k_dim) == 0:
    # No row to write or nothing to gather: a kernel over empty refs cannot even be traced, and every product is
    # empty, so the answer is the bias at the valid rows.
    out = jnp.zeros((m, n_dim), jnp.float32) if bias is None else jnp.broadcast_to(bias.astype(jnp.float32),
                                                                                   (m, n_dim))
    return jnp.where((jnp.arange(m) < num)[:, None], out, 0).astype(x.dtype)
  cfg = config or default_config(m, k_dim, n_dim, x.dtype)
  num_blocks = pl.cdiv(m, cfg.block_m)
  if plan is not None and plan.block_counts.shape[0] != num_blocks:
    raise ValueError(f"gather_gemm: the plan was built for another block_m than config.block_m={cfg.block_m}")
  split = cfg.split
  kernel = functools.partial(
      _gather_gemm_kernel, num_rows=m, num_offsets=num_offsets, k_dim=k_dim, n_dim=n_dim, block_m=cfg.block_m,
      block_n=cfg.block_n, block_k=cfg.block_k, split=split, weight_axes=weight_axes, flip_offsets=flip_offsets,
      masked=plan is not None, skip_empty=skip_empty and plan is None, has_bias=bias is not None and split == 1,
      precision=dot_precision(precision, x.dtype), columns_fastest=cfg.columns_fastest,
      swap_operands=swaps_operands(cfg, x.dtype, weight_axes[-1] == "k"))
  num = jnp.reshape(num, (1,)).astype(jnp.int32)
  args = [num, x, weight.astype(x.dtype)]
  # With a plan the kernel does not read nbr, so it is not an operand: a stack of layers sharing one map
  # then does not keep the map alive once the plan is built (inference: V x rows int32 less at the peak).
  args += [plan.order, plan.block_offsets, plan.block_counts, plan.block_rows] if plan is not None else [nbr]
  if bias is not None and split == 1:
    args.append(bias)
  args = same_vma(*args)
  out_shape = (out_struct((m, n_dim), x.dtype, *args) if split == 1 else
               out_struct((split, m, n_dim), jnp.float32, *args))
  out = pl.pallas_call(
      kernel,
      out_shape=out_shape,
      # Grid axis 0 is launched fastest.
      grid=((pl.cdiv(n_dim, cfg.block_n), num_blocks, split) if cfg.columns_fastest else
            (num_blocks, pl.cdiv(n_dim, cfg.block_n), split)),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name="gather_gemm_t" if flip_offsets else "gather_gemm",
  )(*args)
  if split == 1:
    return out
  out = jnp.sum(out, axis=0)
  if bias is not None:
    out = out + bias.astype(jnp.float32)
  return jnp.where((jnp.arange(m) < num[0])[:, None], out, 0).astype(x.dtype)
