#!/usr/bin/env bash
# One call on the GPU machine for issue 35's public calls and issue 37's engine time:
#   the GPU tests of the unplanned path (the remembered plan) and the planned call, then
#   python -m paged_bench decode     (the public call: auto, auto_planned, auto_graph, peers)
#   python -m paged_bench host_path  (B1_L131072 and B32_ragged: unplanned host vs GPU time)
#   python -m paged_bench prefill    (auto, auto_planned, the kernel, FlashInfer; no extras)
#   python -m paged_bench warmup     (first vs second generate, fresh Triton cache)
#   python -m paged_bench engine     (1B-like: wall vs GPU busy time, the decode step's kernels)
# Carry .whl (FlashInfer, tvm-ffi, hypothesis, ...). The log goes to $OUT/public_calls.log, the
# JSON files into $OUT/results.tgz (packed after each step: $OUT returns few files, and a step
# cut by the deadline keeps the earlier ones). The whole call ends by DEADLINE_S (560).
# STEPS="tests decode host_path prefill warmup engine" (the default: all) chooses the steps.
#   PAGED_REF_COMMIT=<hash> bash tools/gpu/public_calls.sh
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 5
export PYTHONPATH=$PWD:/tmp/site CUDA_HOME=$(dirname "$(dirname "$(which nvcc)")")
LOG="$OUT/public_calls.log" RES=/tmp/public_calls
mkdir -p "$RES"
t0=$(date +%s)
STEPS=" ${STEPS:-tests decode host_path prefill warmup engine} "
want() { [[ "$STEPS" == *" $1 "* ]]; }
stamp() {  # a step's heading; packs what the steps before it wrote
    tar -C "$RES" -czf "$OUT/results.tgz" .
    echo "== $1 ($(( $(date +%s) - t0 )) s)" | tee -a "$LOG"
}
left() {  # seconds for a step: at most $1, and never past the deadline
    local rest=$(( ${DEADLINE_S:-560} - ($(date +%s) - t0) ))
    echo $(( rest < $1 ? (rest > 1 ? rest : 1) : $1 ))
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG"
if want tests; then
stamp tests
timeout $(left 120) python3 -m pytest tests/test_checked_while_running.py tests/test_planned.py -q \
    -o addopts= -p no:cacheprovider 2>&1 | tail -4 | tee -a "$LOG"
fi
if want decode; then
stamp decode
timeout $(left 200) python3 -m paged_bench decode --out "$RES/decode.json" \
    --backends triton_split,auto,auto_planned,auto_graph,flashinfer 2>&1 \
    | grep -v "^cases:" | tail -40 >> "$LOG"
fi
if want host_path; then
stamp host_path
for case in B1_L131072 B32_ragged B4_L2048; do
    timeout $(left 40) python3 -m paged_bench host_path --case "$case" --calls 2000 --unplanned \
        --out "$RES/host_path_$case.json" 2>&1 | grep -v wrote >> "$LOG"
done
fi
if want prefill; then
stamp prefill
timeout $(left 180) python3 -m paged_bench prefill --no-extras --backends triton,auto,auto_planned,flashinfer \
    --out "$RES/prefill.json" 2>&1 | tail -30 >> "$LOG"
fi
if want warmup; then
stamp warmup
TRITON_CACHE_DIR=$(mktemp -d) timeout $(left 100) python3 -m paged_bench warmup \
    --out "$RES/warmup.json" 2>&1 | tail -6 >> "$LOG"
fi
if want warmup_unfrozen; then  # (not in the default steps: the same without gc.freeze)
stamp warmup_unfrozen
TRITON_CACHE_DIR=$(mktemp -d) timeout $(left 100) python3 -m paged_bench warmup --unfreeze \
    --out "$RES/warmup_unfrozen.json" 2>&1 | tail -6 >> "$LOG"
fi
if want engine; then
stamp engine
timeout $(left 120) python3 -m paged_bench engine --shapes llama-3.2-1b-like \
    --systems engine,generate_batch --budgets "" --out "$RES/engine" 2>&1 | tail -6 >> "$LOG"
fi
stamp done
