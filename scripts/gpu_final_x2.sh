#!/usr/bin/env bash
# One call on a 2-GPU H200 machine: fp16 train rows 4-6 and tf32 rows 0-1 of the suite on GPU 0 (with FlexGEMM, same
# process), the data-parallel benchmark over both GPUs, and the GPU data-parallel test. Logs in $OUT/{a,b,dp}.
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH="$PWD"
OUT="${OUT:-/tmp/jsparse_out}"; mkdir -p "$OUT/a" "$OUT/b" "$OUT/dp"
python3 -m pip install -e . --no-deps --no-build-isolation --no-index -q > "$OUT/dp/install.log" 2>&1
nvidia-smi -L >> "$OUT/dp/install.log"
timeout 120 python3 -m benchmarks.data_parallel --out "$OUT/dp" 2>&1 | grep -v Deprec | tail -15
timeout 60 python3 -m pytest -m gpu tests/test_gpu.py -q -k data_parallel -p no:cacheprovider 2>&1 | tail -3
timeout 100 bash .anchors/install_flexgemm.sh >> "$OUT/dp/install.log" 2>&1 || echo "FlexGEMM build failed"
export CUDA_VISIBLE_DEVICES=0
timeout 200 python3 -m benchmarks.suite --out "$OUT/a" --rows 4,5,6 --dtypes fp16 --modes train --flexgemm-input-grad \
  --repeats 20 2>&1 | grep -E "ratio|^\[" 
timeout 100 python3 -m benchmarks.suite --out "$OUT/b" --rows 0,1 --dtypes tf32 --flexgemm-input-grad --repeats 10 \
  2>&1 | grep -E "ratio|^\["
