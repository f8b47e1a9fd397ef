"""jsparse: sparse 3D convolution for JAX, with Pallas (Triton) GPU kernels and an XLA path everywhere."""
from jsparse.autotuning import autotune
from jsparse.conv import submconv3d, submconv_xla
from jsparse.tuning import ALGORITHMS, ConfigTable, PassConfig
from jsparse.dispatch import IMPLEMENTATIONS
from jsparse.neighbors import NeighborCache, kernel_offsets, neighbor_map
from jsparse.sparse_tensor import SparseTensor, round_capacity

__all__ = [
    "SparseTensor", "round_capacity", "NeighborCache", "neighbor_map", "kernel_offsets", "submconv3d",
    "submconv_xla", "IMPLEMENTATIONS", "autotune", "ConfigTable", "PassConfig", "ALGORITHMS",
]
__version__ = "0.1.0"
