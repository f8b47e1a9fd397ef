"""flax.linen modules on jsparse.SparseTensor (`import jsparse.nn as snn`)."""
from jsparse.nn.containers import Sequential, SparseDropout, TensorFn, ToDense
from jsparse.nn.layers import SparseBatchNorm, SparseGroupNorm, SparseLayerNorm, SubMConv3d
from jsparse.nn.models import SparseResNetBlock, SparseUNet

__all__ = ["SubMConv3d", "SparseBatchNorm", "SparseLayerNorm", "SparseGroupNorm", "SparseResNetBlock", "SparseUNet",
           "Sequential", "TensorFn", "ToDense", "SparseDropout"]

# Strided/transposed convolutions and pooling live in sparse_conv_layers.py (written separately); the guard
# keeps the submanifold layers importable should that file be missing or broken.
try:
  from jsparse.nn.sparse_conv_layers import (SparseAvgPool3d, SparseConv3d, SparseConvTranspose3d,
                                             SparseInverseConv3d, SparseMaxPool3d)
except ImportError:
  pass
else:
  __all__ += ["SparseConv3d", "SparseInverseConv3d", "SparseConvTranspose3d", "SparseMaxPool3d", "SparseAvgPool3d"]
