"""Registers per thread and programs per multiprocessor for quantised decode (lesson 10).

Compiled for an H200 (``cuobjdump -res-usage``), the one-pass kernel takes 128 registers a
thread on a bf16 cache (tile 64, 4 warps: 4 programs fit on a multiprocessor's 65,536
registers), but 203 on FP8 at tile 128 (2 programs) and 162 on FP8 at tile 64 or INT4 at
tile 32 (3 programs): the de-quantised float16 tiles live in registers. Decode waits on memory,
and fewer programs at once hide less of the wait. ``KernelConfig(maxnreg=N)`` caps the
registers (the compiler keeps the rest in local memory, "spills", if it must). This sweeps
tile, warps, stages and the cap on B64_L4096 for each format, token-major and head-major
blocks (see tools/gpu/quant_prefetch_probe.py), recording each compiled kernel's registers and
spills next to its time; then the best of each on every large case, planned as the library
plans. Every row is checked against float64 first. Run on a GPU from the repository root::

    OUT=/tmp/out PYTHONPATH=$PWD python3 tools/gpu/quant_regs_probe.py

Writes ``$OUT/quant_regs_probe.json``. Measured on an H200 (2026-11-30, committed as
``benchmarks/h200/quant_regs_probe.json``): 64 tokens on 2 warps is best for FP8 (66 %, 232
registers, 4 programs a multiprocessor) and INT4 (23 %); a cap of 128 registers costs 8 points
on FP8 (58 %); so the number of programs at once is not what holds FP8 back.
"""

from __future__ import annotations

import itertools
import sys
import time

import torch
from plan_sweep import time_split  # (this folder is on sys.path when the script runs)
from quant_prefetch_probe import MAX_ERR, inputs, run_large_cases
from quant_probe import start

from paged_bench.decode import bytes_moved
from paged_bench.quant import float64_reference
from paged_course.results import environment, write_result
from paged_ref.kernels.triton import launch
from paged_ref.kernels.triton.decode import KernelConfig
from paged_ref.kernels.triton.split import SplitPlan

#: (tile, warps, stages, maxnreg) per format
SWEEP = {
    "fp8": [(t, w, s, r) for (t, w), s, r in itertools.product(
        ((64, 4), (128, 4), (64, 2), (128, 8)), (3, 2), (128, None, 168))],
    "int4": [(t, w, s, r) for (t, w), s, r in itertools.product(
        ((32, 4), (64, 4), (64, 2), (128, 4)), (3, 4, 2), (128, None))],
}
SWEEP["fp8_token_head"] = SWEEP["fp8"]
RUNS = (("fp8", "tok"), ("fp8", "head"), ("fp8_token_head", "tok"), ("int4", "tok"),
        ("int4", "head"))
BUDGET_S = 330.0


def compiled_resources(keys_before: set) -> dict | None:
    """Registers, spills and shared memory of the kernel the last call compiled (a key new
    to launch's cache), or None when it compiled nothing (the same specialisation ran before:
    head-major blocks have strides divisible by 16 like token-major ones, so the same binary)."""
    new = [k for k in launch._COMPILED if k not in keys_before]
    if not new:
        return None
    kernel = launch._COMPILED[new[-1]]
    return dict(n_regs=kernel.n_regs, n_spills=kernel.n_spills, smem=kernel.metadata.shared)


def main() -> int:
    started = start("quant_regs_probe")
    if started is None:
        return 1
    out_path, copy_bw = started
    t_start = time.perf_counter()
    result = dict(environment(), copy_bw_gbps=copy_bw, rows=[])

    def add(row):
        result["rows"].append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)
        write_result(result, out_path)

    best = {}
    resources = {}  # (fmt, config) -> the compiled kernel's registers, spills, shared memory
    for i, (fmt, layout) in enumerate(RUNS):
        inp, args = inputs("B64_L4096", fmt, layout)
        want = float64_reference(inp).to(torch.float32)
        out = torch.empty_like(inp.q)
        nbytes = bytes_moved(inp)
        for tile, warps, stages, maxnreg in SWEEP[fmt]:
            if time.perf_counter() - t_start > BUDGET_S * (i + 1) / len(RUNS):
                break  # an even share of the budget for each format and layout
            cfg = KernelConfig(tile, warps, stages, maxnreg=maxnreg)
            row = dict(case="B64_L4096", fmt=fmt, layout=layout, **vars(cfg))
            keys_before = set(launch._COMPILED)
            row |= time_split(args, want, SplitPlan(4096, 1), cfg, out, nbytes, copy_bw,
                              MAX_ERR)
            if "ms" in row:
                found = compiled_resources(keys_before)
                resources.setdefault((fmt, cfg), found)
                row |= found or resources.get((fmt, cfg)) or {}
                if row["ms"] < best.get((fmt, layout), (1e9,))[0]:
                    best[(fmt, layout)] = (row["ms"], cfg)
            add(row)
        best.setdefault((fmt, layout), (1e9, None))
        del inp, args, want
        torch.cuda.empty_cache()
    run_large_cases(best, add, copy_bw, skip=("fp8_token_head",))
    print("wrote", out_path, f"in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
