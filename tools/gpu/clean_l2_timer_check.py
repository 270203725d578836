"""Is the clean-L2 timer steady? On B64_L4096's INT4 cache (the default CUDA plan), the call
timed with CUDA events after three flushes (``read_flush``: torch.amax of 256 MB; a 256 MB
int64 sum; do_bench's zeroing) with 10 and 100 warm-up calls, then do_bench, then
``clean_l2_ms`` after a 50 ms pause on the host, six times over; and each of 110 calls of one
clean run. Writes ``$OUT/diag_flush.json`` (committed as
``benchmarks/h200/clean_l2_timer_check_2026-12-01.json``, when ``clean_l2_ms`` still timed 100
calls after 10; it now times as many as do_bench).

    OUT=/tmp/out PYTHONPATH=$PWD python3 tools/gpu/clean_l2_timer_check.py     # about 10 s
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from paged_bench.decode import CASES, SHAPE
from paged_course.testing import make_paged_inputs
from paged_course.timing import clean_l2_ms, events_ms, read_flush, time_ms, zero_flush
from paged_ref.kernels import cuda as cuda_kernels


def main() -> None:
    lens = CASES["B64_L4096"]
    inp = make_paged_inputs(lens, device="cuda", seed=0, **SHAPE).quantized("int4")
    args, out = inp.args(), torch.empty_like(inp.q)
    plan = cuda_kernels.plan_cuda(*args, max_len=max(lens), total_tokens=sum(lens))

    def call():
        return plan.run(*args, out=out)

    buf = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
    flushes = {"amax": read_flush, "sum64": lambda: torch.sum(buf, dtype=torch.int64),
               "zero": zero_flush}
    call()
    torch.cuda.synchronize()
    result = {f"flush_ms_{name}": events_ms(f, None, reps=20) for name, f in flushes.items()}
    seq = []
    for rep in range(6):
        for name, f in flushes.items():
            seq.append((rep, name, "w10", round(1000 * events_ms(call, f), 1)))
            seq.append((rep, name, "w100",
                        round(1000 * events_ms(call, f, reps=200, warmup=100), 1)))
        seq.append((rep, "do_bench", "", round(1000 * time_ms(call), 1)))
        time.sleep(0.05)  # a pause on the host, then the clean timing
        seq.append((rep, "amax_after_sleep", "w10", round(1000 * clean_l2_ms(call), 1)))
    events = []
    for _ in range(110):  # each call of one clean run
        read_flush()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    result["one_run_calls_us"] = [round(1000 * s.elapsed_time(e), 1) for s, e in events]
    result["seq"] = seq
    for row in seq:
        print(*row)
    print({k: v for k, v in result.items() if k.startswith("flush")})
    Path(os.environ.get("OUT", "."), "diag_flush.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
