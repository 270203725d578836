#!/usr/bin/env bash
# The committed H200 results: GPU tests, every standard case with every backend and peer, then
# the chunk-count sweep of lesson 05. Writes bench.json/.png, chunks.json/.png, gpu_tests.log
# to $OUT (copy them to benchmarks/h200/).
set -uo pipefail
bash tools/gpu_run.sh
PYTHONPATH=$PWD:/tmp/site python3 -m paged_ref.bench \
    --cases B1_L131072,B8_L32768,B32_ragged,B4_L2048 --backends triton_split \
    --sweep-chunks 1,2,4,8,16,32,64,128,256,512 --out "$OUT/chunks.json" 2>&1 \
    | grep -v "^cases:" | tail -3
