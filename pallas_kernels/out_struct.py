"""Pallas calls inside `jax.shard_map`: outputs and operands that say which mesh axes they vary over.

With shard_map's check_vma=True (the default), Pallas refuses an `out_shape` without a manual_axis_type
(seen on 2 H200s: every data-parallel training step failed), and interpret mode refuses kernel operands
that vary over different axes (e.g. a constant table next to per-device coordinates). Outside shard_map
both helpers change nothing.
"""
from __future__ import annotations

import jax


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
