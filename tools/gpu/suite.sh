#!/usr/bin/env bash
# The whole test suite on the GPU machine (everything but the notebooks and the browser test,
# which need Jupyter and Chromium; tools/gpu/notebooks.sh runs the lessons there as plain
# Python): every Triton kernel compiled, the CUDA kernels, the engine with CUDA graphs.
# Writes $OUT/suite.log, stamped with GPU, versions, date and commit (results/h200/suite.log),
# ending with what finished (counted from $OUT/durations.log, so also when the time limit cut
# pytest's summary off: outcomes, failures, the slowest files), and $OUT/failures.log.
# Carry .whl (hypothesis, sortedcontainers, pytest-xdist, execnet, ...) and build/cubins.tar.xz
# (and build/triton_cache.tar.xz, the $OUT/triton_cache.tar.xz of an earlier call, if any).
#   PAGED_REF_COMMIT=<hash> bash tools/gpu/suite.sh [pytest arguments]
# SUITE_TESTS="tests/a.py tests/b.py::test_c" runs those instead of the whole of tests/.
# SUITE_SHARD=k/n runs the k-th of n shares of the test files (sorted, every n-th from the k-th,
# browser tests aside): the whole suite in n calls (carry the Triton cache from one to the next).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/suite_out}; mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl || exit 5
fi
export PYTHONPATH=$PWD:/tmp/site CUDA_HOME=$(dirname "$(dirname "$(which nvcc)")")
if [ -f build/cubins.tar.xz ]; then
    mkdir -p build && tar -C build -xJf build/cubins.tar.xz && export PAGED_REF_CACHE=$PWD/build/cubins
fi
# Triton's cache from an earlier call (build/triton_cache.tar.xz, carried): kernels unchanged
# since are loaded, not compiled again (most of the compiled suite's time). Written back below.
export TRITON_CACHE_DIR=/tmp/triton_cache
mkdir -p "$TRITON_CACHE_DIR"
if [ -f build/triton_cache.tar.xz ]; then
    tar -C "$TRITON_CACHE_DIR" -xJf build/triton_cache.tar.xz
fi
if [ -n "${SUITE_SHARD:-}" ]; then
    k=${SUITE_SHARD%/*} n=${SUITE_SHARD#*/}
    SUITE_TESTS=$(find tests -name 'test_*.py' -not -path 'tests/browser/*' | LC_ALL=C sort \
        | awk -v k="$k" -v n="$n" '(NR - 1) % n == (k - 1) % n' | tr '\n' ' ')
fi
LOG="$OUT/suite.log"
export PAGED_REF_FAILURE_LOG="$OUT/failures.log"  # tracebacks as they happen (tests/conftest.py)
export PAGED_REF_DURATIONS_LOG="$OUT/durations.log"  # each test phase's seconds, as they finish
export PAGED_REF_LOG_ROOT=$PWD  # (only this repository's tests log: not a copy a test runs)
{
    echo "# pytest tests on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader)"
    python3 -c "import sys, torch, triton; print(f'# python {sys.version.split()[0]}, torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}')"
    echo "# date $(date -u +%Y-%m-%d), commit ${PAGED_REF_COMMIT:-unknown}${SUITE_SHARD:+, shard $SUITE_SHARD}"
} | tee "$LOG"
# shellcheck disable=SC2086  (SUITE_TESTS is a list of test paths and ids)
# --dist load: tests go to workers one by one (with loadfile a file's tests share one worker:
# tests/test_gpu.py alone took 504 s of a 540 s shard on an H100, 2026-12-08).
timeout "${SUITE_SECONDS:-540}" python3 -m pytest ${SUITE_TESTS:-tests} --ignore=tests/browser -q -ra \
    -o addopts="-p no:cacheprovider" -n "${WORKERS:-6}" --dist load "$@" 2>&1 \
    | grep -v -e "^tests/.*PASSED" -e "PytestBenchmarkWarning" -e "warner(" | tee -a "$LOG" \
    | tail -25
# What finished, from the durations log (also when the time limit cut pytest's summary off):
# the outcomes, and the files that took longest (to plan shards).
python3 - "$PAGED_REF_DURATIONS_LOG" <<'PY' | tee -a "$LOG"
import collections, pathlib, sys
log = pathlib.Path(sys.argv[1])
outcome, seconds = {}, collections.Counter()  # nodeid -> its outcome; file -> seconds
for line in log.read_text().splitlines() if log.exists() else []:
    secs, when, result, nodeid = line.split(" ", 3)
    seconds[nodeid.split("::")[0]] += float(secs)
    if result == "failed":  # (a failed setup or teardown is an error, as pytest says)
        outcome[nodeid] = "failed" if when == "call" else "error"
    elif result == "skipped" or when == "call":  # (never over a failure seen before)
        outcome.setdefault(nodeid, result)
counts = collections.Counter(outcome.values())
print("# finished (durations log):", ", ".join(f"{n} {k}" for k, n in counts.most_common()))
for nodeid, result in sorted(outcome.items()):
    if result in ("failed", "error"):
        print(f"{result.upper()} {nodeid}")
print("# slowest files (s, summed over their tests):",
      ", ".join(f"{f} {t:.0f}" for f, t in seconds.most_common(12)))
PY
# The cache for the next call (copy it to build/triton_cache.tar.xz and carry it); a call
# with no next one (SUITE_CACHE_OUT=0) saves the time it takes (tens of seconds when large).
if [ "${SUITE_CACHE_OUT:-1}" != 0 ]; then
    tar -C "$TRITON_CACHE_DIR" -cJf "$OUT/triton_cache.tar.xz" . 2>/dev/null || true
fi
