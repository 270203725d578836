"""The TMA-fed INT4 kernel with each L2 promotion of its tensor maps (how much L2 fetches
around each request: none, 64, 128 or 256 bytes; ``cuda_fp8.L2_PROMOTION``) and each ring
(``$RINGS``: ``stages:lag`` pairs, the .cu's STAGES and TMA_LAG), timed with the bench's timer
in turns. Writes ``$OUT/tma_promotion_probe.json``.

    CASES=B64_L4096,B8_L32768 RINGS=4:2,5:3 OUT=/tmp/out PYTHONPATH=$PWD \\
        python3 tools/gpu/tma_promotion_probe.py
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from paged_bench.quant import LARGE_CASES, measured, quantised_cases
from paged_course.results import environment, write_result
from paged_course.timing import copy_bandwidth_gbps
from paged_ref.kernels import cuda_fp8

CASES = os.environ.get("CASES", ",".join(LARGE_CASES)).split(",")
PROMOTIONS = [int(x) for x in os.environ.get("PROMOTIONS", "0,2,3").split(",")]
RINGS = [tuple(map(int, r.split(":"))) for r in os.environ.get("RINGS", "4:2").split(",")]
REPEATS = int(os.environ.get("REPEATS", "2"))


def main() -> None:
    copy_bw, rows = copy_bandwidth_gbps(), []
    for name, lens, _fmt, inp, ref, nbytes in quantised_cases(CASES, ["int4"]):
        args, out = inp.args(), torch.empty_like(inp.q)
        plans = {}
        for stages, lag in RINGS:
            for promotion in PROMOTIONS:
                plan = cuda_fp8.plan_cuda(*args, max_len=max(lens), total_tokens=sum(lens),
                                          stages=stages, defines=(f"TMA_LAG={lag}",))
                cuda_fp8.L2_PROMOTION = promotion  # (read when the plan first encodes maps)
                plan.run(*args, out=out)
                plans[(stages, lag, promotion)] = plan
        for rep in range(REPEATS):
            for (stages, lag, promotion), plan in plans.items():
                def call(p=plan, a=args, o=out):
                    return p.run(*a, out=o)
                row = dict(case=name, stages=stages, lag=lag, l2_promotion=promotion,
                           repeat=rep, tma=plan.tma, **measured(call, ref, nbytes, copy_bw))
                print(row, flush=True)
                rows.append(row)
        write_result(dict(environment(), copy_bw_gbps=copy_bw, rows=rows),
                     Path(os.environ.get("OUT", "."), "tma_promotion_probe.json"))


if __name__ == "__main__":
    main()
