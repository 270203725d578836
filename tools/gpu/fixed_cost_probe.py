"""How much of a short decode call is fixed cost: one sequence of 16k-256k tokens (the bench's
shape, FP8 and INT4 caches) through the CUDA kernels' default plan, timed as the bench times
(``course.timing.time_ms``: L2 flushed before each call). A straight line through time against
bytes gives the streaming rate (slope) and the fixed cost per call (intercept): the launch,
the first copies' latency, the merge of the chunks and the dirty lines the flush leaves in
the L2. Then the 131k-token FP8 call timed after each way of flushing the L2: writing 256 MB
(``time_ms``, triton's do_bench: the L2 is left full of dirty lines, written back while the
call reads) and reading 256 MB (clean lines), so the difference is the write-back's cost.
Writes ``$OUT/fixed_cost_probe.json``.

    OUT=/tmp/out PYTHONPATH=$PWD python3 tools/gpu/fixed_cost_probe.py
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from paged_bench.decode import SHAPE, bytes_moved
from paged_course.results import environment, write_result
from paged_course.testing import make_paged_inputs
from paged_course.timing import copy_bandwidth_gbps, events_ms, gbps, time_ms
from paged_ref.kernels.cuda_fp8 import plan_cuda

LENGTHS = (16384, 32768, 65536, 131072, 262144)


def flush_comparison(copy_bw: float) -> dict:
    """The 131k-token FP8 call after a writing flush and after a reading one."""
    inp = make_paged_inputs([131072], device="cuda", seed=0, **SHAPE).quantized("fp8")
    args = inp.args()
    plan, out = plan_cuda(*args), torch.empty_like(inp.q)
    buf = torch.empty(64 << 20, dtype=torch.int32, device="cuda")  # 256 MB, as do_bench's
    sink = torch.empty((), dtype=torch.int64, device="cuda")
    nbytes = bytes_moved(inp)
    rows = {}
    for name, flush in (("write 256 MB (do_bench)", buf.zero_),
                        ("read 256 MB", lambda: torch.sum(buf, dim=0, out=sink))):
        ms = events_ms(lambda: plan.run(*args, out=out), before=flush)
        rows[name] = dict(ms=ms, pct_copy_bw=100 * gbps(nbytes, ms) / copy_bw)
        print(name, rows[name], flush=True)
    return rows


def main() -> None:
    copy_bw = copy_bandwidth_gbps()
    rows, fits = [], {}
    for fmt in ("fp8", "int4"):
        points = []
        for length in LENGTHS:
            inp = make_paged_inputs([length], device="cuda", seed=0, **SHAPE).quantized(fmt)
            args = inp.args()
            plan = plan_cuda(*args)
            out = torch.empty_like(inp.q)
            ms = time_ms(lambda p=plan, a=args, o=out: p.run(*a, out=o))
            nbytes = bytes_moved(inp)
            rows.append(dict(kv_format=fmt, seq_len=length, bytes=nbytes, ms=ms,
                             chunks=plan.max_chunks,
                             pct_copy_bw=100 * gbps(nbytes, ms) / copy_bw))
            print(rows[-1], flush=True)
            points.append((nbytes, ms))
            del inp
        slope, intercept = np.polyfit(*zip(*points, strict=True), deg=1)  # ms per byte, ms
        fits[fmt] = dict(fixed_us=1e3 * intercept,
                         streaming_pct_copy_bw=100 * gbps(1, slope) / copy_bw)
        print(fmt, fits[fmt], flush=True)
    flushes = flush_comparison(copy_bw)
    out = Path(os.environ.get("OUT", "/tmp/out"))
    write_result(dict(**environment(), copy_bw_gbps=copy_bw, shape={**SHAPE, "dtype": "bf16"},
                      results=rows, fits=fits, b1_fp8_by_flush=flushes),
                 out / "fixed_cost_probe.json")


if __name__ == "__main__":
    main()
