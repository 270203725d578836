#!/usr/bin/env bash
# One call on the GPU machine for lesson 09's engine: GPU engine tests (greedy tokens vs
# transformers on random weights, CUDA graphs, Triton kernels compiled), then the serving
# benchmark (python -m paged_bench engine). JSON, plot and logs go to $OUT.
#   bash tools/gpu/engine.sh [bench arguments...]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv | tee "$OUT/engine_gpu.log"
python3 -c "import transformers, torch, triton; print('transformers', transformers.__version__, 'torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/engine_gpu.log"
timeout 110 python3 -m pytest tests/engine/test_engine_gpu.py -q -s -o addopts= -p no:cacheprovider 2>&1 | tail -15 | tee -a "$OUT/engine_gpu.log"
timeout 270 python3 -m paged_bench engine --out "$OUT" "$@" 2>&1 | tee "$OUT/engine_bench.log" | tail -40
