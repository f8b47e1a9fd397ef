"""Progress bars for jsparse's long loops (autotune, the benchmarks): tqdm when it is installed (an optional
dependency, in the `dev` and `plot` extras), nothing otherwise."""
from __future__ import annotations

from typing import Iterable, TypeVar

T = TypeVar("T")


def progress_bar(iterable: Iterable[T], desc: str, *, total: int | None = None, unit: str = "it") -> Iterable[T]:
  """`iterable` with a tqdm bar on stderr, or `iterable` itself when tqdm is missing.

  The bar shows only when stderr is a terminal (tqdm's `disable=None`), so logs of runs on remote machines get
  no carriage-return noise; `TQDM_DISABLE=1` in the environment turns it off everywhere.
  """
  try:
    from tqdm import tqdm
  except ImportError:
    return iterable
  return tqdm(iterable, desc=desc, total=total, unit=unit, disable=None, leave=False, dynamic_ncols=True)
