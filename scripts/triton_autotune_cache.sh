#!/usr/bin/env bash
# Carries Triton's on-disk autotuning results from one GPU call to the next, so that an anchor which tunes every
# kernel shape on its first calls (spconv-triton: minutes per network, more than one call allows) can warm up
# over several calls and be timed in a later one. Only the results travel (`*.autotune.json`, a few kB each):
# a warm process then compiles just the chosen configuration of each kernel.
#   bash scripts/triton_autotune_cache.sh pack CACHE_DIR OUT_FILE     # after a run with TRITON_CACHE_DIR=CACHE_DIR
#   bash scripts/triton_autotune_cache.sh unpack IN_FILE CACHE_DIR    # before the next, with the same TRITON_CACHE_DIR
# Triton keys each result by the kernel's source, its autotuning key and the configurations, so a result is
# only reused for the same library, Triton version and arguments' key.
set -euo pipefail
case "${1:-}" in
  pack)
    [ $# -eq 3 ] || { echo "usage: $0 pack CACHE_DIR OUT_FILE" >&2; exit 2; }
    cd "$2"
    find . -name '*.autotune.json' -print0 | tar --null -czf "$3" -T -
    echo "packed $(tar -tzf "$3" | grep -c 'autotune.json$' || true) autotuning results from $2 into $3"
    ;;
  unpack)
    [ $# -eq 3 ] || { echo "usage: $0 unpack IN_FILE CACHE_DIR" >&2; exit 2; }
    mkdir -p "$3"
    tar -xzf "$2" -C "$3"
    echo "unpacked $(tar -tzf "$2" | grep -c 'autotune.json$' || true) autotuning results into $3"
    ;;
  *)
    echo "usage: $0 pack CACHE_DIR OUT_FILE | unpack IN_FILE CACHE_DIR" >&2; exit 2 ;;
esac
