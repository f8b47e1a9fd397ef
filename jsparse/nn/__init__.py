"""flax.linen modules on jsparse.SparseTensor (`import jsparse.nn as snn`)."""
from jsparse.nn.containers import Sequential, SparseDropout, TensorFn, ToDense
from jsparse.nn.layers import SparseBatchNorm, SparseGroupNorm, SparseLayerNorm, SubMConv1d, SubMConv2d, SubMConv3d
from jsparse.nn.models import SparseResNetBlock, SparseUNet

__all__ = ["SubMConv3d", "SubMConv2d", "SubMConv1d", "SparseBatchNorm", "SparseLayerNorm", "SparseGroupNorm",
           "SparseResNetBlock", "SparseUNet", "Sequential", "TensorFn", "ToDense", "SparseDropout"]

# Strided/transposed convolutions and pooling live in sparse_conv_layers.py (written separately); the guard
# keeps the submanifold layers importable should that file be missing or broken.
try:
  from jsparse.nn.sparse_conv_layers import (SparseAvgPool1d, SparseAvgPool2d, SparseAvgPool3d, SparseConv1d,
                                             SparseConv2d, SparseConv3d, SparseConvTranspose1d, SparseConvTranspose2d,
                                             SparseConvTranspose3d, SparseInverseConv1d, SparseInverseConv2d,
                                             SparseInverseConv3d, SparseMaxPool1d, SparseMaxPool2d, SparseMaxPool3d)
except ImportError:
  pass
else:
  __all__ += ["SparseConv3d", "SparseInverseConv3d", "SparseConvTranspose3d", "SparseMaxPool3d", "SparseAvgPool3d",
              "SparseConv2d", "SparseInverseConv2d", "SparseConvTranspose2d", "SparseMaxPool2d", "SparseAvgPool2d",
              "SparseConv1d", "SparseInverseConv1d", "SparseConvTranspose1d", "SparseMaxPool1d", "SparseAvgPool1d"]
