"""flax.nnx modules on jsparse.SparseTensor (`import jsparse.nnx as snnx`): the twins of the jsparse.nn
(flax.linen) layers, calling the same functional ops, with parameters interchangeable through
`linen_to_nnx` / `nnx_to_linen`."""
from jsparse.nnx.containers import Sequential, SparseDropout, TensorFn, ToDense
from jsparse.nnx.convert import linen_to_nnx, nnx_to_linen
from jsparse.nnx.layers import (SparseAvgPool3d, SparseBatchNorm, SparseConv3d, SparseConvTranspose3d,
                                SparseGroupNorm, SparseInverseConv3d, SparseLayerNorm, SparseMaxPool3d, SubMConv3d)
from jsparse.nnx.models import SparseResNetBlock, SparseUNet

__all__ = ["SubMConv3d", "SparseConv3d", "SparseInverseConv3d", "SparseConvTranspose3d", "SparseMaxPool3d",
           "SparseAvgPool3d", "SparseBatchNorm", "SparseLayerNorm", "SparseGroupNorm", "SparseResNetBlock",
           "SparseUNet", "Sequential", "TensorFn", "ToDense", "SparseDropout", "linen_to_nnx", "nnx_to_linen"]
