"""The maintained benchmarks: jsparse against FlexGEMM (suite.py) and spconv (networks.py), per-kernel timings
(kernels.py), tuning tables (tune_table.py), data-parallel scaling (data_parallel.py), the hash table
(bench_hash_table.py); shared workloads (workloads.py); merge_results.py files a run's outputs into
results/<gpu>.json. probes/ holds the probes still in use."""
