"""Does the cache's block size change how fast the CUDA kernels read it? A block of 16 tokens
of INT4 codes is 8 KB of K (and 8 KB of V) in one piece, of FP8 16 KB: the pieces DRAM serves
halve with the format. For each case in ``$CASES`` and format in ``$FORMATS``, the bench's
inputs (seed 0, blocks shuffled in memory) with blocks of each size in ``$BLOCKS``, the default
plan checked against the float64 answer, then timed with the bench's timer (``ms``) and after
a flush that leaves the L2 clean (``ms_clean_l2``), in turns. Writes
``$OUT/block_size_probe.json``.

    OUT=/tmp/out PYTHONPATH=$PWD python3 tools/gpu/block_size_probe.py     # about 30 s
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from paged_bench.decode import CASES, SHAPE, bytes_moved
from paged_bench.quant import float64_reference, timed_both_ways
from paged_course.checks import relative_error
from paged_course.results import environment, write_result
from paged_course.testing import make_paged_inputs
from paged_course.timing import copy_bandwidth_gbps
from paged_ref.kernels.cuda_fp8 import plan_cuda

NAMES = os.environ.get("CASES", "B64_L4096,B1_L131072,B32_ragged").split(",")
FORMATS = os.environ.get("FORMATS", "int4,fp8").split(",")
BLOCKS = [int(b) for b in os.environ.get("BLOCKS", "16,32,64").split(",")]


def main() -> None:
    copy_bw = copy_bandwidth_gbps()
    rows = []
    for name in NAMES:
        lens = CASES[name]
        for fmt in FORMATS:
            calls = {}
            for block in BLOCKS:
                inp = make_paged_inputs(lens, device="cuda", seed=0,
                                        **{**SHAPE, "block_size": block}).quantized(fmt)
                args, out = inp.args(), torch.empty_like(inp.q)
                plan = plan_cuda(*args, max_len=max(lens), total_tokens=sum(lens))
                err = relative_error(plan.run(*args, out=out).float(), float64_reference(inp))
                calls[block] = (lambda p=plan, a=args, o=out: p.run(*a, out=o), err,
                                bytes_moved(inp))
            for rep in range(2):
                for block, (call, err, nbytes) in calls.items():
                    row = dict(case=name, kv_format=fmt, block_size=block, repeat=rep,
                               rel_err=err, bytes=nbytes,
                               **timed_both_ways(call, nbytes, copy_bw))
                    print(row, flush=True)
                    rows.append(row)
            del calls
            torch.cuda.empty_cache()
        write_result(dict(environment(), copy_bw_gbps=copy_bw, rows=rows),
                     Path(os.environ.get("OUT", "."), "block_size_probe.json"))


if __name__ == "__main__":
    main()
