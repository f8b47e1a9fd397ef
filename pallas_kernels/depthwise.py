"""Gather-multiply-accumulate for narrow feature groups (depthwise convolutions): out[i] = sum_v x[nbr[i, v]] W_v
per group, on the CUDA cores.

With Cin/groups or Cout/groups under a tensor-core tile (16), a GEMM would mostly multiply padding; the pass is
instead bound by the gathered rows' bandwidth. A program owns block_m rows x block_n output channels, loops
over the offsets and, per offset, over its group's R reduction channels (R = 1 for a depthwise convolution),
and accumulates x[nbr[i, v], group(n) R + r] * W_v[r, n] elementwise in float32. The products are full
float32 whatever the matmul precision asks for.

One kernel serves the forward (R = Cin/G, output width Cout) and the input gradient (over the transposed map,
`flip_offsets`, R = Cout/G, output width Cin), reading the weight in place in either layout (`weight_axes`, as
gather_gemm). `split > 1` cuts the offsets into pieces whose float32 partial sums are added afterwards.

The weight gradient dW_v[r, n] = sum_i x[nbr[i, v], group(n) R + r] dy[i, n] runs one program per (offset,
reduction channel, channel block, piece of the rows): each writes the float32 sum over its rows, and the pieces
are added in a second step (no atomics). Tile defaults: depthwise_config.py.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.depthwise_config import default_config
from pallas_kernels.gather_gemm import grouped_weight_dims
from pallas_kernels.out_struct import out_struct, same_vma, split_out_struct, sum_split
from pallas_kernels.tiling import TileConfig, int32_cdiv, split_share
from pallas_kernels.weight_layout import WeightLayout


class DepthwiseOperands(NamedTuple):
  """The kernels' inputs, in the order they are passed (None fields are absent: the kernel gets None)."""

  num: jax.Array  # int32 [1]: valid rows (of the output; of dy for the weight gradient)
  x: jax.Array  # [R_x, K] rows to gather
  nbr: jax.Array  # int32 [M, V]
  weight: jax.Array | None  # forward / input gradient: 3-D, axes named by weight_axes
  dy: jax.Array | None  # weight gradient: [M, N]
  bias: jax.Array | None  # [N]; forward without split only


def _group_columns(cols, n_group: int, k_group: int):
  """(group of each output column, its first reduction column in x)."""
  group = cols if n_group == 1 else lax.div(cols, jnp.int32(n_group))
  return group, group if k_group == 1 else group * k_group


def _mac_kernel(ops: DepthwiseOperands, o_ref, *, num_rows, num_offsets, k_group, n_group, n_dim, block_m, block_n,
                split, weight_axes, weight_shared_axis, flip_offsets):
  rows = pl.program_id(0) * block_m + jnp.arange(block_m, dtype=jnp.int32)
  row_ok = (rows < num_rows) & (rows < ops.num[0])
  cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
  col_ok = cols < n_dim
  group, x_base = _group_columns(cols, n_group, k_group)
  # The weight's n index: the output column, or its place within its group where the weight holds one group's.
  w_n = cols if weight_shared_axis == "n" else cols - group * n_group
  v_start, v_stop = split_share(num_offsets, split)

  def offset_step(v, acc):
    nb = plgpu.load(ops.nbr.at[rows, v], mask=row_ok, other=-1)
    has = nb >= 0
    src = jnp.where(has, nb, 0)
    mask = has[:, None] & col_ok[None, :]
    stored_v = num_offsets - 1 - v if flip_offsets else v

    def reduce_step(r, acc):
      a = plgpu.load(ops.x.at[src[:, None], (x_base + r)[None, :]], mask=mask, other=0)
      index = {"v": stored_v, "k": x_base + r if weight_shared_axis == "k" else r, "n": w_n}
      w = plgpu.load(ops.weight.at[tuple(index[axis] for axis in weight_axes)], mask=col_ok, other=0)
      return acc + a.astype(jnp.float32) * w.astype(jnp.float32)[None, :]

    def mac(acc):
      if k_group == 1:
        return reduce_step(0, acc)
      return lax.fori_loop(jnp.int32(0), jnp.int32(k_group), reduce_step, acc)

    return lax.cond(jnp.max(has.astype(jnp.int32)) > 0, mac, lambda acc: acc, acc)

  acc = lax.fori_loop(v_start, v_stop, offset_step, jnp.zeros((block_m, block_n), jnp.float32))
  out_ok = (rows < num_rows)[:, None] & col_ok[None, :]
  if split > 1:  # float32 partial sums; the wrapper adds them up
    plgpu.store(o_ref.at[pl.program_id(2), rows[:, None], cols[None, :]], acc, mask=out_ok)
    return
  if ops.bias is not None:
    acc = acc + plgpu.load(ops.bias.at[cols], mask=col_ok, other=0).astype(jnp.float32)[None, :]
  acc = jnp.where(row_ok[:, None], acc, 0.0)
  plgpu.store(o_ref.at[rows[:, None], cols[None, :]], acc.astype(o_ref.dtype), mask=out_ok)


@functools.partial(jax.jit, static_argnames=("weight_axes", "flip_offsets", "groups", "config", "interpret", "name"))
def group_mac(x, weight, nbr, num, bias=None, *, weight_axes: str = "vkn", flip_offsets: bool = False,
              groups: int = 1, config: TileConfig | None = None, interpret: bool = False, name: str = "depthwise"):
  """out[i, n] = sum_v sum_r x[nbr[i, v], group(n) K/G + r] W_v[r, n] (+ bias) for i < num, zero rows after.

  x: [R_x, K]; nbr: int32 [M, V] (-1 = none); num: int32 scalar; bias: [N] or None.
  weight: W_v for every offset, axes named by weight_axes (a permutation of "vkn", as gather_gemm), holding one
    group's K and all N ([V, K/G, N], a forward) or all K and one group's N ([V, K, N/G], an input gradient).
  flip_offsets: W_v is the matrix stored for offset V-1-v (the input gradient's read of a submanifold map).
  groups: feature groups G; output column n belongs to group n // (N/G).
  name: the launch's name in profiles ("depthwise_t" for input gradients).
  config: block_m rows x block_n columns per program; split > 1 splits the offsets (float32 partial sums).
  Returns [M, N] in x's dtype, accumulated in float32.
  """
  m, num_offsets = nbr.shape
  if sorted(weight_axes) != ["k", "n", "v"] or weight.ndim != 3:
    raise ValueError(f"group_mac: weight_axes must order 'v', 'k', 'n' for a 3-D weight, got {weight_axes!r} "
                     f"for shape {weight.shape}")
  shared_axis, n_dim = grouped_weight_dims("group_mac", x.shape, nbr.shape, weight.shape, weight_axes, groups)
  k_dim = x.shape[1]
  if min(m, n_dim, x.shape[0], k_dim) == 0:  # nothing to gather (an empty ref cannot be traced): the bias
    out = jnp.zeros((m, n_dim), jnp.float32) if bias is None else jnp.broadcast_to(bias.astype(jnp.float32),
                                                                                   (m, n_dim))
    return jnp.where((jnp.arange(m, dtype=jnp.int32) < num)[:, None], out, 0).astype(x.dtype)
  cfg = config or default_config("forward", m, k_dim, n_dim, num_offsets, groups, x.dtype)
  split = cfg.split
  kernel = functools.partial(
      _mac_kernel, num_rows=m, num_offsets=num_offsets, k_group=k_dim // groups, n_group=n_dim // groups,
      n_dim=n_dim, block_m=cfg.block_m, block_n=cfg.block_n, split=split, weight_axes=weight_axes,
      weight_shared_axis=shared_axis, flip_offsets=flip_offsets)
  num = jnp.reshape(num, (1,)).astype(jnp.int32)
  ops = DepthwiseOperands(num, x, nbr, weight.astype(x.dtype), None, bias if split == 1 else None)
  leaves, tree = jax.tree.flatten(ops)
  ops = jax.tree.unflatten(tree, same_vma(*leaves))
  out = pl.pallas_call(
      kernel,
      out_shape=split_out_struct(m, n_dim, x.dtype, split, *leaves),
      grid=(pl.cdiv(m, cfg.block_m), pl.cdiv(n_dim, cfg.block_n), split),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name=name,
  )(ops)
  return sum_split(out, bias, num, x.dtype)


def conv_forward(x, weight, nbr, num, bias=None, *, config: TileConfig, interpret: bool = False,
                 weight_layout: WeightLayout | str = WeightLayout.DHWIO, groups: int = 1):
  """A grouped convolution's forward: the flattened weight ([V, Cin/G, Cout] or [Cout, V, Cin/G]) read in place."""
  axes = WeightLayout.of(weight_layout).flat_axes
  return group_mac(x, weight, nbr, num, bias, weight_axes=axes, groups=groups, config=config, interpret=interpret)


def conv_input_grad(g, weight, t_map, t_num, *, config: TileConfig, interpret: bool = False,
                    weight_layout: WeightLayout | str = WeightLayout.DHWIO, groups: int = 1,
                    flip_offsets: bool = True):
  """A grouped convolution's input gradient over the map t_map: the weight read in place, its Cin/G axis as the
  output columns within a group and its Cout axis as the reduction. flip_offsets: offset v of t_map reads the
  weight of offset V-1-v (a submanifold map, its own transpose with the offsets reversed), else offset v's (a
  transposed map, t_map[j, v] = i iff nbr[i, v] = j)."""
  axes = "kvn" if WeightLayout.of(weight_layout).cout_major else "vnk"
  return group_mac(g, weight, t_map, t_num, weight_axes=axes, flip_offsets=flip_offsets, groups=groups,
                   config=config, interpret=interpret, name="depthwise_t")


def _weight_grad_kernel(ops: DepthwiseOperands, o_ref, *, num_rows, k_group, n_group, n_dim, block_m, block_n,
                        split, cout_major):
  if k_group == 1:
    v, r = pl.program_id(0), 0
  else:
    v, r = lax.div(pl.program_id(0), jnp.int32(k_group)), lax.rem(pl.program_id(0), jnp.int32(k_group))
  cols = pl.program_id(1) * block_n + jnp.arange(block_n, dtype=jnp.int32)
  col_ok = cols < n_dim
  _, x_base = _group_columns(cols, n_group, k_group)
  x_cols = x_base + r
  s = pl.program_id(2)
  per = pl.cdiv(pl.cdiv(num_rows, split), block_m) * block_m
  start = s * per
  stop = jnp.minimum(jnp.minimum(start + per, num_rows), ops.num[0])
  lanes = jnp.arange(block_m, dtype=jnp.int32)

  def step(t, acc):
    rows = start + t * block_m + lanes
    nb = plgpu.load(ops.nbr.at[rows, v], mask=rows < stop, other=-1)
    has = nb >= 0

    def mac(acc):
      mask = has[:, None] & col_ok[None, :]
      a = plgpu.load(ops.x.at[jnp.where(has, nb, 0)[:, None], x_cols[None, :]], mask=mask, other=0)
      b = plgpu.load(ops.dy.at[rows[:, None], cols[None, :]], mask=mask, other=0)
      return acc + a.astype(jnp.float32) * b.astype(jnp.float32)

    return lax.cond(jnp.max(has.astype(jnp.int32)) > 0, mac, lambda acc: acc, acc)

  steps = int32_cdiv(jnp.maximum(stop - start, 0), block_m)
  acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
  partial = jnp.sum(acc, axis=0)
  where = (s, cols, v, r) if cout_major else (s, v, r, cols)
  plgpu.store(o_ref.at[where], partial, mask=col_ok)


@functools.partial(jax.jit, static_argnames=("groups", "config", "interpret", "out_dtype", "weight_layout"))
def weight_grad(x, dy, nbr, num, *, groups: int = 1, config: TileConfig | None = None, interpret: bool = False,
                out_dtype=None, weight_layout: WeightLayout | str = WeightLayout.DHWIO):
  """dW of a grouped convolution: dW_v[r, n] = sum over rows i < num with nbr[i, v] >= 0 of
  x[nbr[i, v], group(n) Cin/G + r] dy[i, n], as [V, Cin/G, Cout] (DHWIO) or [Cout, V, Cin/G] (ODHWI).

  config.split: pieces of the rows, each program's float32 sum written apart and the pieces added afterwards.
  Returns out_dtype (default x.dtype).
  """
  cout_major = WeightLayout.of(weight_layout).cout_major
  m, num_offsets = nbr.shape
  cin, cout = x.shape[1], dy.shape[1]
  if cin % groups or cout % groups or dy.shape[0] != m:
    raise ValueError(f"depthwise.weight_grad: x {x.shape}, dy {dy.shape} and nbr {nbr.shape} do not match in "
                     f"{groups} groups")
  k_group = cin // groups
  shape = (cout, num_offsets, k_group) if cout_major else (num_offsets, k_group, cout)
  out_dtype = jnp.dtype(out_dtype or x.dtype)
  if min(m, x.shape[0], cin, cout) == 0:
    return jnp.zeros(shape, out_dtype)
  cfg = config or default_config("weight_grad", m, cin, cout, num_offsets, groups, x.dtype)
  kernel = functools.partial(_weight_grad_kernel, num_rows=m, k_group=k_group, n_group=cout // groups, n_dim=cout,
                             block_m=cfg.block_m, block_n=cfg.block_n, split=cfg.split, cout_major=cout_major)
  num = jnp.reshape(num, (1,)).astype(jnp.int32)
  ops = DepthwiseOperands(num, x, nbr, None, dy.astype(x.dtype), None)
  leaves, tree = jax.tree.flatten(ops)
  ops = jax.tree.unflatten(tree, same_vma(*leaves))
  partial = pl.pallas_call(
      kernel,
      out_shape=out_struct((cfg.split,) + shape, jnp.float32, *leaves),
      grid=(num_offsets * k_group, pl.cdiv(cout, cfg.block_n), cfg.split),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name="depthwise_weight_grad",
  )(ops)
  return jnp.sum(partial, axis=0).astype(out_dtype)
