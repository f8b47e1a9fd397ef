"""Pallas kernels (lowered to Triton on the GPU) and their launch wrappers: arrays in, arrays out.

Nothing here knows about jsparse's SparseTensor or flax.
- hash_table, unique_keys: the GPU hash tables (neighbour maps, strided output sites).
- gather_gemm (+ gather_gemm_config): the gather-fused implicit GEMM (forward and input gradient).
- weight_grad (+ weight_grad_config): the gather-gather GEMM for the weight gradient.
- channel_moments (+ channel_moments_config): per-channel column sums over the valid rows (batch norm's
  statistics and its backward's two sums), one read, float32 partials per program.
- gemm_plan: the masked plans and pair lists the GEMMs walk; tiling: TileConfig and precision;
  weight_layout: the two weight layouts; mma: the multiply-accumulate every GEMM loop uses.
"""
