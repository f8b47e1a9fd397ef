"""The two layouts a convolution weight comes in, and the axes of each once the kernel axes are flattened."""
from __future__ import annotations

import enum
import math


class WeightLayout(str, enum.Enum):
  """A 5-D convolution weight's axis order; the kernels read its flattened 3-D form in place.

  DHWIO: (Kx, Ky, Kz, Cin, Cout), flax's and lax's layout; flattened [V, Cin, Cout].
  ODHWI: (Cout, Kx, Ky, Kz, Cin), PyTorch's, spconv's and FlexGEMM's layout; flattened [Cout, V, Cin].
  A member equals its name as a string, so "DHWIO" may be passed wherever a WeightLayout is taken.
  """

  DHWIO = "DHWIO"
  ODHWI = "ODHWI"

  @classmethod
  def of(cls, value: "WeightLayout | str", name: str = "weight_layout") -> "WeightLayout":
    """The layout named by `value` (a WeightLayout or its name); ValueError naming `name` otherwise."""
    try:
      return cls(value)
    except ValueError:
      raise ValueError(f"{name} must be one of {[m.value for m in cls]}, got {value!r}") from None

  @property
  def cout_major(self) -> bool:
    return self is WeightLayout.ODHWI

  @property
  def flat_axes(self) -> str:
    """The flattened weight's axes in the GEMM's names: v (offset), k (Cin, the forward's reduction), n (Cout)."""
    return "nvk" if self.cout_major else "vkn"

  def describe(self) -> str:
    return "(Cout, Kx, Ky, Kz, Cin)" if self.cout_major else "(Kx, Ky, Kz, Cin, Cout)"

  def split_shape(self, shape) -> tuple[tuple[int, int, int], int, int]:
    """(kernel_size, Cin, Cout) of a 5-D weight shape in this layout."""
    if self.cout_major:
      return tuple(shape[1:4]), shape[4], shape[0]
    return tuple(shape[:3]), shape[3], shape[4]

  def flatten(self, weight):
    """The weight with its kernel axes flattened into V: [V, Cin, Cout] or [Cout, V, Cin]."""
    kernel_size, cin, cout = self.split_shape(weight.shape)
    v = math.prod(kernel_size)
    return weight.reshape((cout, v, cin) if self.cout_major else (v, cin, cout))

  def flat_dims(self, flat) -> tuple[int, int, int]:
    """(V, Cin, Cout) of a flattened weight in this layout."""
    if self.cout_major:
      return flat.shape[1], flat.shape[2], flat.shape[0]
    return tuple(flat.shape)

  def __str__(self) -> str:
    return self.value
