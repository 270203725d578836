"""The hand-written CUDA decode kernels (paged_ref/kernels/cuda_fp8.py) on one GPU: each large
bench case (FP8 per tensor and per token-head, INT4; q bf16) checked against the float64
answer, then timed (planned once, ``plan.run`` timed) next to the Triton kernel
``paged_attention`` runs, with a sweep of tokens per CTA (``chunk_len``; ``whole``: whole
sequences), ring stages and the .cu's tuning macros (environment variables ``CASES``, ``CHUNKS``,
``STAGES``, ``DEFINES``, ``FORMATS``: e.g. ``DEFINES=,WARPS_PER_HEAD=2+L2_PREFETCH=128``;
token-head scales run the first stages / defines only; a default launch with a merge kernel
also runs with the merge launched plainly, not as a programmatic dependent). Writes
``$OUT/cuda_fp8_probe.json``.

    OUT=/tmp/out PYTHONPATH=$PWD python3 tools/gpu/cuda_fp8_probe.py
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from pathlib import Path

import torch

from paged_bench.quant import measured, our_runners, quantised_cases
from paged_course.results import environment, write_result
from paged_course.timing import copy_bandwidth_gbps, cpu_us_per_call
from paged_ref.kernels.cuda_fp8 import plan_cuda

LARGE = os.environ.get("CASES", "B64_L4096,B8_L32768,B1_L131072,B256_L1024,B32_ragged").split(",")
# The sweep: tokens per CTA (None: the default), ring stages, other macros of the .cu file.
# fp8_token_head runs the first stages / defines only. ("none" in $CHUNKS is the default.)
CHUNKS = [None if c == "none" else c if c == "whole" else int(c)
          for c in os.environ.get("CHUNKS", "none,1024,2048,whole").split(",")]
STAGES = [int(s) for s in os.environ.get("STAGES", "3,4,6").split(",")]
DEFINES = [tuple(d.split("+")) if d else () for d in os.environ.get("DEFINES", "").split(",")]
FORMATS = os.environ.get("FORMATS", "fp8,fp8_token_head,int4").split(",")


def main() -> None:
    copy_bw = copy_bandwidth_gbps()
    rows = []
    for name, lens, fmt, inp, ref, nbytes in quantised_cases(LARGE, FORMATS):
        args = inp.args()
        out = torch.empty_like(inp.q)
        runners = {label: fn for label, (backend, _, fn) in our_runners(inp).items()
                   if not backend.startswith("cuda")}  # (the sweep's chunk=None row)
        max_len = max(lens)
        for chunk, stages, defines in itertools.product(CHUNKS, STAGES, DEFINES):
            if (isinstance(chunk, int) and chunk >= max_len) or (
                    fmt == "fp8_token_head" and (stages, defines) != (STAGES[0], DEFINES[0])):
                continue
            plan = plan_cuda(*args, chunk_len=max_len if chunk == "whole" else chunk,
                                 max_len=max_len, total_tokens=sum(lens), stages=stages,
                                 defines=defines)
            runners[f"cuda[chunk={chunk},stages={stages},{','.join(defines)}]"] = (
                lambda p=plan, a=args, o=out: p.run(*a, out=o))
            if plan.merge is not None and plan.dependent_merge and chunk is None:
                plain_launch = dataclasses.replace(plan, dependent_merge=False)
                runners[f"cuda[chunk={chunk},stages={stages},{','.join(defines)}"
                        ",plain merge launch]"] = (
                    lambda p=plain_launch, a=args, o=out: p.run(*a, out=o))
        for label, fn in runners.items():
            row = dict(case=name, kv_format=fmt, label=label,
                       **measured(fn, ref, nbytes, copy_bw))
            if label.startswith("cuda"):  # the Python cost of a planned call
                row["host_us"] = cpu_us_per_call(fn)
            print(row, flush=True)
            rows.append(row)
        write_result(dict(environment(), copy_bw_gbps=copy_bw, rows=rows),
                     Path(os.environ.get("OUT", "."), "cuda_fp8_probe.json"))


if __name__ == "__main__":
    main()
