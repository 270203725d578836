#!/usr/bin/env bash
# One call on the GPU machine for prefill over quantised caches (lesson 10): the prefill GPU
# tests (plain and FP8 / INT4 caches, every swept tile shape, decode-only batches handed to the
# CUDA decode kernels) and the engine's GPU tests, then the prefill cases over bf16 and
# quantised caches: our Triton kernel, the torch backend (what the engine used to run on a
# quantised cache) and FlashInfer's FP8 prefill. Results go to $OUT.
#   bash tools/gpu/quant_prefill.sh [bench arguments...]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/quant_prefill_out}; mkdir -p "$OUT"
LOG="$OUT/quant_prefill_gpu.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$LOG"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    timeout "${TEST_SECONDS:-240}" python3 -m pytest tests/test_gpu_prefill.py \
        tests/engine/test_engine_gpu.py -q -o addopts= -p no:cacheprovider 2>&1 \
        | tee -a "$LOG" | tail -6
fi
timeout "${BENCH_SECONDS:-300}" python3 -m paged_bench prefill \
    --out "$OUT/prefill_quant.json" --backends triton,torch,flashinfer \
    --cases P8_L2048,P8_L2048_prefix4096,P1_L16384,P32_chunk512_ctx8192 \
    --kv-formats fp8,fp8_token_head,int4 --no-extras "$@" 2>&1 | tee -a "$LOG"
echo "exit codes: ${PIPESTATUS[*]}" | tee -a "$LOG"
