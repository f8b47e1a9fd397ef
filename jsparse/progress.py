"""Progress bars for jsparse's long loops (autotune, the benchmarks): tqdm when it is installed (an optional
dependency, in the `dev` and `plot` extras), nothing otherwise."""
from __future__ import annotations

from typing import Iterable, TypeVar

T = TypeVar("T")


def progress_bar(iterable: Iterable[T], desc: str, *, total: int | None = None, unit: str = "it") -> Iterable[T]:
  """`iterable` with a tqdm bar, or `iterable` itself when tqdm is missing.

  tqdm.auto draws a widget in Jupyter (with ipywidgets) and a text bar on a terminal's stderr; `disable=None`
  hides the text bar when stderr is not a terminal, so logs of remote runs get no carriage-return noise.
  `TQDM_DISABLE=1` in the environment turns every bar off.
  """
  try:
    from tqdm.auto import tqdm
  except ImportError:
    return iterable
  return tqdm(iterable, desc=desc, total=total, unit=unit, disable=None, leave=False, dynamic_ncols=True)
