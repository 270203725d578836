#!/usr/bin/env bash
# One call on the GPU machine for lesson 10 (under 5 minutes): the quantised kernels (Triton,
# and the CUDA FP8 / INT4 kernels with their planted mistakes) compiled and checked against
# float64 (of the de-quantised cache), then the quantised-cache benchmark: ours on every case
# and format, FlashInfer's FP8 decode, a small launch-config sweep on B64_L4096. The JSON is
# rewritten after every case. Results go to $OUT. (tools/gpu/precompile_cuda.py builds the
# CUDA cubins beforehand, off the GPU: set PAGED_REF_CACHE to the carried folder.)
#   bash tools/gpu/quant.sh [bench arguments...]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/quant_out}; mkdir -p "$OUT"
LOG="$OUT/quant_gpu.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$LOG"
timeout "${TEST_SECONDS:-90}" python3 -m pytest tests/test_gpu_quant.py tests/kernels/cuda/test_decode_gpu.py \
    -q -o addopts= -p no:cacheprovider 2>&1 | tee -a "$LOG" | tail -6
timeout "${BENCH_SECONDS:-135}" python3 -m paged_bench quant --out "$OUT/quant.json" \
    --flashinfer-cases B64_L4096,B8_L32768,B256_L1024 \
    --sweep-configs B64_L4096 "$@" 2>&1 | grep -v "^cases:" | tee -a "$LOG"
echo "exit codes: ${PIPESTATUS[*]}" | tee -a "$LOG"
