"""Versions of the CUDA decode kernels side by side on one GPU: for each large bench case and
format, the kernel built from ``paged_ref/kernels/cuda_fp8_decode.cu`` with each plan option
set in ``$OPTIONS`` (``;``-separated ``plan_cuda`` keywords, e.g.
``chunk_len=512;stages=4`` or ``defines=INT4_TMA=0|L2_PREFETCH=128``; default: the default
plan), and from each file in ``$OTHER_SOURCES`` (comma-separated
``path[:keywords]``, keywords joined by ``+``; labelled by the file's name without its suffix:
e.g. the file as an earlier commit had it, with the same ``Args`` struct). Each is checked
against the float64 answer and timed with the bench's timer (``ms``) and after a flush that
leaves the L2 clean (``ms_clean_l2``: :func:`paged_course.timing.clean_l2_ms`), in turns
(all versions, then again) so that a drift of the machine's clocks falls on each. Writes
``$OUT/source_ab_probe.json``.

    git show HEAD~1:paged_ref/kernels/cuda_fp8_decode.cu > /tmp/old.cu
    OTHER_SOURCES=/tmp/old.cu OUT=/tmp/out PYTHONPATH=$PWD python3 tools/gpu/source_ab_probe.py
    OTHER_SOURCES=/tmp/try.cu:stages=4 OPTIONS=";stages=4" OUT=/tmp/out PYTHONPATH=$PWD \
        python3 tools/gpu/source_ab_probe.py
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from paged_bench.quant import LARGE_CASES, measured, plan_keywords, quantised_cases
from paged_course.results import environment, write_result
from paged_course.timing import clean_l2_ms, copy_bandwidth_gbps, gbps
from paged_ref.kernels import cuda_fp8

CASES = os.environ.get("CASES", ",".join(LARGE_CASES)).split(",")
FORMATS = os.environ.get("FORMATS", "fp8,fp8_token_head,int4").split(",")
REPEATS = int(os.environ.get("REPEATS", "2"))


def variants() -> list[tuple[str, Path, dict]]:
    """(label, source, plan_cuda keywords) of each version to time."""
    found = []
    for entry in filter(None, os.environ.get("OTHER_SOURCES", "").split(",")):
        path, _, spec = entry.partition(":")
        found.append((Path(path).stem + (f"[{spec}]" if spec else ""), Path(path),
                      plan_keywords(spec, "+")))
    for spec in os.environ.get("OPTIONS", "").split(";"):
        found.append((f"new[{spec}]" if spec else "new", cuda_fp8.SOURCE, plan_keywords(spec)))
    return found


def main() -> None:
    versions, default_source = variants(), cuda_fp8.SOURCE
    copy_bw = copy_bandwidth_gbps()
    rows = []
    for name, lens, fmt, inp, ref, nbytes in quantised_cases(CASES, FORMATS):
        args, out = inp.args(), torch.empty_like(inp.q)
        plans = {}
        for label, source, options in versions:
            cuda_fp8.SOURCE = source  # (read when a plan loads its kernels)
            plans[label] = cuda_fp8.plan_cuda(*args, max_len=max(lens), total_tokens=sum(lens),
                                              **options)
        cuda_fp8.SOURCE = default_source
        for rep in range(REPEATS):
            for label, plan in plans.items():
                def call(p=plan, a=args, o=out):
                    return p.run(*a, out=o)
                clean = clean_l2_ms(call)
                row = dict(case=name, kv_format=fmt, source=label, repeat=rep,
                           chunks=plan.max_chunks, merge_kernel=plan.merge is not None,
                           **measured(call, ref, nbytes, copy_bw), ms_clean_l2=clean,
                           pct_copy_bw_clean_l2=100 * gbps(nbytes, clean) / copy_bw)
                print(row, flush=True)
                rows.append(row)
        write_result(dict(environment(), copy_bw_gbps=copy_bw, rows=rows),
                     Path(os.environ.get("OUT", "."), "source_ab_probe.json"))


if __name__ == "__main__":
    main()
