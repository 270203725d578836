"""Does where a cache's per-token scales lie in memory change the CUDA kernels' speed? Each
large bench case with INT4 and FP8 per token-head caches, timed (the default plan) with the
scale (and zero) tensors as the quantiser lays them out, ``[num_blocks, block_size, Hkv, ...]``
(a tile's 16 scales of one head are 16 scattered 4-byte pieces, one per token row of every
head), and the same values stored head-major, ``[num_blocks, Hkv, block_size, ...]`` (the
16 scales of a tile lie together), given to the kernels as a permuted view (same shape, other
strides). Both checked against the float64 answer. Writes ``$OUT/scale_layout_probe.json``.

    OUT=/tmp/out PYTHONPATH=$PWD python3 tools/gpu/scale_layout_probe.py
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import torch

from paged_bench.quant import measured, quantised_cases
from paged_course.results import environment, write_result
from paged_course.testing import PagedInputs
from paged_course.timing import copy_bandwidth_gbps
from paged_ref.kernels.cuda_fp8 import plan_cuda

LARGE = os.environ.get("CASES", "B64_L4096,B8_L32768,B1_L131072,B256_L1024,B32_ragged").split(",")
FORMATS = os.environ.get("FORMATS", "int4,fp8_token_head").split(",")
DEFINES = [tuple(d.split("+")) if d else () for d in os.environ.get("DEFINES", "").split(",")]


def head_major(t: torch.Tensor | None) -> torch.Tensor | None:
    """The same values, stored [num_blocks, Hkv, block_size, ...], seen in the usual shape."""
    if t is None or t.dim() < 3:
        return t
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def with_head_major_scales(inp: PagedInputs) -> PagedInputs:
    k, v = (dataclasses.replace(c, scale=head_major(c.scale), zero=head_major(c.zero))
            for c in (inp.k_cache, inp.v_cache))
    return PagedInputs(inp.q, k, v, inp.block_tables, inp.seq_lens)


def main() -> None:
    copy_bw = copy_bandwidth_gbps()
    rows = []
    for name, lens, fmt, inp, ref, nbytes in quantised_cases(LARGE, FORMATS):
        for layout, x in (("token-major", inp), ("head-major", with_head_major_scales(inp))):
            for defines in DEFINES:
                args = x.args()
                out = torch.empty_like(x.q)
                # (planned on the usual layout: the public API takes contiguous caches;
                # the plan's run reads any strides the four scale tensors share)
                plan = plan_cuda(*inp.args(), max_len=max(lens), total_tokens=sum(lens),
                                 defines=defines)
                row = dict(case=name, kv_format=fmt, scales=layout, defines=list(defines),
                           scale_strides=list(x.k_cache.scale.stride()),
                           **measured(lambda p=plan, a=args, o=out: p.run(*a, out=o), ref,
                                      nbytes, copy_bw))
                print(row, flush=True)
                rows.append(row)
    write_result(dict(environment(), copy_bw_gbps=copy_bw, rows=rows),
                 Path(os.environ.get("OUT", "."), "scale_layout_probe.json"))


if __name__ == "__main__":
    main()
