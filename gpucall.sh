#!/bin/bash
# Untracked helper for packed device calls (deleted before the session ends).
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
python3 -m pip install -e . --no-deps -q 2>&1 | tail -1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee $OUT/gpu.txt
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    ab)
      timeout 360 python3 -m benchmarks.probes.ab_networks .ab/base . --rounds 1 -- --networks minkunet,second \
        --sizes large --dtypes fp16 --modes train --anchors '' --repeats 8 > $OUT/ab.log 2>&1; tail -8 $OUT/ab.log ;;
    abbn)
      timeout 330 python3 -m benchmarks.probes.ab_networks .ab/base .ab/pallasbn --rounds 1 -- --networks minkunet,second \
        --sizes large --dtypes fp16 --modes train --anchors '' --repeats 8 > $OUT/abbn.log 2>&1; tail -5 $OUT/abbn.log ;;
    abgn)
      timeout 200 python3 -m benchmarks.probes.ab_networks .ab/gnbase .ab/base --rounds 1 -- --networks decoder \
        --sizes small --dtypes fp16 --anchors '' --repeats 10 > $OUT/abgn.log 2>&1; tail -5 $OUT/abgn.log ;;
    mapprof)
      timeout 150 python3 -m benchmarks.probes.map_plan_profile --res 256,512 > $OUT/mapprof.log 2>&1; tail -60 $OUT/mapprof.log ;;
    mem)
      for t in base slice; do (cd .ab/$t && PYTHONPATH=$PWD timeout 200 python3 -m benchmarks.probes.network_memory --networks minkunet --sizes large --dtypes fp16 --modes train --top 30) > $OUT/mem_$t.log 2>&1; tail -3 $OUT/mem_$t.log; done ;;
    decprof)
      for t in gnbase base; do (cd .ab/$t && PYTHONPATH=$PWD timeout 150 python3 -m benchmarks.networks --networks decoder --sizes small --dtypes fp16 --modes train --anchors '' --profile --out /tmp/dp_$t) > /tmp/dp_$t.log 2>&1; tail -40 /tmp/dp_$t.log >> $OUT/decprof.log; cp /tmp/dp_$t/networks.json $OUT/dp_$t.json; done; tail -5 $OUT/decprof.log ;;
    abdec)
      timeout 200 python3 -m benchmarks.probes.ab_networks .ab/base . --rounds 1 -- --networks decoder \
        --sizes small --dtypes fp16,tf32 --anchors '' --repeats 10 > $OUT/abdec.log 2>&1; tail -7 $OUT/abdec.log ;;
    decprofhead)
      timeout 150 python3 -m benchmarks.networks --networks decoder --sizes small --dtypes fp16 --modes train --anchors '' --profile --out /tmp/dph > /tmp/dph.log 2>&1; grep -A14 "Per-op" /tmp/dph.log | head -16; cp /tmp/dph/networks.json $OUT/dp_head.json ;;
    gputests)
      timeout 200 python3 -m pytest -q -p no:randomly tests/test_per_item.py tests/test_nn.py tests/test_networks.py -k "per_item or group or decoder" > $OUT/gputests.log 2>&1; tail -3 $OUT/gputests.log ;;
    ablarge)
      timeout 330 python3 -m benchmarks.probes.ab_networks .ab/base . --rounds 1 -- --networks decoder \
        --sizes large --dtypes fp16 --anchors '' --warmup 2 --repeats 5 > $OUT/ablarge.log 2>&1; tail -5 $OUT/ablarge.log ;;
    abfused)
      timeout 420 python3 -m benchmarks.probes.ab_networks .ab/base . --rounds 1 -- --networks decoder \
        --sizes small,large --dtypes fp16 --modes train --anchors '' --warmup 2 --repeats 5 > $OUT/abfused.log 2>&1; tail -5 $OUT/abfused.log ;;
    pitest)
      timeout 100 python3 -m pytest -q -p no:randomly tests/test_per_item.py > $OUT/pitest.log 2>&1; tail -2 $OUT/pitest.log ;;
    mask)
      timeout 200 python3 -m pytest -q -p no:randomly tests/test_networks.py -k forward_masks > $OUT/mask.log 2>&1; tail -3 $OUT/mask.log ;;
    gn)
      timeout 150 python3 -m pytest -q -p no:randomly tests/test_nn.py -k "group_norm or barrier or saved_residuals or residual_block" > $OUT/gn.log 2>&1; tail -3 $OUT/gn.log ;;
    spconv)
      bash .anchors/install_spconv.sh > /tmp/spconv_install.log 2>&1; tail -2 /tmp/spconv_install.log ;;
    decoder)
      PYTHONPATH=/tmp/site:$PWD timeout 400 python3 -m benchmarks.networks --networks decoder --sizes small --repeats 8 --out /tmp/dec > $OUT/decoder.log 2>&1; tail -25 $OUT/decoder.log; cp /tmp/dec/networks.json $OUT/decoder.json ;;
    prof)
      timeout 200 python3 -m benchmarks.networks --networks minkunet --sizes large --dtypes fp16 --modes train --anchors '' --profile --out /tmp/prof > $OUT/prof.log 2>&1; tail -30 $OUT/prof.log; cp /tmp/prof/networks.json $OUT/prof.json ;;
  esac
done
echo "=== done $(date +%T)"
