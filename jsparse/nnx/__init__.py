"""flax.nnx modules on jsparse.SparseTensor (`import jsparse.nnx as snnx`): the twins of the jsparse.nn
(flax.linen) layers, calling the same functional ops, with parameters interchangeable through
`linen_to_nnx` / `nnx_to_linen`."""
from jsparse.nnx.containers import Sequential, SparseDropout, TensorFn, ToDense
from jsparse.nnx.convert import linen_to_nnx, nnx_to_linen
from jsparse.nnx.layers import (SparseAvgPool1d, SparseAvgPool2d, SparseAvgPool3d, SparseBatchNorm, SparseConv1d,
                                SparseConv2d, SparseConv3d, SparseConvTranspose1d, SparseConvTranspose2d,
                                SparseConvTranspose3d, SparseGroupNorm, SparseInverseConv1d, SparseInverseConv2d,
                                SparseInverseConv3d, SparseLayerNorm, SparseMaxPool1d, SparseMaxPool2d, SparseMaxPool3d,
                                SubMConv1d, SubMConv2d, SubMConv3d)
from jsparse.nnx.models import SparseResNetBlock, SparseUNet

__all__ = ["SubMConv3d", "SparseConv3d", "SparseInverseConv3d", "SparseConvTranspose3d", "SparseMaxPool3d",
           "SparseAvgPool3d", "SparseBatchNorm", "SparseLayerNorm", "SparseGroupNorm", "SparseResNetBlock",
           "SparseUNet", "Sequential", "TensorFn", "ToDense", "SparseDropout", "linen_to_nnx", "nnx_to_linen",
           "SubMConv2d", "SparseConv2d", "SparseInverseConv2d", "SparseConvTranspose2d", "SparseMaxPool2d",
           "SparseAvgPool2d", "SubMConv1d", "SparseConv1d", "SparseInverseConv1d", "SparseConvTranspose1d",
           "SparseMaxPool1d", "SparseAvgPool1d"]
