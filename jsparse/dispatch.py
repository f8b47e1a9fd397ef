"""Which implementation runs an op: the Pallas kernels (Triton on a GPU, interpret mode elsewhere) or XLA."""
from __future__ import annotations

import dataclasses

import jax

IMPLEMENTATIONS = ("xla", "pallas")


@dataclasses.dataclass(frozen=True)
class Implementation:
  name: str  # "xla" or "pallas"
  interpret: bool = False  # Pallas only: run the kernels in interpret mode (no GPU)

  @property
  def is_pallas(self) -> bool:
    return self.name == "pallas"


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def resolve(implementation: str | None) -> Implementation:
  """None picks the fastest that works here: Pallas on a GPU, XLA elsewhere.

  "pallas" off a GPU runs the same kernels in Pallas interpret mode (slow; for tests and debugging).
  """
  if implementation is None:
    return Implementation("pallas") if on_gpu() else Implementation("xla")
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(f"implementation must be one of {IMPLEMENTATIONS} or None, got {implementation!r}")
  if implementation == "pallas":
    return Implementation("pallas", interpret=not on_gpu())
  return Implementation("xla")
