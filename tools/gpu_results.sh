#!/usr/bin/env bash
# The committed H200 results: GPU tests, every standard case with every backend and peer, then
# (optionally, CHUNKS=1) the chunk-count sweep of lesson 05, then the lesson notebooks 03-05
# run as plain Python with their GPU cells. Writes decode.json/.png, chunks.json/.png and logs
# to $OUT (copy them to results/h200/).
set -uo pipefail
bash tools/gpu_run.sh
export PYTHONPATH=$PWD:/tmp/site
for impl in solutions exercises; do   # compiled kernels; unsolved stubs must say so, not crash
    python3 -m pytest tests/exercises -q -o addopts= -p no:cacheprovider --impl $impl 2>&1 \
        | tail -1 | sed "s/^/exercises --impl $impl: /"
done | tee "$OUT/gpu_exercises.log"
if [ "${CHUNKS:-0}" = 1 ]; then
    python3 -m paged_bench decode --cases B1_L131072,B8_L32768,B32_ragged,B4_L2048 \
        --backends triton_split --sweep-chunks 1,2,4,8,16,32,64,128,256,512 \
        --out "$OUT/chunks.json" 2>&1 | grep -v "^cases:" | tail -3
fi
NOTEBOOKS="notebooks/03_gather_attention.ipynb notebooks/04_triton_paged_decode.ipynb \
    notebooks/05_split_kv.ipynb" bash tools/gpu/notebooks.sh  # ($OUT/gpu_notebooks*.log)
