#!/usr/bin/env bash
# Issue 15's probe on a two-GPU machine (kind nvidia-h200-x2, about 3-4 minutes, cut at
# PROBE_SECONDS): where the packed KV transfer loses ~2.5 ms against one contiguous NCCL
# send/recv (copy kernels holding the SMs, index_copy_, per-message costs, NCCL settings).
# Writes transfer_probe.json (rewritten after every pair of processes) and transfer_probe.log
# to $OUT.   bash tools/gpu/transfer_probe.sh [transfer_probe.py arguments...]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/transfer_probe_out}; mkdir -p "$OUT"
LOG="$OUT/transfer_probe.log"
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  nvidia-smi topo -m | head -5; } 2>&1 | tee "$LOG"
timeout --kill-after=10 "${PROBE_SECONDS:-300}" python3 tools/gpu/transfer_probe.py \
    --out "$OUT/transfer_probe.json" "$@" 2>&1 | tee -a "$LOG" | grep -v '^\[rank'
echo "exit codes: ${PIPESTATUS[*]}" | tee -a "$LOG"
