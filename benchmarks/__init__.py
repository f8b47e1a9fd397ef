"""Benchmarks of jsparse against FlexGEMM (suite.py), per-kernel microbenchmarks (kernels.py)."""
