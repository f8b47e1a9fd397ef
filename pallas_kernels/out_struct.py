"""Pallas calls inside `jax.shard_map`: outputs and operands that say which mesh axes they vary over.

With shard_map's check_vma=True (the default), Pallas refuses an `out_shape` without a manual_axis_type
(seen on 2 H200s: every data-parallel training step failed), and interpret mode refuses kernel operands
that vary over different axes (e.g. a constant table next to per-device coordinates). Outside shard_map
both helpers change nothing.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _varying(a) -> frozenset:
  return getattr(getattr(jax.typeof(a), "mat", None), "varying", frozenset())


def same_vma(*arrays):
  """The arrays, each cast to vary over every mesh axis any of them varies over."""
  want = frozenset().union(*(_varying(a) for a in arrays))
  if not want:
    return arrays
  out = []
  for a in arrays:
    missing = tuple(sorted(want - _varying(a)))
    out.append(jax.lax.pcast(a, missing, to="varying") if missing else a)
  return tuple(out)


def out_struct(shape, dtype, *inputs) -> jax.ShapeDtypeStruct:
  """A pallas_call `out_shape` that varies over the mesh axes its inputs vary over."""
  mat = None
  for a in inputs:
    m = getattr(jax.typeof(a), "mat", None)
    if m is not None:
      mat = m if mat is None else mat.update(varying=mat.varying | m.varying)
  return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat)


def split_out_struct(m: int, n: int, dtype, split: int, *inputs) -> jax.ShapeDtypeStruct:
  """The out_shape of a row-gathering GEMM whose reduction is split over `split` programs: the [m, n] output
  itself, or float32 partial sums [split, m, n] (summed by `sum_split`)."""
  return out_struct((m, n), dtype, *inputs) if split == 1 else out_struct((split, m, n), jnp.float32, *inputs)


def sum_split(out: jax.Array, bias, num: jax.Array, dtype) -> jax.Array:
  """A split GEMM's output from its float32 partial sums [split, m, n]: their sum, plus bias, zero rows from num[0]
  on, in dtype (an unsplit output, 2-D, passes through: the kernel added its bias)."""
  if out.ndim == 2:
    return out
  out = jnp.sum(out, axis=0)
  if bias is not None:
    out = out + bias.astype(jnp.float32)
  return jnp.where((jnp.arange(out.shape[0], dtype=jnp.int32) < num[0])[:, None], out, 0).astype(dtype)
