"""Native (CUDA C++) kernels reached through jax.ffi: what Pallas cannot emit, such as the 2:4 sparse tensor-core
MMA (`mma.sp`). `build.register()` compiles them on first use; `build.native_status()` says whether they can run.
Arrays in, arrays out: the differentiable ops and their dispatch live in jsparse (jsparse.sparse24)."""
