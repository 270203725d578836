#!/usr/bin/env bash
# Tuning run (lesson 05): GPU tests, then every standard case over a grid of kernel configs,
# then a sweep over the number of split-KV chunks. Results go to $OUT.
set -uo pipefail
bash tools/gpu_run.sh --sweep-configs --backends triton,triton_split,flashinfer
PYTHONPATH=$PWD:/tmp/site python3 -m paged_bench decode --cases B1_L131072,B8_L32768,B4_L2048 \
    --backends triton_split --sweep-chunks 1,2,4,8,16,32,64,128,256,512 \
    --out "$OUT/chunks.json" 2>&1 | grep -v "^cases:" | tail -40
