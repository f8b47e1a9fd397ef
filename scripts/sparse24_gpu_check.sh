#!/usr/bin/env bash
# The native 2:4 forward on a GPU machine, in one call of under 10 minutes: build, GPU tests, benchmark.
#   OUT=/some/dir bash scripts/sparse24_gpu_check.sh      (repo root; python3 with jax[cuda13], nvcc present)
# Typical: build ~1 min, tests ~3 min, benchmark ~3 min (each section has its own timeout; the benchmark alone:
# python3 -m benchmarks.probes.sparse24_bench OUT.json). Writes $OUT/probe.txt, $OUT/gpu_tests.txt, $OUT/sparse24.json and, when the build fails, its log.
set -u
OUT=${OUT:-/tmp/sparse24}
mkdir -p "$OUT"
export PYTHONPATH=$PWD
export XLA_PYTHON_CLIENT_PREALLOCATE=false
nvidia-smi -L
echo "== build (nvcc, sm_80 + sm_90) and status"
time timeout 120 python3 -c "from native_kernels import build; print(build.native_status())"
cp ~/.cache/jsparse/*.log "$OUT"/ 2>/dev/null
echo "== one mma.sp against numpy (prints the error of each candidate metadata layout)"
timeout 60 python3 -m pytest tests/test_sparse24_native.py -m gpu -k "one_mma or places_every" -q -s -p no:cacheprovider 2>&1 | tee "$OUT/probe.txt" | tail -n 45
echo "== GPU tests: the kernel against XLA (3 tiles, f16 / bf16), submconv3d native vs dense"
timeout 220 python3 -m pytest tests/test_sparse24_native.py -m gpu -k "not one_mma and not places_every" -q \
  -p no:cacheprovider --durations=5 \
  2>&1 | tee "$OUT/gpu_tests.txt" | tail -n 60
echo "== benchmark"
timeout 190 python3 -m benchmarks.probes.sparse24_bench "$OUT/sparse24.json" 2>&1 | tail -n 25
