"""Submanifold sparse convolution: builds (or reuses) the neighbour map, then runs jsparse.map_gemm on it."""
from __future__ import annotations

import dataclasses

from jsparse.eager import compiled_when_eager
from jsparse._types import ArrayLike, PrecisionLike, Size3
from jsparse.map_gemm import ConvMaps, ConvSpec, check_weight, with_plans
from jsparse.neighbors import NeighborCache, build_neighbor_map, cache_key, check_dilation, check_kernel_size
from jsparse.size_errors import SizeError
from jsparse.sparse_tensor import SparseTensor, check_same_sites, check_spatial_ndim
from jsparse.sparse24 import conv_map_gemm
from jsparse.sparsity import Compressed2to4
from pallas_kernels.weight_layout import WeightLayout


@compiled_when_eager
def submconv3d(x: SparseTensor, weight: ArrayLike | Compressed2to4,
               bias: ArrayLike | None = None, *, dilation: Size3 = 1,
               cache: NeighborCache | None = None, implementation: str | None = None,
               precision: PrecisionLike = None, algorithm: str = "auto",
               weight_layout: WeightLayout | str = "DHWIO", feature_group_count: int = 1) -> SparseTensor:
  """Submanifold 3D convolution: a SparseTensor on the same coordinates as `x`.

  At every valid site u: y[u] = sum_i weight[i]^T x[u + (i - centre) * dilation] + bias, summing over the
  kernel positions i whose shifted site is active; this equals
  `lax.conv_general_dilated(x.todense(), weight, (1, 1, 1), "SAME", rhs_dilation=dilation,
  dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))` read at the valid sites.

  weight: (Kx, Ky, Kz, Cin, Cout), odd kernel sizes (flax's layout), or with weight_layout="ODHWI"
    (Cout, Kx, Ky, Kz, Cin) (PyTorch / spconv / FlexGEMM's layout: their checkpoints load without a
    transpose). Both give the same results; on the GPU a pass reads the weight in place or through a
    transposed copy, whichever its layout favours. A shape that reads the same in both layouts (Cin = Cout =
    Kx = Ky = Kz, e.g. (3, 3, 3, 3, 3)) cannot be told apart: it is read in weight_layout, so name the layout of
    a PyTorch / spconv checkpoint (a weight read in the wrong layout is checked only by its shape).
    Or a `jsparse.sparsity.Compressed2to4` (a 2:4 weight, compressed
    in the same layout): it is decompressed and the dense path runs, or, inside `jsparse.sparse24.native_2to4()` on
    a GPU, the forward runs on the native sparse tensor-core kernel where `jsparse.sparse24` allows it (float16 /
    bfloat16, Cin % 32 == 0, Cout % 16 == 0; slower than the dense kernels, so opt-in), or for a 1x1x1 kernel on
    cuSPARSELt (Cin and Cout multiples of 32, cuSPARSELt installed); the same holds in the strided, inverse and
    transposed convolutions (on the mma.sp kernel). bias: (Cout,) or None.
  cache: a NeighborCache for x's coordinates from `neighbor_map(x, kernel_size, dilation)`. If None, the map
    that x carries for this kernel (x.caches, attached by an earlier convolution on these coordinates) is
    used, or a new one is built; the output carries it on, so a stack of layers builds it once.
  implementation: None (Pallas kernels on a GPU, XLA elsewhere), "pallas" or "xla".
  precision: for float32 inputs, None (TF32 matmuls on the GPU, or what `jax.default_matmul_precision` sets),
    "tf32" or "highest" (full fp32).
  algorithm (Pallas only): "auto" (chosen per pass), "explicit" (gather, then one matmul), "implicit"
    (gather fused into the GEMM), "masked" (rows sorted so blocks skip unused offsets), or their
    "_splitk" variants (the reduction split across programs), or "depthwise" (a multiply-accumulate kernel for
    narrow feature groups). All give the same result.
  feature_group_count: G > 1 splits the input and output channels into G groups, output group j reading
    input group j only (as lax.conv_general_dilated's feature_group_count; G = Cin is a depthwise convolution):
    weight (Kx, Ky, Kz, Cin/G, Cout) or (Cout, Kx, Ky, Kz, Cin/G), G dividing Cin and Cout. On the GPU groups of
    at least 16 channels run as one grouped gather-GEMM, narrower ones ("auto") on the "depthwise" kernels.
  The output has x's dtype; the weight is cast to it; products accumulate in float32.
  """
  check_spatial_ndim(x, 3, "submconv3d")
  layout = WeightLayout.of(weight_layout)
  kernel_size, w, b = check_weight(x.num_channels, x.dtype, weight, bias, layout, feature_group_count)
  spec = ConvSpec.build(check_kernel_size(kernel_size), check_dilation(dilation), implementation, layout, precision,
                        algorithm, feature_group_count)
  key = cache_key(spec.kernel_size, spec.dilation, spec.implementation)
  passed = cache is not None
  if passed and not isinstance(cache, NeighborCache):  # e.g. x.caches or a strided convolution's PairMap
    raise TypeError(f"cache must be a NeighborCache (from jsparse.neighbor_map) or None, got {type(cache).__name__}")
  if cache is None:
    cache = x.caches.get(key)
  if cache is None:
    cache = build_neighbor_map(x, spec.kernel_size, spec.dilation, spec.implementation)
  elif cache.kernel_size != spec.kernel_size or cache.dilation != spec.dilation or cache.capacity != x.capacity:
    raise SizeError("cache was built for kernel_size={cache_kernel_size}, dilation={cache_dilation}, capacity="
                    "{cache_capacity} but this conv has kernel_size={kernel_size}, dilation={dilation}, capacity="
                    "{capacity}", cache_kernel_size=cache.kernel_size, cache_dilation=cache.dilation,
                    cache_capacity=cache.capacity, kernel_size=spec.kernel_size, dilation=spec.dilation,
                    capacity=x.capacity)
  elif passed and cache.coords is not None:
    # A map carried in x.caches is x's by construction (replacing coords drops them); a passed one may not be.
    check_same_sites("submconv3d", "cache (a NeighborCache)", cache.coords, cache.num, x.coords, x.num,
                     ": build it with neighbor_map of this input")
  maps = with_plans(x.feats, w, ConvMaps(cache.nbr, x.num, plans=cache.plans, pairs=cache.pairs), spec)
  cache = dataclasses.replace(cache, plans=maps.plans)
  # The output shares x's coordinates, so it carries the map (with its plans) on, and its overflow flag.
  x = dataclasses.replace(x.with_cache(key, cache), overflow=x.overflow | cache.overflow)
  # A 1x1x1 map is the identity on the valid rows: nothing to gather.
  gather_free = all(k == 1 for k in spec.kernel_size)
  return x.replace(feats=conv_map_gemm(x.feats, weight, w, b, maps, spec, gather_free=gather_free))
