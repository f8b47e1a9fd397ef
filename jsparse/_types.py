"""Types used in the public signatures: aliases (annotations only, not checked at run time) and WeightLayout."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import jax
from jax.typing import ArrayLike

from pallas_kernels.weight_layout import WeightLayout

__all__ = ["ArrayLike", "Size3", "SizeND", "Capacity", "PrecisionLike", "WeightLayout"]

Size3 = int | Sequence[int]
"""A kernel size, stride, padding or dilation: one int for all three axes, or three ints (x, y, z)."""

SizeND = int | Sequence[int]
"""A size of a 2D or 1D op: one int for every spatial axis, or one int per axis ((y, x) in 2D)."""

Capacity = int | Literal["exact"] | None
"""Rows of an output whose size depends on the data: an int, "exact" (the count) or None (a bucket)."""

PrecisionLike = str | jax.lax.Precision | None
"""Matmul precision for float32 inputs: None (TF32 on the GPU, unless `jax.default_matmul_precision` asks for
"highest" / "float32"), "tf32", "highest" (full fp32), or a lax.Precision."""
