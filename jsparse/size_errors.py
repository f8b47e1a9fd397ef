"""Errors about per-axis sizes that a 2D or 1D op words in its own rank.

The 2D and 1D ops run as 3D ops on a grid whose leading extents are 1 (jsparse.spatial_rank), so the 3D checks
see sizes such as kernel_size (1, 3, 3) or a weight of shape (1, 3, 3, Cin, Cout) that the user never wrote. A
check raises `SizeError`: a ValueError worded for 3D, which keeps its template and its values, so that the code
which lifted the sizes (`spatial_rank.call_in_rank`, the maps that take sizes in x's rank, the modules) re-raises
it with `in_rank` through `sizes_in_rank`: the same words about the last `ndim` entries, the user's own.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Iterator

from pallas_kernels.weight_layout import WeightLayout


@dataclasses.dataclass(frozen=True)
class WeightShape:
  """A 5-D weight's shape in `layout`, quoted in a lower rank without its lifted kernel axes."""

  shape: tuple[int, ...]
  layout: WeightLayout

  def in_rank(self, ndim: int) -> tuple[int, ...]:
    first = 1 if self.layout.cout_major else 0  # where the kernel axes start
    return self.shape[:first] + self.shape[first + 3 - ndim:]


class SizeError(ValueError):
  """ValueError(template.format(**values)) of a 3D check: tuple values are per-axis sizes (3 entries, one per
  axis of the lifted grid), WeightShape values a weight's shape, and `{ndim}` in the template the op's rank;
  other values are quoted as they are."""

  def __init__(self, template: str, **values):
    self.template, self.values = template, values
    super().__init__(self._text(3))

  def _text(self, ndim: int) -> str:
    def quote(value):
      if isinstance(value, WeightShape):
        return value.in_rank(ndim)
      if not isinstance(value, tuple):
        return value
      # A lifted size has 1 (kernel, stride, dilation, extent) or 0 (padding) on the axes the op added; other
      # entries there come from a 3D caller's sizes (a map built on the 3D view): quoted whole, or the message
      # would compare two sizes that read the same.
      return tuple(value[3 - ndim:]) if all(v in (0, 1) for v in value[:3 - ndim]) else value

    return self.template.format(ndim=ndim, **{name: quote(value) for name, value in self.values.items()})

  def in_rank(self, ndim: int) -> ValueError:
    """The same error about an `ndim`-D op's sizes (a plain ValueError: it is worded once)."""
    return ValueError(self._text(ndim))


@contextlib.contextmanager
def sizes_in_rank(ndim: int) -> Iterator[None]:
  """Re-raises a SizeError from the 3D code inside as one about `ndim`-D sizes (at ndim 3 as it is)."""
  try:
    yield
  except SizeError as e:
    if ndim == 3:
      raise
    raise e.in_rank(ndim) from None
