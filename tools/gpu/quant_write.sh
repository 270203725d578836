#!/usr/bin/env bash
# One call on the GPU machine for the engine's quantising write (lesson 10, under 5 minutes):
# the Triton write kernel's byte-for-byte tests against quant.write_slots, compiled; the
# engine's tests over quantised caches; then the same KV memory in each format, in the engine,
# with each format's decode step and its kernels a layer (python -m paged_bench engine
# --format-budget-mib). Results go to $OUT. Carry build/cubins.tar.xz for the CUDA
# decode kernels (tar -C build -xJf build/cubins.tar.xz; PAGED_REF_CACHE=$PWD/build/cubins).
#   bash tools/gpu/quant_write.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/quant_write_out}; mkdir -p "$OUT"
LOG="$OUT/quant_write_gpu.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG"
timeout "${TEST_SECONDS:-120}" python3 -m pytest tests/kernels/test_triton_quant_write.py \
    tests/engine/test_engine_quant.py \
    tests/kernels/cuda/test_decode_gpu.py::test_engine_decodes_fp8_caches_with_the_cuda_kernels \
    -q -o addopts= -p no:cacheprovider -k "not planted" 2>&1 | tee -a "$LOG" | tail -4
timeout "${SWEEP_SECONDS:-240}" python3 -m paged_bench engine --shapes "" \
    --budgets "" --format-budget-mib 360 --format-requests 1024 --output-len 128 \
    --kv-formats plain,fp8,fp8_token_head,int4 --out "$OUT/formats" 2>&1 | grep "^{" \
    | tee -a "$LOG"
