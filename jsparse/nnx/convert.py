"""Moving variables between the flax.linen modules (jsparse.nn) and their flax.nnx twins (jsparse.nnx).

A linen model's variables are {"params": ..., "batch_stats": ...}; an nnx model holds the same arrays as
nnx.Param and nnx.BatchStat variables at the same paths (the nnx modules keep the linen names: "kernel",
"bias", "scale", "mean", "var", and submodules named as the linen ones), so converting is a check of the
structure and shapes followed by a copy of references.
"""
from __future__ import annotations

from typing import Any, Mapping

import jax.numpy as jnp
from flax import nnx
from flax import traverse_util

__all__ = ["linen_to_nnx", "nnx_to_linen"]

# linen collection -> nnx variable type
COLLECTIONS = {"params": nnx.Param, "batch_stats": nnx.BatchStat}


def _flat(tree: Mapping) -> dict[tuple, Any]:
  return traverse_util.flatten_dict(dict(tree)) if tree else {}


def linen_to_nnx(variables: Mapping[str, Any], model: nnx.Module) -> nnx.State:
  """The nnx state of `model` with every parameter and batch statistic taken from a linen variables tree.

  variables: what the linen twin's `init` returns (or a trained copy): {"params": ..., "batch_stats": ...}.
  model: an nnx model of the same architecture (e.g. `jsparse.nnx.SparseUNet(in_features, ..., rngs=...)` for
  `jsparse.nn.SparseUNet(...)`); its own values are not read, only its structure. Apply the result with
  `nnx.update(model, state)`. Arrays are taken as they are (dtype included). A path that is missing on either
  side, or a shape that differs, raises ValueError naming it.
  """
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}")
  if not isinstance(variables, Mapping):
    raise TypeError(f"variables must be a linen variables mapping {{'params': ...}}, got {type(variables).__name__}")
  unknown = set(variables) - set(COLLECTIONS)
  if unknown:
    raise ValueError(f"variables: collections {sorted(unknown)} have no nnx counterpart here "
                     f"(known: {sorted(COLLECTIONS)})")
  states = []
  for collection, kind in COLLECTIONS.items():
    state = nnx.state(model, kind)
    want, have = _flat(nnx.to_pure_dict(state)), _flat(variables.get(collection, {}))
    missing, extra = sorted(set(want) - set(have)), sorted(set(have) - set(want))
    if missing or extra:
      show = lambda paths: ", ".join("/".join(map(str, p)) for p in paths[:6]) + (" ..." if len(paths) > 6 else "")
      raise ValueError(f"variables['{collection}'] does not match the nnx model: "
                       + "; ".join(part for part in (f"missing {show(missing)}" if missing else "",
                                                     f"unexpected {show(extra)}" if extra else "") if part))
    for path, leaf in want.items():
      if jnp.shape(have[path]) != jnp.shape(leaf):
        raise ValueError(f"variables['{collection}']/{'/'.join(map(str, path))}: shape {jnp.shape(have[path])} "
                         f"where the nnx model has {jnp.shape(leaf)}")
    nnx.replace_by_pure_dict(state, traverse_util.unflatten_dict(have) if have else {})
    states.append(state)
  return nnx.merge_state(*states)


def nnx_to_linen(model: nnx.Module) -> dict[str, Any]:
  """The linen variables tree {"params": ..., "batch_stats": ...} of an nnx model ("batch_stats" only where
  the model has batch norms): what its jsparse.nn twin's `apply` takes. The arrays are the model's own."""
  if not isinstance(model, nnx.Module):
    raise TypeError(f"model must be an nnx.Module, got {type(model).__name__}")
  out = {}
  for collection, kind in COLLECTIONS.items():
    tree = nnx.to_pure_dict(nnx.state(model, kind))
    if tree or collection == "params":
      out[collection] = tree
  return out
