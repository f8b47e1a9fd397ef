#!/usr/bin/env bash
# Tunes spconv-triton's kernels for the networks benchmark in parallel. spconv-triton autotunes every kernel shape
# on its first calls and compiles each of ~40 configurations per shape on one CPU core: in one process TF32
# alone outlasts a 10-minute device call. Here SHARDS processes per (network, dtype) share the tuning keys
# (`--tune-shard`, benchmarks/triton_tuning_shards.py: each tunes its own share and runs the others' kernels
# untuned), spread round-robin over the visible GPUs. The processes run the spconv-triton side only (JAX on the
# CPU, no jsparse), training mode (its forward covers inference's kernels), small inputs (the matrix rows do not
# key the tuning, so large inputs reuse it). Tuning results land in TRITON_CACHE_DIR; carry them to the next call
# with scripts/triton_autotune_cache.sh. Processes tune at the same time, so a choice can be a slower
# configuration than a quiet machine would pick: this only ever slows spconv-triton.
#   TRITON_CACHE_DIR=/tmp/tc bash scripts/warm_spconv_triton.sh SECONDS LOG_DIR [NETWORKS] [DTYPES] [SHARDS]
set -uo pipefail
: "${TRITON_CACHE_DIR:?set TRITON_CACHE_DIR to the cache to fill}"
usage="usage: $0 SECONDS LOG_DIR [NETWORKS] [DTYPES] [SHARDS]"
limit=${1:?$usage}
logs=${2:?$usage}
networks=${3:-second,second_pool,minkunet,decoder}
dtypes=${4:-fp16,tf32}
shards=${5:-1}
# The GPUs to spread over: CUDA_VISIBLE_DEVICES's list if set, else every GPU's index (one line each, MIG or not).
IFS=, read -r -a gpus <<< "${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null \
  | tr -d ' ' | paste -sd, -)}"
[ "${#gpus[@]}" -ge 1 ] || gpus=(0)
mkdir -p "$logs"
n=0
for net in ${networks//,/ }; do
  for dt in ${dtypes//,/ }; do
    for ((s = 0; s < shards; s++)); do
      JAX_PLATFORMS=cpu CUDA_VISIBLE_DEVICES=${gpus[n % ${#gpus[@]}]} timeout -k 10 "$limit" \
        python3 -m benchmarks.networks --networks "$net" --sizes small --dtypes "$dt" --modes train --anchors spconv-triton --skip-jsparse \
        --warmup 1 --repeats 1 --tune-shard "$s/$shards" > "$logs/warm_${net}_${dt}_${s}of${shards}.log" 2>&1 &
      n=$((n + 1))
    done
  done
done
wait
for f in "$logs"/warm_*.log; do echo "== $f"; tail -n 3 "$f"; done
echo "tuning results: $(find "$TRITON_CACHE_DIR" -name '*.autotune.json' | wc -l)"
