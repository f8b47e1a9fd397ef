"""jsparse: sparse 3D (and 2D, 1D) convolution for JAX, with Pallas (Triton) GPU kernels and an XLA path everywhere.

Top level: the SparseTensor, neighbour maps, the convolution family and tuning. Submodules:
jsparse.nn (flax.linen modules), jsparse.nnx (their flax.nnx twins), jsparse.norm (normalisation,
activations), jsparse.voxelize, jsparse.shapes (procedural data), jsparse.serialize (Morton / Hilbert),
jsparse.sampling (grid_sample), jsparse.plot (matplotlib renders), jsparse.sparsity (2:4 structured-sparse
weights: pruning, compression, fixed-mask training; jsparse.sparse24 runs their forward on the sparse tensor
cores). jsparse.eager (eager calls of the ops compile one program each; `primitive_by_primitive` turns it off).
jsparse.topology (select, union, add,
multiply, broadcast_per_item, child_labels, dropout) is also re-exported at the top level. Advanced,
array-level: jsparse.map_gemm (the GEMM every convolution runs), jsparse.pass_config and jsparse.tuning (what
a tuned config is, and the tables that hold them).
"""
from jsparse._types import WeightLayout
from jsparse.autotuning import autotune
from jsparse.conv import submconv3d
from jsparse.dispatch import IMPLEMENTATIONS
from jsparse.gemm_xla import submconv_xla
from jsparse.neighbors import NeighborCache, kernel_offsets, neighbor_map, with_maps
from jsparse.pass_config import ALGORITHMS
from jsparse.pass_config import Depthwise, Explicit, Implicit, Masked, PassConfig, ShapeKey
from jsparse.pool import global_pool, sparse_avg_pool3d, sparse_max_pool3d
from jsparse.sparse_conv import (concat, sparse_conv3d, sparse_conv_transpose3d, sparse_inverse_conv3d, strided_map,
                                 transpose_map)
from jsparse.sparse_tensor import SparseTensor, error_checks, key_width, overflowed, round_capacity
from jsparse.spatial_rank import (sparse_avg_pool1d, sparse_avg_pool2d, sparse_conv1d, sparse_conv2d,
                                  sparse_conv_transpose1d, sparse_conv_transpose2d, sparse_inverse_conv1d,
                                  sparse_inverse_conv2d, sparse_max_pool1d, sparse_max_pool2d, submconv1d, submconv2d)
from jsparse.topology import add, broadcast_per_item, child_labels, dropout, multiply, select, union
from jsparse.tuning import ConfigTable
from jsparse import map_gemm, nn, nnx, norm, pass_config, plot, sampling, serialize, shapes, tuning  # noqa: E402
from jsparse import eager, sparse24, sparsity, topology, voxelize  # noqa: E402

__all__ = [
    # data
    "SparseTensor", "round_capacity", "key_width", "overflowed", "error_checks",
    # neighbour maps
    "NeighborCache", "neighbor_map", "with_maps", "kernel_offsets",
    # convolutions and pooling
    "submconv3d", "sparse_conv3d", "sparse_inverse_conv3d", "sparse_conv_transpose3d", "sparse_max_pool3d",
    "sparse_avg_pool3d", "global_pool", "concat", "WeightLayout", "IMPLEMENTATIONS", "ALGORITHMS",
    # the same in 2D and 1D (a 2D SparseTensor is a 3D one of depth 1: SparseTensor.spatial_ndim)
    "submconv2d", "sparse_conv2d", "sparse_inverse_conv2d", "sparse_conv_transpose2d", "sparse_max_pool2d",
    "sparse_avg_pool2d", "submconv1d", "sparse_conv1d", "sparse_inverse_conv1d", "sparse_conv_transpose1d",
    "sparse_max_pool1d", "sparse_avg_pool1d",
    # topology
    "select", "union", "add", "multiply", "broadcast_per_item", "child_labels", "dropout",
    # tuning
    "autotune", "ConfigTable", "ShapeKey", "PassConfig", "Explicit", "Implicit", "Masked", "Depthwise",
    # advanced, array level (maps and GEMMs without a SparseTensor)
    "strided_map", "transpose_map", "submconv_xla",
    # submodules
    "nn", "nnx", "norm", "plot", "sampling", "serialize", "shapes", "voxelize", "topology", "map_gemm", "pass_config",
    "tuning", "sparsity", "sparse24", "eager",
]
__version__ = "0.1.0"
