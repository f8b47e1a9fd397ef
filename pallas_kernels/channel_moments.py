"""Per-channel column reductions over the valid rows of a [rows, C] array, in one read: batch norm's statistics
and the two sums of its backward.

- `channel_moments(x, num, shift)`: (sum of d, sum of d^2) with d = x - shift, over rows < num. Sums about a
  shift near the data (batch norm passes its first row) keep the one-pass variance s2/n - (s1/n)^2 accurate;
  sums about zero would cancel it away for means far above the spread.
- `normalised_grad_sums(x, dy, num, mean, inv_std, scale, bias, activation)`: (sum of g, sum of g * xhat) with
  xhat = (x - mean) * inv_std and g = dy pulled back through activation(xhat * scale + bias) (dy itself
  without an activation), over rows < num.

A program owns a channel block (C padded to a power of two with masks) and one of `pieces` equal shares of the
valid rows; it walks its share block_rows at a time, accumulating [block_rows, block_c] float32 tiles, then
reduces them over the rows and writes one float32 partial sum per channel. XLA adds the [pieces, C] partials
(no atomics). The shares are cut from `num` at run time, so a half-filled capacity bucket still spreads its
rows over every program, and rows at and after `num` are never read (their contents do not matter). Launch
shape defaults: channel_moments_config.py.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from pallas_kernels.channel_moments_config import MomentsConfig, default_config
from pallas_kernels.out_struct import out_struct, same_vma
from pallas_kernels.tiling import int32_cdiv


def _piece_rows(num_ref, *, num_rows: int, block_rows: int, pieces: int):
  """Inside a kernel: (first row, stop row, row-block steps) of this program's share of the valid rows."""
  valid = jnp.minimum(num_ref[0], num_rows)
  per = int32_cdiv(int32_cdiv(valid, pieces), block_rows) * block_rows
  start = pl.program_id(0) * per
  stop = jnp.minimum(start + per, valid)
  return start, stop, int32_cdiv(jnp.maximum(stop - start, 0), block_rows)


def _columns(channels: int, block_c: int):
  """Inside a kernel: this program's channel indices and which are real (C padded to block_c)."""
  cols = pl.program_id(1) * block_c + jnp.arange(block_c, dtype=jnp.int32)
  return cols, cols < channels


def _tile_mask(rows, stop, col_ok, channels: int, block_c: int):
  """The [block_rows, block_c] load mask; the column test is left out where C fills its blocks (a mask that is
  constant along a row keeps the loads vectorised)."""
  row_ok = (rows < stop)[:, None]
  if channels % block_c == 0:
    return jnp.broadcast_to(row_ok, (rows.shape[0], block_c))
  return row_ok & col_ok[None, :]


def _store_partials(refs, tiles, cols, col_ok):
  for ref, tile in zip(refs, tiles):
    plgpu.store(ref.at[pl.program_id(0), cols], jnp.sum(tile, axis=0), mask=col_ok)


def _moments_kernel(num_ref, x_ref, shift_ref, sum_ref, sum_sq_ref, *, num_rows, channels, block_rows, block_c,
                    pieces):
  cols, col_ok = _columns(channels, block_c)
  shift = plgpu.load(shift_ref.at[cols], mask=col_ok, other=0.0)[None, :]
  start, stop, steps = _piece_rows(num_ref, num_rows=num_rows, block_rows=block_rows, pieces=pieces)
  lanes = jnp.arange(block_rows, dtype=jnp.int32)

  def step(t, acc):
    rows = start + t * block_rows + lanes
    ok = _tile_mask(rows, stop, col_ok, channels, block_c)
    x = plgpu.load(x_ref.at[rows[:, None], cols[None, :]], mask=ok, other=0)
    d = jnp.where(ok, x.astype(jnp.float32) - shift, 0.0)  # masked lanes must not add -shift
    return acc[0] + d, acc[1] + d * d

  zeros = jnp.zeros((block_rows, block_c), jnp.float32)
  tiles = lax.fori_loop(0, steps, step, (zeros, zeros))
  _store_partials((sum_ref, sum_sq_ref), tiles, cols, col_ok)


def _grad_sums_kernel(num_ref, x_ref, dy_ref, mean_ref, inv_std_ref, scale_ref, bias_ref, sum_g_ref, sum_gx_ref, *,
                      num_rows, channels, block_rows, block_c, pieces, activation):
  cols, col_ok = _columns(channels, block_c)
  load_c = lambda ref: plgpu.load(ref.at[cols], mask=col_ok, other=0.0)[None, :]  # noqa: E731
  mean, inv_std = load_c(mean_ref), load_c(inv_std_ref)
  scale, bias = (load_c(scale_ref), load_c(bias_ref)) if activation is not None else (None, None)
  start, stop, steps = _piece_rows(num_ref, num_rows=num_rows, block_rows=block_rows, pieces=pieces)
  lanes = jnp.arange(block_rows, dtype=jnp.int32)

  def step(t, acc):
    rows = start + t * block_rows + lanes
    ok = _tile_mask(rows, stop, col_ok, channels, block_c)
    where = (rows[:, None], cols[None, :])
    xhat = (plgpu.load(x_ref.at[where], mask=ok, other=0).astype(jnp.float32) - mean) * inv_std
    g = plgpu.load(dy_ref.at[where], mask=ok, other=0).astype(jnp.float32)
    if activation is not None:  # the pre-activation is recomputed, not stored
      _, act_vjp = jax.vjp(activation, xhat * scale + bias)
      (g,) = act_vjp(g)
    g = jnp.where(ok, g, 0.0)
    return acc[0] + g, acc[1] + g * xhat

  zeros = jnp.zeros((block_rows, block_c), jnp.float32)
  tiles = lax.fori_loop(0, steps, step, (zeros, zeros))
  _store_partials((sum_g_ref, sum_gx_ref), tiles, cols, col_ok)


def _check(name: str, x, num, vectors: dict, dy=None):
  if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name}: x must be a floating [rows, C] array, got {x.dtype} {x.shape}")
  if dy is not None and dy.shape != x.shape:
    raise ValueError(f"{name}: dy must have x's shape {x.shape}, got {dy.shape}")
  if jnp.size(num) != 1 or not jnp.issubdtype(jnp.result_type(num), jnp.integer):
    raise ValueError(f"{name}: num must be an integer scalar (the valid rows), got {jnp.result_type(num)} "
                     f"{jnp.shape(num)}")
  for arg, v in vectors.items():
    if jnp.shape(v) != (x.shape[1],):
      raise ValueError(f"{name}: {arg} must have shape ({x.shape[1]},) for {x.shape[1]} channels, got "
                       f"{jnp.shape(v)}")


def _launch(kernel, name: str, x, num, vectors, arrays, cfg: MomentsConfig, interpret: bool):
  """Runs a two-output column reduction; returns its two [C] float32 sums (the partials added here)."""
  rows, channels = x.shape
  num = jnp.reshape(num, (1,)).astype(jnp.int32)
  vectors = [jnp.asarray(v, jnp.float32) for v in vectors]
  operands = same_vma(num, *arrays, *vectors)
  part = out_struct((cfg.pieces, channels), jnp.float32, *operands)
  kernel = functools.partial(kernel, num_rows=rows, channels=channels, block_rows=cfg.block_rows,
                             block_c=cfg.block_c, pieces=cfg.pieces)
  # A program that walks no rows still writes its zero partials, so the outputs need no initial value.
  first, second = pl.pallas_call(
      kernel,
      out_shape=(part, part),
      grid=(cfg.pieces, pl.cdiv(channels, cfg.block_c)),
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
      interpret=interpret,
      name=name,
  )(*operands)
  return jnp.sum(first, axis=0), jnp.sum(second, axis=0)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def channel_moments(x: jax.Array, num: jax.Array, shift: jax.Array, *, config: MomentsConfig | None = None,
                    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """(sum_i d_i, sum_i d_i^2), float32 [C], with d_i = x[i] - shift over the rows i < num.

  x: [rows, C] float16 / bfloat16 / float32 (rows at and after num are not read); num: int32 scalar;
  shift: [C], any float dtype (taken as float32). Each element is converted to float32 before the
  subtraction; every sum accumulates in float32 (per program, then over the programs' partials).
  """
  _check("channel_moments", x, num, {"shift": shift})
  rows, channels = x.shape
  if rows == 0 or channels == 0:  # nothing to read (an empty ref cannot be traced)
    return jnp.zeros((channels,), jnp.float32), jnp.zeros((channels,), jnp.float32)
  cfg = config or default_config(rows, channels, x.dtype)
  return _launch(_moments_kernel, "channel_moments", x, num, [shift], [x], cfg, interpret)


@functools.partial(jax.jit, static_argnames=("activation", "config", "interpret"))
def normalised_grad_sums(x: jax.Array, dy: jax.Array, num: jax.Array, mean: jax.Array, inv_std: jax.Array,
                         scale: jax.Array, bias: jax.Array, *, activation: Callable | None = None,
                         config: MomentsConfig | None = None,
                         interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """(sum_i g_i, sum_i g_i * xhat_i), float32 [C], over the rows i < num: batch norm's backward reductions.

  xhat = (x - mean) * inv_std; g = dy pulled back through activation(xhat * scale + bias) (an elementwise
  function, e.g. jax.nn.relu, traced into the kernel), or dy itself when activation is None (scale and bias are
  then not read). x, dy: [rows, C], any float dtypes, each read once; mean, inv_std, scale, bias: [C].
  """
  _check("normalised_grad_sums", x, num, {"mean": mean, "inv_std": inv_std, "scale": scale, "bias": bias}, dy)
  if activation is not None and not callable(activation):
    raise TypeError(f"normalised_grad_sums: activation must be an elementwise callable or None, got {activation!r}")
  rows, channels = x.shape
  if rows == 0 or channels == 0:
    return jnp.zeros((channels,), jnp.float32), jnp.zeros((channels,), jnp.float32)
  cfg = config or default_config(rows, channels, x.dtype)
  kernel = functools.partial(_grad_sums_kernel, activation=activation)
  return _launch(kernel, "bn_grad_sums", x, num, [mean, inv_std, scale, bias], [x, dy], cfg, interpret)
