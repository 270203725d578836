#!/usr/bin/env bash
# Lesson 06 / plan-run results on one GPU call: the GPU tests (compiled kernels vs float64,
# planned calls without a sync, CUDA graph replay with new values, input layouts), then every
# standard case with the kernels, the public call without a plan (auto), with a plan
# (auto_planned) and replayed from a CUDA graph (auto_graph), SDPA and FlashInfer; the dense
# bf16 matmul rate; the host microseconds of each step around the kernel; and the page-size
# sweep 1..256 on B64_L4096. Writes to $OUT: gpu_tests.log, decode.json/.png, page_size.json,
# bench.log (copy them to results/h200/).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:${PYTHONPATH:-}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
timeout 100 python3 -m pytest tests/test_gpu.py -q -o addopts= -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tests.log" | tail -15
python3 -m paged_bench decode --out "$OUT/decode.json" \
    --backends triton,triton_split,auto,auto_planned,auto_graph,sdpa_contiguous,flashinfer \
    --page-sweep B64_L4096 2>&1 | grep -v "^cases:" | tee "$OUT/bench.log"
