#!/usr/bin/env bash
# One call on the GPU machine: correctness first, then the benchmark. Results go to $OUT.
#   tools/gpu_run.sh [bench arguments...]
# FlashInfer and its tvm-ffi dependency travel as wheels in .whl/ (see docs/gpu.md).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
    export CUDA_HOME=$(dirname "$(dirname "$(which nvcc)")")
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
python3 -m pytest tests/test_gpu.py -q -o addopts= -p no:cacheprovider -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -4
python3 -m paged_bench decode --out "$OUT/decode.json" "$@" 2>&1 | grep -v "^cases:"
