"""Does the L2 policy of the cache's reads change the CUDA kernels' time, and how much of that
is the flush before each call? The bench (do_bench) zeroes 256 MB before every call, which
leaves the L2 full of dirty lines: a kernel that streams through the L2 then pays for writing
them back to DRAM on the way. For each large bench case and format, each plan option in
``$OPTIONS`` (as ``source_ab_probe.py``: ``;``-separated ``plan_cuda`` keywords; default the
kernel as built) is checked against the float64 answer, then timed with CUDA events after each
of two flushes: ``zero`` (do_bench's: dirty lines) and ``read`` (a 256 MB read: clean lines), in
turns. A plain copy of the same bytes is timed after each flush too. Writes
``$OUT/l2_policy_probe.json``. The committed ``benchmarks/h200/l2_policy_probe_2026-12-01.json``
also timed two macros that are not in the kernel (measured and not kept): ``KV_EVICT_FIRST=1``
(the codes and scales read under the L2 policy evict_first) and ``TMA_FILL_RING=1`` (the TMA
ring filled whole at the start). To time them again, ``git apply
benchmarks/h200/patches/l2_hints_2026-12-01.patch`` first (without it they are unused macros
and time the kernel as built), then
``OPTIONS=";defines=KV_EVICT_FIRST=1;defines=TMA_FILL_RING=1;defines=KV_EVICT_FIRST=1|TMA_FILL_RING=1"``.

    OUT=/tmp/out PYTHONPATH=$PWD python3 tools/gpu/l2_policy_probe.py     # about 15 s
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from paged_bench.quant import LARGE_CASES, plan_keywords, quantised_cases
from paged_course.checks import relative_error
from paged_course.results import environment, write_result
from paged_course.timing import copy_bandwidth_gbps, events_ms, gbps, read_flush, zero_flush
from paged_ref.kernels import cuda_fp8

CASES = os.environ.get("CASES", ",".join(LARGE_CASES)).split(",")
FORMATS = os.environ.get("FORMATS", "fp8,fp8_token_head,int4").split(",")
OPTIONS = os.environ.get("OPTIONS", "").split(";")
REPEATS = int(os.environ.get("REPEATS", "2"))


def main() -> None:
    copy_bw = copy_bandwidth_gbps()
    flushes = {"zero": zero_flush, "read": read_flush}
    rows = []
    for name, lens, fmt, inp, ref, nbytes in quantised_cases(CASES, FORMATS):
        args, out = inp.args(), torch.empty_like(inp.q)
        calls = {}
        for spec in OPTIONS:
            plan = cuda_fp8.plan_cuda(*args, max_len=max(lens), total_tokens=sum(lens),
                                      **plan_keywords(spec))
            calls[spec or "default"] = (lambda p=plan, a=args, o=out: p.run(*a, out=o))
            err = relative_error(calls[spec or "default"]().float(), ref)
            print(dict(case=name, kv_format=fmt, option=spec or "default", rel_err=err))
            assert err < 1e-2, (name, fmt, spec, err)
        src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        calls["copy of the same bytes"] = lambda d=dst, s=src: d.copy_(s)
        for rep in range(REPEATS):
            for flush, before in flushes.items():
                for label, call in calls.items():
                    ms = events_ms(call, before)
                    row = dict(case=name, kv_format=fmt, option=label, flush=flush,
                               repeat=rep, ms=ms, pct_copy_bw=100 * gbps(nbytes, ms) / copy_bw)
                    print(row, flush=True)
                    rows.append(row)
        del src, dst
        write_result(dict(environment(), copy_bw_gbps=copy_bw, rows=rows),
                     Path(os.environ.get("OUT", "."), "l2_policy_probe.json"))


if __name__ == "__main__":
    main()
