#!/usr/bin/env bash
# Why are float32 (TF32) Pallas GEMMs slow? One GPU call (see docs/perf_notes.md, "TF32"):
#  1. benchmarks.triton_ir_probe: the same Triton IR compiled by XLA (as jsparse runs it) and by the triton package;
#  2. Nsight Compute: the SASS of the XLA-compiled float32 forward kernel (HGMMA = wgmma, HMMA = mma.sync);
# (MLIR_ENABLE_DUMP=1 prints nothing from XLA's Triton pipeline on jax 0.11.2: tried 2026-11-23.)
# Then the GPU tests named by TESTS_K (pytest -k), if set. Logs in $OUT.
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD"
OUT="${OUT:-/tmp/jsparse_out}"; mkdir -p "$OUT"
python3 -m pip install -e . --no-deps --no-build-isolation --no-index -q > "$OUT/session.log" 2>&1
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv >> "$OUT/session.log" 2>&1
timeout -k 10 "${PROBE_SECS:-200}" python3 -m benchmarks.triton_ir_probe --out "$OUT" ${PROBE_ARGS:-} 2>&1 | grep -v Deprecation
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
echo "== ncu: $NCU" | tee -a "$OUT/session.log"
if [ -n "$NCU" ]; then
  timeout -k 10 "${NCU_SECS:-120}" "$NCU" --kernel-name regex:gather_gemm --launch-count 1 --page source --print-source sass \
    python3 -m benchmarks.tf32_probe --only 'fwd_f32_K_128x128x32_w4s4' --repeats 0 --out /tmp/ncu_probe > /tmp/ncu_sass.txt 2>&1
  echo "ncu rc=$? lines=$(wc -l < /tmp/ncu_sass.txt)" | tee -a "$OUT/session.log"
  for op in HGMMA HMMA LDGSTS 'LDG\.' 'LDL|STL' 'WARPGROUP' 'SYNCS'; do
    echo "  SASS $op: $(grep -Ec "$op" /tmp/ncu_sass.txt)" | tee -a "$OUT/session.log"; done
  grep -E "HGMMA|HMMA" /tmp/ncu_sass.txt | head -5 >> "$OUT/session.log"
  tail -5 /tmp/ncu_sass.txt >> "$OUT/session.log"
fi
if [ -n "${TESTS_K:-}" ]; then
  timeout -k 10 "${TESTS_SECS:-150}" python3 -m pytest -m gpu tests/test_gpu.py -q -x -k "$TESTS_K" -p no:cacheprovider \
    2>&1 | tail -30 | tee "$OUT/gpu_tests.log"
fi
echo "== done"; cat "$OUT/session.log" | tail -30
