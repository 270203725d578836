#!/usr/bin/env bash
# Every lesson top to bottom on the GPU machine, as plain Python (it has no Jupyter), each in a
# fresh process, against the worked solutions: the GPU cells run instead of skipping. Lesson 09
# needs SmolLM2's GGUF file and the gguf package, which that machine lacks: set NOTEBOOKS to
# choose. Writes $OUT/gpu_notebooks.log (a line each) and gpu_notebooks_full.log.
#   NOTEBOOKS="notebooks/04_*.ipynb" bash tools/gpu/notebooks.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
OUT=${OUT:-/tmp/notebooks_out}; mkdir -p "$OUT"
LOG="$OUT/gpu_notebooks.log"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$LOG"
for nb in ${NOTEBOOKS:-notebooks/[01][0-9]_*.ipynb}; do
    PAGED_REF_IMPL=${IMPL:-solutions} timeout "${NOTEBOOK_SECONDS:-150}" \
        python3 tools/run_notebook_plain.py "$nb" > "$OUT/notebook.log" 2>&1
    rc=$?
    { echo "== $(basename "$nb"): exit $rc"; cat "$OUT/notebook.log"; } >> "$OUT/gpu_notebooks_full.log"
    echo "$(basename "$nb"): exit $rc | $(tail -1 "$OUT/notebook.log")" | tee -a "$LOG"
done
rm -f "$OUT/notebook.log"
