"""Native (CUDA C++) code reached through jax.ffi: what Pallas cannot emit, such as the 2:4 sparse tensor-core
MMA (`mma.sp`, sparse24_conv.cu), and bindings to NVIDIA libraries (cuSPARSELt, cusparselt_gemm.cu).
`build.register(library)` compiles a library on first use; `build.native_status(library)` says whether it can
run. Arrays in, arrays out: the differentiable ops and their dispatch live in jsparse (jsparse.sparse24)."""
