"""Pallas kernels (lowered to Triton on the GPU) and their launch wrappers: arrays in, arrays out.

Nothing here knows about jsparse's SparseTensor or flax.
- hash_table: the GPU hash table and the submanifold neighbour map built with it.
- gather_gemm: the gather-fused implicit GEMM (forward and input gradient).
- weight_grad: the gather-gather GEMM for the weight gradient.
- tiling: tile configurations and precision handling shared by the GEMMs.
"""
