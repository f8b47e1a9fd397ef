"""jsparse: sparse 3D convolution for JAX, with Pallas (Triton) GPU kernels and an XLA path everywhere.

Top level: the SparseTensor, neighbour maps, the convolution family and tuning. Submodules:
jsparse.nn (flax.linen modules), jsparse.nnx (their flax.nnx twins), jsparse.norm (normalisation,
activations), jsparse.voxelize, jsparse.shapes (procedural data), jsparse.serialize (Morton / Hilbert),
jsparse.sampling (grid_sample), jsparse.plot (matplotlib renders). jsparse.topology (select, union, add,
multiply, broadcast_per_item, child_labels, dropout) is also re-exported at the top level.
"""
from jsparse.autotuning import autotune
from jsparse.conv import submconv3d, submconv_xla
from jsparse.dispatch import IMPLEMENTATIONS
from jsparse.neighbors import NeighborCache, kernel_offsets, neighbor_map, with_maps
from jsparse.pool import global_pool, sparse_avg_pool3d, sparse_max_pool3d
from jsparse.sparse_conv import concat, sparse_conv3d, sparse_conv_transpose3d, sparse_inverse_conv3d, strided_map
from jsparse.sparse_tensor import SparseTensor, error_checks, key_width, overflowed, round_capacity
from jsparse.topology import add, broadcast_per_item, child_labels, dropout, multiply, select, union
from jsparse.tuning import ALGORITHMS, ConfigTable, PassConfig
from jsparse import nn, nnx, norm, plot, sampling, serialize, shapes, topology, voxelize  # noqa: E402  (submodules)

__all__ = [
    "SparseTensor", "round_capacity", "key_width", "overflowed", "error_checks", "NeighborCache", "neighbor_map", "with_maps",
    "kernel_offsets", "submconv3d", "submconv_xla", "sparse_conv3d", "sparse_inverse_conv3d", "sparse_conv_transpose3d",
    "sparse_max_pool3d", "sparse_avg_pool3d", "global_pool", "concat", "strided_map", "IMPLEMENTATIONS", "autotune",
    "ConfigTable", "PassConfig", "ALGORITHMS", "nn", "nnx", "norm", "plot", "sampling", "serialize", "shapes",
    "voxelize", "select", "union", "add", "multiply", "broadcast_per_item", "child_labels", "dropout", "topology",
]
__version__ = "0.1.0"
