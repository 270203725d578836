#!/usr/bin/env bash
# One call on the GPU machine for lesson 08: the compiled prefill kernels against float64, then
# the prefill benchmark (with the tile-shape sweep). Results and logs go to $OUT.
#   bash tools/gpu/prefill.sh [bench arguments...]
# FlashInfer and its tvm-ffi dependency travel as wheels (see docs/gpu.md); the caller
# puts them on PYTHONPATH and sets CUDA_HOME for FlashInfer's JIT.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
timeout "${TEST_TIMEOUT:-75}" python3 -m pytest tests/test_gpu_prefill.py -q -o addopts= \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_prefill_tests.log" | tail -6
timeout "${BENCH_TIMEOUT:-175}" python3 -m paged_bench prefill \
    --out "$OUT/prefill.json" "$@" 2>&1 | tee "$OUT/bench_prefill.log"
