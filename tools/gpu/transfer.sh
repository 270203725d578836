#!/usr/bin/env bash
# Lesson 11 on a two-GPU machine (kind nvidia-h200-x2): NCCL correctness, then the transfer
# benchmark. Writes gpu_two_tests.log and transfer.json to $OUT (commit to results/h200x2/).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
nvidia-smi --query-gpu=name,driver_version --format=csv
nvidia-smi topo -m | head -5
python3 -m pytest tests/test_gpu_two.py tests/transfer/test_transfer.py -q -o addopts= -p no:cacheprovider \
    2>&1 | tee "$OUT/gpu_two_tests.log" | tail -3
python3 -m paged_bench transfer --out "$OUT/transfer.json" ${TRANSFER_ARGS:-} 2>&1 \
    | tee "$OUT/transfer.log" | tail -30
