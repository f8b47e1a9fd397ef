#!/usr/bin/env bash
# Tests and benchmarks on a GPU machine in one go, from the repo root:
#   bash scripts/gpu_session.sh [smoke] [tests] [memory] [suite] [kernels] [tune] [dataparallel]
#                                                                     (no argument: tests suite kernels)
# memory: benchmarks.probes.memory_probe (what is live at the suite's peaks, compile only);
# tune: benchmarks.tune_table (a shipped tuning table for this GPU, no FlexGEMM); dataparallel:
# benchmarks.data_parallel (weak scaling over all GPUs of the machine).
# Steps run in the order given, each under its own `timeout`, all within SESSION_BUDGET seconds (default 560:
# set it to what the machine is yours for). Environment knobs:
#   SUITE_ARGS="--rows 0,1,2 --dtypes fp16"   extra arguments of python -m benchmarks.suite
#   KERNELS_ARGS="--sections gemm"            extra arguments of python -m benchmarks.kernels
#   TESTS_ARGS="-k hash"                      extra pytest arguments
#   GPU_TEST_WORKERS=8                        pytest-xdist workers sharing the GPU (compiling is most of a test)
#   TUNE_ARGS="--dtypes fp16"                 extra arguments of python -m benchmarks.tune_table
#   MEMORY_ARGS="--rows 1,2"                  extra arguments of python -m benchmarks.probes.memory_probe
#   TESTS_TIMEOUT / SMOKE_TIMEOUT / SUITE_TIMEOUT / KERNELS_TIMEOUT   per-step limits in seconds
#   JSPARSE_COMMIT                            commit id recorded in the results (for a checkout without .git)
#   PIP_INSTALL_ARGS                          arguments of the editable install (default: offline, no deps)
#   FLEXGEMM_INSTALL                          a script that builds FlexGEMM, run first if it exists and
#                                             flex_gemm does not import (default .anchors/install_flexgemm.sh)
# Files land in $OUT (default /tmp/jsparse_out): session.log (environment, installs, smoke, step status),
# gpu_tests.log, suite.log, suite.json, suite.md, suite.png, kernels.log, kernels.json, and per step its log.
set -o pipefail
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the checkout is importable even if the install fails
# Test-only packages the GPU image lacks (pytest-xdist, hypothesis), when carried: `make gpu-test-deps`.
[ -d .gpu_test_deps ] && export PYTHONPATH="$PYTHONPATH:$PWD/.gpu_test_deps"
OUT="${OUT:-/tmp/jsparse_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
LOG="$OUT/session.log"
START=$SECONDS
BUDGET="${SESSION_BUDGET:-560}"
STATUS=()

log() { echo "[gpu_session +$((SECONDS - START))s] $*" | tee -a "$LOG"; }
remaining() { echo $((BUDGET - (SECONDS - START))); }
# limit WANTED: the step's time limit, cut to what is left of the budget (minus a margin for the summary).
limit() { local r; r=$(( $(remaining) - 15 )); [ "$1" -lt "$r" ] && r=$1; echo "$r"; }

# run_step NAME LOGFILE SECONDS CMD...: runs CMD under timeout, output to LOGFILE and stdout.
run_step() {
  local name=$1 logfile=$2 secs=$3; shift 3
  if [ "$secs" -lt 20 ]; then
    log "$name: SKIPPED (only ${secs}s left)"; STATUS+=("$name: skipped (no time left)"); return
  fi
  log "$name: start, limit ${secs}s: $*"
  local t0=$SECONDS
  timeout -k 15 "$secs" "$@" 2>&1 | tee -a "$logfile"
  local rc=$?
  local msg="rc=$rc after $((SECONDS - t0))s"
  [ $rc -eq 124 ] || [ $rc -eq 137 ] && msg="$msg (TIMED OUT)"
  log "$name: $msg"; STATUS+=("$name: $msg")
}

[ $# -eq 0 ] && set -- tests suite kernels
log "steps: $*; budget ${BUDGET}s; OUT=$OUT"
{
  echo "== date: $(date -u)"; echo "== uname: $(uname -a)"
  echo "== nvidia-smi"; nvidia-smi 2>&1
  echo "== python: $(command -v "$PY")"
  "$PY" -c 'import sys, jax, jaxlib; print(sys.version); print("jax", jax.__version__, "jaxlib", jaxlib.__version__); print(jax.devices())' 2>&1
  "$PY" -c 'import torch, triton; print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.is_available(), "triton", triton.__version__)' 2>&1
} >>"$LOG" 2>&1

# By default the install works offline: no build isolation (pip would fetch setuptools) and no index.
PIP_INSTALL_ARGS="${PIP_INSTALL_ARGS---no-deps --no-build-isolation --no-index}"
log "pip install -e . $PIP_INSTALL_ARGS"
# shellcheck disable=SC2086
"$PY" -m pip install -e . $PIP_INSTALL_ARGS -q >>"$LOG" 2>&1 \
  || log "pip install -e . failed (continuing with PYTHONPATH=$PWD)"

FLEXGEMM_INSTALL="${FLEXGEMM_INSTALL:-.anchors/install_flexgemm.sh}"
if [ -f "$FLEXGEMM_INSTALL" ]; then
  if "$PY" -c 'import flex_gemm' >/dev/null 2>&1; then
    log "flex_gemm already installed"
  else
    log "building FlexGEMM"
    timeout -k 10 "$(limit 300)" bash "$FLEXGEMM_INSTALL" >>"$LOG" 2>&1 \
      && log "FlexGEMM installed" || log "FlexGEMM install FAILED (benchmarks run without it)"
  fi
else
  log "no $FLEXGEMM_INSTALL: FlexGEMM not installed (benchmarks run without it)"
fi

steps=("$@")
for i in "${!steps[@]}"; do
  step=${steps[$i]}
  later=" ${steps[*]:$((i + 1))} "
  case "$step" in
    smoke)
      # Harness check on this machine (real Pallas kernels, FlexGEMM if built): tiny sizes, outputs in /tmp.
      run_step smoke-suite "$LOG" "$(limit "${SMOKE_TIMEOUT:-240}")" \
        "$PY" -m benchmarks.suite --smoke --out /tmp/jsparse_smoke
      run_step smoke-kernels "$LOG" "$(limit "${SMOKE_TIMEOUT:-240}")" \
        "$PY" -m benchmarks.kernels --smoke --out /tmp/jsparse_smoke ;;
    tests)
      # shellcheck disable=SC2086
      run_step tests "$OUT/gpu_tests.log" "$(limit "${TESTS_TIMEOUT:-500}")" \
        "$PY" -m pytest -m gpu tests -x -q -n "${GPU_TEST_WORKERS:-8}" --ignore=tests/test_notebooks.py $TESTS_ARGS ;;
    suite)
      # Without SUITE_TIMEOUT the suite gets what is left, less KERNELS_TIMEOUT (default 240 s) if kernels follows.
      reserve=0; [[ "$later" == *" kernels "* ]] && reserve=${KERNELS_TIMEOUT:-240}
      secs=$(limit "${SUITE_TIMEOUT:-$(( $(remaining) - reserve - 15 ))}")
      # The suite starts no new workload after secs-90 s, so it normally ends with a full report.
      # shellcheck disable=SC2086
      run_step suite "$OUT/suite.log" "$secs" \
        "$PY" -m benchmarks.suite --out "$OUT" --time-budget $((secs > 120 ? secs - 90 : secs / 2)) $SUITE_ARGS ;;
    kernels)
      # shellcheck disable=SC2086
      run_step kernels "$OUT/kernels.log" "$(limit "${KERNELS_TIMEOUT:-100000}")" \
        "$PY" -m benchmarks.kernels --out "$OUT" $KERNELS_ARGS ;;
    tune)
      secs=$(limit "${TUNE_TIMEOUT:-$(( $(remaining) - 15 ))}")
      # shellcheck disable=SC2086
      run_step tune "$OUT/tune.log" "$secs" \
        "$PY" -m benchmarks.tune_table --out "$OUT" --time-budget $((secs > 120 ? secs - 60 : secs / 2)) $TUNE_ARGS ;;
    memory)
      # shellcheck disable=SC2086
      run_step memory "$OUT/memory.log" "$(limit "${MEMORY_TIMEOUT:-150}")" \
        "$PY" -m benchmarks.probes.memory_probe $MEMORY_ARGS ;;
    dataparallel)
      run_step dataparallel "$OUT/data_parallel.log" "$(limit "${DP_TIMEOUT:-200}")" \
        "$PY" -m benchmarks.data_parallel --out "$OUT" ;;
    *)
      log "unknown step '$step' (choose from smoke tests memory suite kernels tune dataparallel)"; STATUS+=("$step: unknown") ;;
  esac
done

rm -f "$OUT"/*.tmp  # a half-written suite.json.tmp (step killed mid-write) is not a result
# Summary last, where the end of a long output shows it.
{
  echo; echo "== files in $OUT:"; ls -la "$OUT"
  echo "== step status (total $((SECONDS - START))s):"; printf '  %s\n' "${STATUS[@]}"
} | tee -a "$LOG"
if [ -f "$OUT/suite.md" ]; then
  echo; sed -n '/^## Geometric-mean/,$p' "$OUT/suite.md"
fi
