#!/usr/bin/env bash
# One call on the GPU machine for issue 35's small-batch host path and first-call stall:
# the GPU tests of the bound planned call and of the engine's warm-up, then
#   python -m paged_bench host_path  (B4_L2048 planned call vs FlashInfer's run(), both merges)
#   python -m paged_bench warmup     (first vs second generate, fresh Triton cache, with and
#                                     without warm-up)
# JSON and logs go to $OUT.   bash tools/gpu/host_warmup.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LOG="$OUT/host_warmup.log"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$LOG"
timeout 300 python3 -m pytest tests/test_gpu_planned.py tests/test_planned.py tests/test_plan.py \
  tests/test_gpu.py tests/engine/test_warmup_gpu.py tests/engine/test_warmup.py -q -s \
  -o addopts= -p no:cacheprovider 2>&1 | tail -25 | tee -a "$LOG"
for merge in plan kernel; do
  timeout 120 python3 -m paged_bench host_path --merge "$merge" \
    --out "$OUT/host_path_$merge.json" 2>&1 | tee -a "$LOG"
done
for flag in "" --no-warmup; do
  TRITON_CACHE_DIR=$(mktemp -d) timeout 240 python3 -m paged_bench warmup $flag \
    --out "$OUT/warmup${flag:+_cold}.json" 2>&1 | tee -a "$LOG"
done
