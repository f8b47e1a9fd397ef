"""Probes still in use: A/B runs, memory and per-layer profiles, the CPU voxelize benchmark (see BENCHMARKS.md)."""
