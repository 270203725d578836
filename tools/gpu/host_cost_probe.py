"""What a CUDA-kernel call costs on the host, and whether the bench's timer sees it: for each
case and plan option (as in ``source_ab_probe.py``: ``$OPTIONS``, ``;``-separated), the
bench's timer (``time_ms``: an L2 flush before each call), the same calls back to back
(``events_ms``, no flush), one CUDA graph of the call replayed with the flush, and the host's
microseconds per ``plan.run`` (200 calls, no waiting). Writes ``$OUT/host_cost_probe.json``.

    CASES=B64_L4096,B1_L131072 FORMATS=int4 OPTIONS="defines=INT4_TMA=0;" OUT=/tmp/out \\
        PYTHONPATH=$PWD python3 tools/gpu/host_cost_probe.py
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

from paged_bench.quant import LARGE_CASES, plan_keywords, quantised_cases
from paged_course.results import environment, write_result
from paged_course.timing import events_ms, time_ms
from paged_ref.kernels import cuda_fp8

CASES = os.environ.get("CASES", ",".join(LARGE_CASES)).split(",")
FORMATS = os.environ.get("FORMATS", "int4").split(",")


def options() -> list[tuple[str, dict]]:
    return [(spec or "default", plan_keywords(spec))
            for spec in os.environ.get("OPTIONS", "").split(";")]


def main() -> None:
    rows = []
    for name, lens, fmt, inp, _, _ in quantised_cases(CASES, FORMATS):
        args, out = inp.args(), torch.empty_like(inp.q)
        for label, kw in options():
            plan = cuda_fp8.plan_cuda(*args, max_len=max(lens), total_tokens=sum(lens), **kw)

            def call(p=plan, a=args, o=out):
                return p.run(*a, out=o)
            call()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(200):
                call()
            host_us = (time.perf_counter() - start) / 200 * 1e6
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                call()
            row = dict(case=name, kv_format=fmt, option=label, tma=plan.tma,
                       bench_ms=time_ms(call), back_to_back_ms=events_ms(call),
                       graph_ms=time_ms(graph.replay), host_us=host_us)
            print(row, flush=True)
            rows.append(row)
        write_result(dict(environment(), rows=rows),
                     Path(os.environ.get("OUT", "."), "host_cost_probe.json"))


if __name__ == "__main__":
    main()
