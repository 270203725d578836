"""Register prefetch and head-major blocks for quantised decode (lesson 10, one GPU).

tools/gpu/fp8_pv_probe.py traced the slow FP8 ``p @ V`` to Triton's pipeline: it copies the
next tiles to shared memory as bytes (``cp.async``), and an 8-bit V tile cannot be read back
transposed for the MMA (no 8-bit ``ldmatrix.trans``), so it is read back with scalar loads.
This probe times the library's kernels with ``KernelConfig(prefetch=True)``: the kernel loads
tile i + 1 into registers itself before it uses tile i (``num_stages=1``: no async copies), then
converts the codes to float16 in registers, and the MMA operand goes through shared memory as
16-bit values, which ``ldmatrix.trans`` can read.

Second, the physical layout. The INT4 row of one token-head is 64 bytes, 512 bytes apart
(``[blocks, block_size, Hkv, D/2]``), and tools/gpu/quant_probe.py read such rows at only 60 %
of copy bandwidth. ``layout="head"`` keeps the logical shape but stores each block head-major
(``[blocks, Hkv, block_size, D/2]`` permuted back: the kernels take strides), so one head's
block is 1 KiB in one piece.

Every row is checked against float64 (of the de-quantised cache) before it is timed; a wrong or
failing row is recorded as such. Then the best configs run every large case with the plan the
library makes. Run on a GPU from the repository root::

    OUT=/tmp/out PYTHONPATH=$PWD python3 tools/gpu/quant_prefetch_probe.py

Writes ``$OUT/quant_prefetch_probe.json``. Measured on an H200 (2026-11-30, committed as
``benchmarks/h200/quant_prefetch_probe.json``): prefetching is slower for bf16 (57 % of copy
bandwidth against 98 %) and FP8 (43 % against 54-66 %), a little faster for INT4 (24.7 %
against 22.9 %: INT4's default since); head-major blocks gain 0.5-2 points.
"""

from __future__ import annotations

import sys
import time

import torch
from plan_sweep import time_split  # (this folder is on sys.path when the script runs)
from quant_probe import start

from paged_bench.decode import CASES, SHAPE, bytes_moved
from paged_bench.quant import float64_reference
from paged_course.results import environment, write_result
from paged_course.testing import make_paged_inputs
from paged_ref import QuantizedKV
from paged_ref.kernels.triton.decode import QUANTISED_CONFIGS, KernelConfig
from paged_ref.kernels.triton.kv_formats import kv_format_code
from paged_ref.kernels.triton.split import SplitPlan, plan_for_inputs
from paged_ref.validation import Lengths

FORMATS = ("fp8", "fp8_token_head", "int4")
LAYOUTS = ("tok", "head")
PREFETCH_CONFIGS = [KernelConfig(t, w, s, True) for t, w, s in (
    (32, 2, 1), (32, 4, 1), (64, 2, 1), (64, 4, 1), (64, 8, 1), (128, 4, 1), (128, 8, 1),
    (64, 4, 2), (128, 4, 2))]
LARGE = ("B64_L4096", "B8_L32768", "B1_L131072", "B256_L1024", "B32_ragged")
MAX_ERR = 2e-2
BUDGET_S = 420.0


def head_major(c: QuantizedKV) -> QuantizedKV:
    """The same values, each block stored ``[Hkv, block_size, ...]`` (a permuted view)."""
    def hm(t):
        if t is None or t.dim() < 3:
            return t
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    return QuantizedKV(hm(c.data), hm(c.scale), hm(c.zero), c.format)


def inputs(case: str, fmt: str, layout: str):
    inp = make_paged_inputs(CASES[case], device="cuda", seed=0, **SHAPE).quantized(fmt)
    if layout == "head":
        args = list(inp.args())
        args[1], args[2] = head_major(args[1]), head_major(args[2])
        return inp, tuple(args)
    return inp, inp.args()


def run_large_cases(best: dict, add, copy_bw: float, skip=()) -> None:
    """The best config of each (format, layout) (``best[(fmt, layout)] = (ms, config)``) on
    every large case but B64_L4096, planned as the library plans; each row passed to ``add``.
    Formats in ``skip`` are left out."""
    for (fmt, layout), (_, cfg) in best.items():
        for case in LARGE[1:] if cfg is not None and fmt not in skip else ():
            inp, args = inputs(case, fmt, layout)
            want = float64_reference(inp).to(torch.float32)
            lens = inp.seq_lens
            plan = plan_for_inputs(inp.q, inp.k_cache, Lengths(int(lens.max()), int(lens.sum())))
            row = dict(case=case, fmt=fmt, layout=layout, chunks=plan.num_chunks, **vars(cfg))
            row |= time_split(args, want, plan, cfg, torch.empty_like(inp.q), bytes_moved(inp),
                              copy_bw, MAX_ERR)
            add(row)
            del inp, args, want
            torch.cuda.empty_cache()


def main() -> int:
    started = start("quant_prefetch_probe")
    if started is None:
        return 1
    out_path, copy_bw = started
    t_start = time.perf_counter()
    result = dict(environment(), copy_bw_gbps=copy_bw, shape={**SHAPE, "dtype": "bfloat16"},
                  rows=[])

    def add(row):
        result["rows"].append(row)
        print({k: (round(v, 4) if isinstance(v, float) else v) for k, v in row.items()},
              flush=True)
        write_result(result, out_path)

    # bf16 control: the plain path must be as before (0.252 ms, bench_plan.json)
    plain = make_paged_inputs(CASES["B64_L4096"], device="cuda", seed=0, **SHAPE)
    want = plain.reference()
    for cfg in (KernelConfig(), KernelConfig(64, 4, 1, True)):
        add(dict(case="B64_L4096", fmt="bf16", layout="tok", **vars(cfg)) | time_split(
            plain.args(), want, SplitPlan(4096, 1), cfg, torch.empty_like(plain.q),
            bytes_moved(plain), copy_bw, MAX_ERR))
    del plain, want
    best: dict[tuple[str, str], tuple[float, KernelConfig]] = {}
    for fmt in FORMATS:
        for layout in LAYOUTS:
            inp, args = inputs("B64_L4096", fmt, layout)
            want = float64_reference(inp).to(torch.float32)
            out = torch.empty_like(inp.q)
            nbytes = bytes_moved(inp)
            today = QUANTISED_CONFIGS[kv_format_code(inp.k_cache)]
            for cfg in [today] + PREFETCH_CONFIGS:
                if time.perf_counter() - t_start > BUDGET_S:
                    break
                row = dict(case="B64_L4096", fmt=fmt, layout=layout, **vars(cfg))
                row |= time_split(args, want, SplitPlan(4096, 1), cfg, out, nbytes, copy_bw,
                                  MAX_ERR)
                add(row)
                if "ms" in row and row["ms"] < best.get((fmt, layout), (1e9,))[0]:
                    best[(fmt, layout)] = (row["ms"], cfg)
            del inp, args, want
            torch.cuda.empty_cache()
    run_large_cases(best, add, copy_bw)
    print("wrote", out_path, f"in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
