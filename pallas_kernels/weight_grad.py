"""Weight gradient of a submanifold convolution: a gather-gather GEMM over sites.

dW[v] = sum_i x[nbr[i, v]]^T dy[i] over the sites i that have a neighbour at offset v.

Programs tile (offset, Cin block, Cout block) and, with `split > 1`, also cut the site range into
`split` pieces whose float32 partial sums are added afterwards: with small channel counts the
(offset, Cin, Cout) tiles alone are too few to fill the GPU.

With pair lists the offsets' lengths differ a lot (on a surface the centre offset has every site, a corner
one a fraction), yet every offset gets the same `split` programs. `TileConfig.balanced` instead cuts all
offsets' pairs together into equal chunks (`balanced_work`), so programs get equal shares: each program
takes one chunk of one offset, and the chunks' partial sums are added per offset afterwards. Both ways run
the same loop; they differ only in which list entries [start, stop) of which offset a program takes.

Both operand tiles are [sites, channels] (MN-major), which Hopper's TF32 MMA cannot take without restaging,
so float32 inputs at TF32 precision run as three bf16 products of hi/lo splits, x_hi dy_hi + x_hi dy_lo +
x_lo dy_hi (about 1e-5 relative error instead of TF32's 3e-4; measurements in docs/perf_notes.md).
Grouped convolutions (`groups` > 1): dW_v [Cin/G, Cout] holds every group's [Cin/G, Cout/G] block side by
side; the Cout tile axis of the grid runs over (group, Cout block within the group), and a program reads its
group's channels of x and dy.
Tile defaults and candidates: weight_grad_config.py.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax import lax

from pallas_kernels.gemm_plan import PairLists
from pallas_kernels.out_struct import out_struct, same_vma
from pallas_kernels.mma import mma
from pallas_kernels.tiling import TileConfig, dot_precision, int32_cdiv
from pallas_kernels.weight_grad_config import default_config
from pallas_kernels.weight_layout import WeightLayout


class WeightGradOperands(NamedTuple):
  """The kernel's inputs, in the order they are passed (None fields are absent: the kernel gets None)."""

  x: jax.Array  # [R, Cin] (float32 with bf16 products: its bf16 high part)
  dy: jax.Array  # [M, Cout]
  nbr: jax.Array | None  # int32 [M, V]; None with pair lists
  x_lo: jax.Array | None  # bf16 low parts (float32 as bf16 products only)
  dy_lo: jax.Array | None
  pairs: PairLists | None
  work: "WorkList | None"  # balanced configs only


class WorkList(NamedTuple):
  """The balanced weight gradient's work items: item w sums list entries [start[w], stop[w]) of offset[w]."""

  offset: jax.Array  # int32 [W], non-decreasing
  start: jax.Array  # int32 [W]
  stop: jax.Array  # int32 [W]; unused items have start == stop (they add a zero tile)


def balanced_work(counts: jax.Array, split: int, block_k: int) -> WorkList:
  """Cuts the pair lists (counts[v] entries of offset v) into at most W = V * split + V pieces of about one size.

  With chunk = ceil(total / (V * split)) rounded up to a multiple of block_k (at least block_k), offset v
  takes n_v = ceil(counts[v] / chunk) consecutive items. These always fit in W: ceil(c / chunk) < c / chunk + 1
  and chunk >= total / (V * split), so
    sum_v n_v < total / chunk + V <= V * split + V = W.
  The n_v items then share offset v's entries evenly, in pieces of ceil(counts[v] / n_v) rounded up to a
  multiple of block_k (aligned loads): a piece is at most one chunk, and no item is left a sliver of a tail.
  Built with XLA ops from the run-time counts (W is static; the chunk is a traced value).
  """
  v = counts.shape[0]
  items = v * split
  counts = counts.astype(jnp.int32)
  total = jnp.sum(counts, dtype=jnp.int32)
  # ceil(ceil(total / items) / block_k) == ceil(total / (items * block_k)); at least one block when total is 0.
  chunk = jnp.maximum(-(-total // (items * block_k)), 1) * block_k
  per = -(-counts // chunk)  # items of each offset
  piece = -(-counts // jnp.maximum(per * block_k, 1)) * block_k  # <= chunk, so (per - 1) * piece < counts
  ends = jnp.cumsum(per, dtype=jnp.int32)
  w = jnp.arange(items + v, dtype=jnp.int32)
  offset = jnp.searchsorted(ends, w, side="right").astype(jnp.int32)  # V past the last used item
  used = offset < v
  offset = jnp.minimum(offset, v - 1)
  start = (w - (ends[offset] - per[offset])) * piece[offset]
  stop = jnp.minimum(start + piece[offset], counts[offset])
  return WorkList(offset, jnp.where(used, start, 0), jnp.where(used, stop, 0))


def _weight_grad_kernel(ops: WeightGradOperands, o_ref, *, mirrored, split, num_rows, num_offsets, cin, cout,
                        block_m, block_n, block_k, precision, cout_major, groups=1):
  # cin, cout: one group's channels.
  use_pairs, balanced, bf16_split = ops.pairs is not None, ops.work is not None, ops.x_lo is not None
  ci = pl.program_id(1) * block_m + jnp.arange(block_m, dtype=jnp.int32)
  if groups > 1:  # Cout program = (group, Cout block within the group)
    co_blocks = pl.cdiv(cout, block_n)
    group = lax.div(pl.program_id(2), jnp.int32(co_blocks))
    co = lax.rem(pl.program_id(2), jnp.int32(co_blocks)) * block_n + jnp.arange(block_n, dtype=jnp.int32)
  else:
    co = pl.program_id(2) * block_n + jnp.arange(block_n, dtype=jnp.int32)
  ci_ok = ci < cin
  co_ok = co < cout
  # The columns of x and dy (and of dW's Cout axis) this program reads and writes.
  x_ci, dy_co = (ci, co) if groups == 1 else (group * cin + ci, group * cout + co)
  # Rows (or, with pair lists, list entries) [start, stop) of offset v belong to this program, whose
  # partial sum goes to o_ref[out].
  if balanced:  # one work item of balanced_work
    out = pl.program_id(0)
    v, start, stop = (plgpu.load(r.at[out]) for r in ops.work)
  else:  # piece s of `split` equal pieces of offset v
    v, s = pl.program_id(0), pl.program_id(3)
    out = s * num_offsets + v
    length = plgpu.load(ops.pairs.counts.at[v]) if use_pairs else num_rows
    per = int32_cdiv(int32_cdiv(length, split), block_k) * block_k
    start = s * per
    stop = jnp.minimum(start + per, length)
  steps = int32_cdiv(jnp.maximum(stop - start, 0), block_k)
  rk = jnp.arange(block_k, dtype=jnp.int32)
  if mirrored:  # offset v's pairs are offset V-1-v's with the two rows swapped (PairLists)
    stored = jnp.minimum(v, num_offsets - 1 - v)
    swap = v != stored

  def load_pairs(idx):
    if not mirrored:
      return (plgpu.load(ops.pairs.rows.at[v, idx], mask=idx < stop, other=0),
              plgpu.load(ops.pairs.sources.at[v, idx], mask=idx < stop, other=-1))
    listed = idx < stop
    first = plgpu.load(ops.pairs.rows.at[stored, idx], mask=listed, other=0)
    second = plgpu.load(ops.pairs.sources.at[stored, idx], mask=listed, other=0)
    return (jnp.where(listed, jnp.where(swap, second, first), 0),
            jnp.where(listed, jnp.where(swap, first, second), -1))

  def step(t, acc):
    idx = start + t * block_k + rk
    if use_pairs:  # both loads one indirection away from the loop counter (see gemm_plan.py)
      rows, nb = load_pairs(idx)
    else:
      rows = idx
      nb = plgpu.load(ops.nbr.at[rows, v], mask=rows < stop, other=-1)
    has = nb >= 0
    src = jnp.where(has, nb, 0)
    a_mask = has[:, None] & ci_ok[None, :]
    b_mask = has[:, None] & co_ok[None, :]

    def matmul(acc):
      a = plgpu.load(ops.x.at[src[:, None], x_ci[None, :]], mask=a_mask, other=0)
      b = plgpu.load(ops.dy.at[rows[:, None], dy_co[None, :]], mask=b_mask, other=0)
      acc = mma(a.T, b, acc, precision)
      if bf16_split:
        a_lo = plgpu.load(ops.x_lo.at[src[:, None], x_ci[None, :]], mask=a_mask, other=0)
        b_lo = plgpu.load(ops.dy_lo.at[rows[:, None], dy_co[None, :]], mask=b_mask, other=0)
        acc = mma(a.T, b_lo, acc, precision)
        acc = mma(a_lo.T, b, acc, precision)
      return acc

    if use_pairs:  # every listed row has a neighbour at v
      return matmul(acc)
    return lax.cond(jnp.max(has.astype(jnp.int32)) > 0, matmul, lambda acc: acc, acc)

  acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
  if cout_major:  # partials [.., Cout, .., Cin]: the ODHWI weight's own layout, no transpose afterwards
    where = (out, dy_co[None, :], ci[:, None]) if balanced else (s, dy_co[None, :], v, ci[:, None])
  else:
    where = (out, ci[:, None], dy_co[None, :])
  # Float32 partial sums, or (one piece per offset) the gradient itself in its final dtype.
  plgpu.store(o_ref.at[where], acc.astype(o_ref.dtype), mask=ci_ok[:, None] & co_ok[None, :])


def _sum_by_offset(partial: jax.Array, offset: jax.Array, num_offsets: int, cout_major: bool = False) -> jax.Array:
  """sum_w [offset[w] == v] partial[w], as a product with a one-hot matrix rather than a segment_sum: XLA's
  GPU scatter-add adds in a run-dependent order, and the weight gradient should not change between runs.
  (Exact: every product is by 0 or 1; a non-finite partial would spread to every offset, as NaN.)"""
  onehot = jax.nn.one_hot(offset, num_offsets, dtype=jnp.float32)
  if cout_major:  # partial [W, Cout, Cin] -> [Cout, V, Cin]
    return jnp.einsum("wv,wnk->nvk", onehot, partial, precision=lax.Precision.HIGHEST)
  return jnp.einsum("wv,wkn->vkn", onehot, partial, precision=lax.Precision.HIGHEST)


def _split_bf16(a):
  """a (float32) = hi + lo + O(2^-16 |a|), hi and lo in bfloat16.

  hi keeps a's top 16 bits (a bit mask, so exact in bf16). A plain `a.astype(bf16)` round trip would not
  do: XLA's GPU simplifier may drop an f32 -> bf16 -> f32 pair (excess precision allowed), making lo zero
  (seen on an H200: 2.3e-3 error, bf16's).
  """
  bits = jax.lax.bitcast_convert_type(a, jnp.uint32) & jnp.uint32(0xFFFF0000)
  hi = jax.lax.bitcast_convert_type(bits, jnp.float32)
  return hi.astype(jnp.bfloat16), (a - hi).astype(jnp.bfloat16)


def uses_bf16_split(dtype, precision) -> bool:
  """Whether a float32 weight gradient runs as three bf16 products (TF32-or-better precision requested)."""
  return jnp.dtype(dtype) == jnp.float32 and dot_precision(precision, dtype) in (lax.Precision.DEFAULT,
                                                                               lax.Precision.HIGH)


@functools.partial(jax.jit, static_argnames=("config", "precision", "interpret", "out_dtype", "weight_layout",
                                             "groups"))
def weight_grad(x, dy, nbr, *, pairs: PairLists | None = None, config: TileConfig | None = None, precision=None,
                interpret: bool = False, out_dtype=None, weight_layout: WeightLayout | str = WeightLayout.DHWIO,
                groups: int = 1):
  """dW [V, Cin, Cout] = per offset v, sum over sites i with nbr[i, v] >= 0 of outer(x[nbr[i, v]], dy[i]).

  x: [R, Cin] (gathered through nbr), dy: [M, Cout] (rows >= num must have nbr == -1), nbr: int32 [M, V], or
    None when pairs are given (then it is not read).
  pairs: `gemm_plan.pair_lists(nbr)` (mirrored or not): walk only the rows that have a neighbour at each offset
    (else all rows, skipping chunks with none at run time). Required by a `config.balanced` config.
  precision: for float32, None/"tf32" (run as bf16 hi/lo products, see the module doc) or "highest"
    (full float32 products); None follows `jax.default_matmul_precision` (`tiling.dot_precision`).
  weight_layout: the flattened weight layout to return, DHWIO [V, Cin, Cout] or ODHWI [Cout, V, Cin] (the
    programs store their tiles there, so no transpose follows).
  groups: feature groups: dW [V, Cin/G, Cout] (or [Cout, V, Cin/G]), Cout block j the product of x's and dy's
    channel blocks j; tiles cover one group's channels.
  Accumulates in float32; returns out_dtype (default x.dtype).
  """
  cout_major = WeightLayout.of(weight_layout).cout_major
  if nbr is None and pairs is None:
    raise ValueError("weight_grad: pass nbr, or pair lists (pairs=...)")
  m = dy.shape[0]
  num_offsets = pairs.counts.shape[0] if pairs is not None else nbr.shape[1]
  cin, cout = x.shape[1], dy.shape[1]
  if cin % groups or cout % groups:
    raise ValueError(f"weight_grad: groups={groups} must divide the channels of x ({cin}) and dy ({cout})")
  cin_group, cout_group = cin // groups, cout // groups
  if nbr is not None and nbr.shape != (m, num_offsets):
    raise ValueError(f"weight_grad: nbr has shape {nbr.shape}, expected ({m}, {num_offsets}) for dy's rows")
  if min(m, x.shape[0], cin, cout) == 0:  # no pair of rows to multiply (and an empty ref cannot be traced)
    return jnp.zeros((cout, num_offsets, cin_group) if cout_major else (num_offsets, cin_group, cout),
                     out_dtype or x.dtype)
  cfg = config or default_config(m, cin_group, cout_group, num_offsets * groups, x.dtype)
  if cfg.balanced and pairs is None:
    raise ValueError("weight_grad: a balanced config (TileConfig.balanced) needs pair lists (pairs=...)")
  in_dtype = x.dtype
  bf16_split = uses_bf16_split(in_dtype, precision)
  dy = dy.astype(in_dtype)
  if bf16_split:
    # x is a forward residual: without the barrier XLA may split it as early as the forward pass and hold
    # the copies (as large as x) through the backward; tied to dy, the split runs just before this gradient.
    x, dy = lax.optimization_barrier((x, dy))
    (x, x_lo), (dy, dy_lo) = _split_bf16(x), _split_bf16(dy)
  kernel = functools.partial(
      _weight_grad_kernel, mirrored=pairs is not None and pairs.mirrored, split=cfg.split, num_rows=m,
      num_offsets=num_offsets, cin=cin_group, cout=cout_group, block_m=cfg.block_m, block_n=cfg.block_n,
      block_k=cfg.block_k, precision=dot_precision(precision, x.dtype), cout_major=cout_major,
      **(dict(groups=groups) if groups > 1 else {}))
  tiles = (pl.cdiv(cin_group, cfg.block_m), groups * pl.cdiv(cout_group, cfg.block_n))
  if cfg.balanced:
    work = balanced_work(pairs.counts, cfg.split, cfg.block_k)
    grid = (work.offset.shape[0],) + tiles
    partial_shape = (work.offset.shape[0],) + ((cout, cin_group) if cout_major else (cin_group, cout))
  else:
    grid = (num_offsets,) + tiles + (cfg.split,)
    partial_shape = ((cfg.split, cout, num_offsets, cin_group) if cout_major else
                     (cfg.split * num_offsets, cin_group, cout))
  # One piece per offset: nothing to add up, so the programs write the gradient in its final dtype (a float32
  # buffer of the whole gradient, then a cast, would sit at the training peak).
  direct = cfg.split == 1 and not cfg.balanced
  # With pair lists the map itself is not read (nor kept alive for the backward pass).
  ops = WeightGradOperands(x, dy, nbr if pairs is None else None, x_lo if bf16_split else None,
                           dy_lo if bf16_split else None, pairs, work if cfg.balanced else None)
  leaves, tree = jax.tree.flatten(ops)
  ops = jax.tree.unflatten(tree, same_vma(*leaves))
  partial = pl.pallas_call(
      kernel,
      out_shape=out_struct(partial_shape, jnp.dtype(out_dtype or in_dtype) if direct else jnp.float32, *leaves),
      grid=grid,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name="weight_grad",
  )(ops)
  if direct:
    dw = partial.reshape((cout, num_offsets, cin_group) if cout_major else (num_offsets, cin_group, cout))
  elif cfg.balanced:
    dw = _sum_by_offset(partial, work.offset, num_offsets, cout_major)
  elif cout_major:
    dw = jnp.sum(partial, axis=0)
  else:
    dw = jnp.sum(partial.reshape(cfg.split, num_offsets, cin_group, cout), axis=0)
  return dw.astype(out_dtype or in_dtype)
