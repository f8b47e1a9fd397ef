"""Implicit GEMM with the gather fused in: out[i] = sum_v x[nbr[i, v]] @ W_v (+ bias).

One kernel serves two passes of a convolution: the forward (x the input features, W_v offset v's [Cin, Cout]
matrix) and the input gradient (x the output gradient over the transposed map, W_v offset v's matrix
transposed; over a submanifold map, its own transpose with the offsets reversed, offset V-1-v's:
`flip_offsets`). It reads W_v out of a weight stored in any axis order (`weight_axes`), so both weight layouts
serve both passes; `conv_forward` / `conv_input_grad` pick the read per layout.

The reduction runs over (offset, channel chunk) steps flattened into one loop so that Triton pipelines the
loads across offsets. With a masked plan (`gemm_plan.masked_plan`) a block loops only over the offsets its
rows use; without one, a block skips an offset none of its rows has at run time. `config.split > 1` splits
the reduction across programs (split-K). Tile defaults and rules: gather_gemm_config.py.

Grouped convolutions (`groups` > 1, feature_group_count) run in the same launch: the column blocks of every
group sit side by side on the column grid axis, and a program reads its group's slice of x's channels and
of the weight, so no group loop runs on the host.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.gather_gemm_config import default_config, reads_weight_k_major, swaps_operands
from pallas_kernels.gemm_plan import MaskedPlan
from pallas_kernels.mma import mma
from pallas_kernels.out_struct import same_vma, split_out_struct, sum_split
from pallas_kernels.tiling import TileConfig, dot_precision, split_share
from pallas_kernels.weight_layout import WeightLayout


class GatherGemmOperands(NamedTuple):
  """The kernel's inputs, in the order they are passed (None fields are absent: the kernel gets None)."""

  num: jax.Array  # int32 [1]: valid rows
  x: jax.Array  # [R, K] rows to gather
  weight: jax.Array  # 3-D, axes named by weight_axes
  nbr: jax.Array | None  # int32 [M, V]; None with a plan (the kernel reads the plan's gathered rows instead)
  plan: MaskedPlan | None
  bias: jax.Array | None  # [N]; None without bias or with split-K (the wrapper adds it)


def conv_forward(x, weight, nbr, num, bias=None, *, plan: MaskedPlan | None = None, config: TileConfig,
                 precision=None, interpret: bool = False, weight_layout: WeightLayout | str = WeightLayout.DHWIO,
                 groups: int = 1):
  """The forward pass of a convolution, out[i] = sum_v x[nbr[i, v]] @ W_v (+ bias), W_v [Cin, Cout].

  weight: the flattened weight in `weight_layout` ([V, Cin/groups, Cout] or [Cout, V, Cin/groups]). ODHWI is
  read K-contiguous in place; DHWIO straight or through a [V, Cout, Cin/groups] copy as
  `reads_weight_k_major` picks.
  """
  kw = dict(plan=plan, config=config, precision=precision, interpret=interpret, groups=groups)
  if WeightLayout.of(weight_layout).cout_major:
    return gather_gemm(x, weight, nbr, num, bias, weight_axes="nvk", **kw)
  if reads_weight_k_major(nbr.shape[0], config, x.dtype):
    return gather_gemm(x, jnp.swapaxes(weight, 1, 2), nbr, num, bias, weight_axes="vnk", **kw)
  return gather_gemm(x, weight, nbr, num, bias, weight_axes="vkn", **kw)


def conv_input_grad(g, weight, t_map, t_num, *, plan: MaskedPlan | None = None, config: TileConfig, precision=None,
                    interpret: bool = False, weight_layout: WeightLayout | str = WeightLayout.DHWIO,
                    groups: int = 1, flip_offsets: bool = True):
  """The input gradient of a convolution: dx[j] = sum_v g[t_map[j, v]] @ W_{V-1-v}^T over a submanifold map
  (flip_offsets: its own transpose with the offsets reversed), or sum_v g[t_map[j, v]] @ W_v^T over a transposed
  map (t_map[j, v] = i iff nbr[i, v] = j; flip_offsets=False), W_v [Cin, Cout] as in `conv_forward`.

  DHWIO is read K-contiguous in place; ODHWI straight or through a [V, Cin, Cout] copy as
  `reads_weight_k_major` picks (the mirror of the forward's rule).
  """
  kw = dict(plan=plan, config=config, precision=precision, interpret=interpret, flip_offsets=flip_offsets,
            groups=groups, name="gather_gemm_t")
  if not WeightLayout.of(weight_layout).cout_major:
    return gather_gemm(g, weight, t_map, t_num, weight_axes="vnk", **kw)
  if reads_weight_k_major(t_map.shape[0], config, g.dtype):
    return gather_gemm(g, jnp.transpose(weight, (1, 2, 0)), t_map, t_num, weight_axes="vnk", **kw)
  return gather_gemm(g, weight, t_map, t_num, weight_axes="kvn", **kw)


def grouped_weight_dims(op: str, x_shape, nbr_shape, weight_shape, weight_axes: str, groups: int) -> tuple[str, int]:
  """(the weight axis spanning every group, "k" or "n"; the output width N) of a map-GEMM of x [R, K] with a 3-D
  weight whose axes `weight_axes` names, in `groups` feature groups: [V, K/G, N] shares "n" (a forward),
  [V, K, N/G] shares "k" (an input gradient); with one group both are whole ("n"). ValueError if it fits
  neither."""
  dims = dict(zip(weight_axes, weight_shape))
  k_dim = x_shape[1]
  if dims["v"] == nbr_shape[1] and groups == 1 and dims["k"] == k_dim:
    return "n", dims["n"]
  if dims["v"] == nbr_shape[1] and groups > 1 and k_dim % groups == 0:
    if dims["k"] == k_dim:
      return "k", dims["n"] * groups
    if dims["k"] * groups == k_dim and dims["n"] % groups == 0:
      return "n", dims["n"]
  raise ValueError(f"{op}: weight {tuple(weight_shape)} ({weight_axes}) does not match x {tuple(x_shape)} and nbr "
                   f"{tuple(nbr_shape)}" + (f" in {groups} groups" if groups > 1 else ""))


def _gather_gemm_kernel(ops: GatherGemmOperands, o_ref, *, num_rows, num_offsets, k_dim, n_dim, block_m, block_n,
                        block_k, split, weight_axes, flip_offsets, skip_empty, precision, columns_fastest,
                        swap_operands, groups=1, weight_shared_axis="n"):
  # k_dim, n_dim: one group's reduction and output widths. weight_shared_axis: the weight axis ("k" or "n")
  # that spans every group's channels (the convolution's Cout), the other holding one group's.
  masked = ops.plan is not None
  row_axis, col_axis = (1, 0) if columns_fastest else (0, 1)
  block = pl.program_id(row_axis)
  lanes = block * block_m + jnp.arange(block_m, dtype=jnp.int32)
  lane_ok = lanes < num_rows
  if masked:
    # Lanes past the last row get an out-of-range row, so interpret mode's emulated masked store (a scatter)
    # cannot clobber row 0.
    rows = plgpu.load(ops.plan.order.at[lanes], mask=lane_ok, other=num_rows)
    num_used = plgpu.load(ops.plan.block_counts.at[block])
  else:
    rows = lanes
    num_used = num_offsets
  row_ok = lane_ok & (rows < ops.num[0])
  if groups > 1:  # column program = (group, column block within the group)
    col_blocks = pl.cdiv(n_dim, block_n)
    group = lax.div(pl.program_id(col_axis), jnp.int32(col_blocks))
    group_cols = (lax.rem(pl.program_id(col_axis), jnp.int32(col_blocks)) * block_n
                  + jnp.arange(block_n, dtype=jnp.int32))
    col_ok = group_cols < n_dim
    cols = group * n_dim + group_cols
  else:
    cols = pl.program_id(col_axis) * block_n + jnp.arange(block_n, dtype=jnp.int32)
    col_ok = cols < n_dim
  k_steps = pl.cdiv(k_dim, block_k)
  ks = jnp.arange(block_k, dtype=jnp.int32)
  # This program's share of the (offset, channel chunk) steps.
  total = num_used * k_steps
  t_start, t_stop = split_share(total, split)

  def step(t, acc):
    j = lax.div(t, jnp.int32(k_steps))
    k0 = lax.rem(t, jnp.int32(k_steps)) * block_k
    if masked:  # the plan holds the gathered rows: one load away from the loop counter (gemm_plan.py)
      v = plgpu.load(ops.plan.block_offsets.at[block, j])
      nb = plgpu.load(ops.plan.block_rows.at[block, j, jnp.arange(block_m, dtype=jnp.int32)])
    else:
      v = j
      nb = plgpu.load(ops.nbr.at[rows, v], mask=row_ok, other=-1)
    has = nb >= 0

    def matmul(acc):
      kk = k0 + ks
      k_ok = kk < k_dim
      src = jnp.where(has, nb, 0)
      x_cols = kk if groups == 1 else group * k_dim + kk
      a = plgpu.load(ops.x.at[src[:, None], x_cols[None, :]], mask=has[:, None] & k_ok[None, :], other=0)
      # The [block_k, block_n] tile of W_v, whatever the weight's axis order.
      w_k = x_cols if weight_shared_axis == "k" else kk
      w_n = cols if weight_shared_axis == "n" else group_cols
      index = {"v": num_offsets - 1 - v if flip_offsets else v, "k": w_k[:, None], "n": w_n[None, :]}
      b = plgpu.load(ops.weight.at[tuple(index[axis] for axis in weight_axes)],
                     mask=k_ok[:, None] & col_ok[None, :], other=0)
      if swap_operands:  # acc^T += W^T a^T: the weight tile becomes the MMA's left operand
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
  if ops.bias is not None:
    bias = plgpu.load(ops.bias.at[cols], mask=col_ok, other=0).astype(jnp.float32)
    acc = jnp.where(row_ok[:, None], acc + bias[None, :], 0.0)
  plgpu.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=out_ok)


@functools.partial(jax.jit, static_argnames=("weight_axes", "flip_offsets", "skip_empty", "config", "precision",
                                             "interpret", "groups", "name"))
def gather_gemm(x, weight, nbr, num, bias=None, *, plan: MaskedPlan | None = None, weight_axes: str = "vkn",
                flip_offsets: bool = False, skip_empty: bool = True, config: TileConfig | None = None,
                precision=None, interpret: bool = False, groups: int = 1, name: str = "gather_gemm"):
  """out[i] = sum_v x[nbr[i, v]] @ W_v (+ bias) for i < num, zero rows for i >= num.

  x: [R, K] rows to gather (nbr entries index them; -1 = none).
  weight: W_v for every offset, its axes named by weight_axes, a permutation of "vkn" (offset, reduction,
    output column): "vkn" = [V, K, N] (W_v = weight[v]), "vnk" = [V, N, K] (W_v = weight[v]^T), "nvk" =
    [N, V, K], ... A K-contiguous read ("..k") is what tensor cores want.
  flip_offsets: W_v is the matrix stored for offset V-1-v (the input gradient's read of a submanifold map).
  nbr: int32 [M, V]; num: int32 scalar (rows >= num are written as zeros); bias: [N] or None.
  plan: a `gemm_plan.masked_plan(nbr, num, config.block_m)`: rows in its order, each block looping only over
    the offsets its rows use. None: every block loops over every offset (skipping unused ones if skip_empty).
  config: tiles (default `gather_gemm_config.default_config`); split > 1 adds float32 partial sums here;
    swap_operands as `gather_gemm_config.swaps_operands`.
  groups: feature groups: output columns [j N/G, (j+1) N/G) sum over x's columns [j K/G, (j+1) K/G) only. The
    weight then holds one group's K and all N ([V, K/G, N], the forward's) or all K and one group's N
    ([V, K, N/G], the input gradient's), told apart by its shape; tiles cover one group's K and N.
  name: the launch's name in profiles ("gather_gemm_t" for input gradients).
  Returns [M, N] in x's dtype, accumulated in float32.
  """
  m, num_offsets = nbr.shape
  k_dim = x.shape[1]
  if sorted(weight_axes) != ["k", "n", "v"] or weight.ndim != 3:
    raise ValueError(f"gather_gemm: weight_axes must order 'v', 'k', 'n' for a 3-D weight, got {weight_axes!r} "
                     f"for shape {weight.shape}")
  shared_axis, n_dim = grouped_weight_dims("gather_gemm", x.shape, nbr.shape, weight.shape, weight_axes, groups)
  if min(m, n_dim, x.shape[0], k_dim) == 0:
    # Nothing to gather or no row to write (and a kernel over empty refs cannot be traced): the bias at the
    # valid rows.
    out = jnp.zeros((m, n_dim), jnp.float32) if bias is None else jnp.broadcast_to(bias.astype(jnp.float32),
                                                                                   (m, n_dim))
    return jnp.where((jnp.arange(m, dtype=jnp.int32) < num)[:, None], out, 0).astype(x.dtype)
  k_group, n_group = k_dim // groups, n_dim // groups
  cfg = config or default_config(m, k_group, n_group, x.dtype)
  num_blocks = pl.cdiv(m, cfg.block_m)
  if plan is not None and plan.block_counts.shape[0] != num_blocks:
    raise ValueError(f"gather_gemm: the plan was built for another block_m than config.block_m={cfg.block_m}")
  split = cfg.split
  kernel = functools.partial(
      _gather_gemm_kernel, num_rows=m, num_offsets=num_offsets, k_dim=k_group, n_dim=n_group, block_m=cfg.block_m,
      block_n=cfg.block_n, block_k=cfg.block_k, split=split, weight_axes=weight_axes, flip_offsets=flip_offsets,
      skip_empty=skip_empty and plan is None, precision=dot_precision(precision, x.dtype),
      columns_fastest=cfg.columns_fastest, swap_operands=swaps_operands(cfg, x.dtype, weight_axes[-1] == "k"),
      **(dict(groups=groups, weight_shared_axis=shared_axis) if groups > 1 else {}))
  # With a plan the kernel does not read nbr, so it is no operand: layers sharing one map then do not keep
  # the map alive once the plan is built.
  num = jnp.reshape(num, (1,)).astype(jnp.int32)
  ops = GatherGemmOperands(num, x, weight.astype(x.dtype),
                           nbr if plan is None else None, plan, bias if split == 1 else None)
  leaves, tree = jax.tree.flatten(ops)
  ops = jax.tree.unflatten(tree, same_vma(*leaves))
  out = pl.pallas_call(
      kernel,
      out_shape=split_out_struct(m, n_dim, x.dtype, split, *leaves),
      # Grid axis 0 is launched fastest.
      grid=((groups * pl.cdiv(n_group, cfg.block_n), num_blocks, split) if cfg.columns_fastest else
            (num_blocks, groups * pl.cdiv(n_group, cfg.block_n), split)),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name=name,
  )(ops)
  return sum_split(out, bias, num, x.dtype)
