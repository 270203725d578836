"""Where a CUDA decode call's time goes, kernel by kernel: for each case, format and plan option
(as in ``source_ab_probe.py``: ``$OPTIONS``, ``;``-separated), the call is run as the bench
runs it (a 256 MB zeroing flush before each call) under ``torch.profiler``, and the GPU's own
timestamps give, per call (median over the calls): the flush's end to the decode kernel's
start (``lead_us``: the launch), the decode kernel (``decode_us``), the decode kernel's end to
the merge kernel's end (``merge_tail_us``; the merge starts early, as a programmatic
dependent, and waits), and the whole span from the flush's end to the last kernel's end
(``span_us``), next to the bench's timer (``bench_ms``). Writes ``$OUT/kernel_time_probe.json``.

    CASES=B1_L131072,B64_L4096 FORMATS=int4,fp8 OUT=/tmp/out PYTHONPATH=$PWD \\
        python3 tools/gpu/kernel_time_probe.py
"""

from __future__ import annotations

import os
import statistics
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from paged_bench.quant import LARGE_CASES, plan_keywords, quantised_cases
from paged_course.results import environment, write_result
from paged_course.timing import time_ms
from paged_ref.kernels import cuda_fp8

CASES = os.environ.get("CASES", ",".join(LARGE_CASES)).split(",")
FORMATS = os.environ.get("FORMATS", "fp8,int4").split(",")
CALLS = int(os.environ.get("CALLS", "30"))


def split(events: list, calls: int) -> dict:
    """Median per-call lead, decode, merge tail and span (µs) from the profiler's GPU kernel
    events, taken in start order: flush, decode (, merge) for each call."""
    kernels = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda e: e.time_range.start)
    per_call = len(kernels) // calls
    lead, decode, tail, span = [], [], [], []
    for i in range(calls):
        flush, dec, *rest = kernels[i * per_call:(i + 1) * per_call]
        last = rest[-1] if rest else dec
        lead.append(dec.time_range.start - flush.time_range.end)
        decode.append(dec.time_range.end - dec.time_range.start)
        tail.append(last.time_range.end - dec.time_range.end)
        span.append(last.time_range.end - flush.time_range.end)
    med = statistics.median
    return dict(kernels_per_call=per_call, lead_us=med(lead), decode_us=med(decode),
                merge_tail_us=med(tail), span_us=med(span),
                names=[k.name[:40] for k in kernels[:per_call]])


def main() -> None:
    rows = []
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    for name, lens, fmt, inp, _, _ in quantised_cases(CASES, FORMATS):
        args, out = inp.args(), torch.empty_like(inp.q)
        for spec in os.environ.get("OPTIONS", "").split(";"):
            plan = cuda_fp8.plan_cuda(*args, max_len=max(lens), total_tokens=sum(lens),
                                      **plan_keywords(spec))

            def call(p=plan, a=args, o=out):
                return p.run(*a, out=o)
            for _ in range(5):
                flush.zero_()
                call()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(CALLS):
                    flush.zero_()
                    call()
                torch.cuda.synchronize()
            row = dict(case=name, kv_format=fmt, option=spec or "default", tma=plan.tma,
                       chunks=plan.max_chunks, grid=list(plan.grid), stages=plan.stages,
                       bench_ms=time_ms(call), **split(prof.events(), CALLS))
            print(row, flush=True)
            rows.append(row)
        write_result(dict(environment(), rows=rows),
                     Path(os.environ.get("OUT", "."), "kernel_time_probe.json"))


if __name__ == "__main__":
    main()
