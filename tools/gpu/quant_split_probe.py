"""Does a quantised cache need more programs? (lesson 10, B64_L4096)

FP8 halves the bytes each decode program reads, so its fixed per-program costs (loading q,
the first table and K loads, writing out) weigh twice as much, and B64_L4096's 512 programs
(64 sequences x 8 KV heads) make about four waves on 132 SMs. This times the library's split
kernel on FP8 (per tensor) and INT4 caches at 1, 2, 4 and 8 chunks per sequence and a few
launch configs, each checked against float64 (of the de-quantised cache) first. Run on a GPU
from the repository root:

    OUT=/tmp/out python3 tools/gpu/quant_split_probe.py

Writes ``$OUT/quant_split_probe.json``.
"""

from __future__ import annotations

import itertools
import os
import sys

import torch
from plan_sweep import time_split  # (this folder is on sys.path when the script runs)

from paged_bench.decode import CASES, SHAPE, bytes_moved
from paged_bench.quant import float64_reference
from paged_course.results import environment, write_result
from paged_course.testing import make_paged_inputs
from paged_course.timing import copy_bandwidth_gbps, warm_up_gpu
from paged_ref.cache_math import split_chunks
from paged_ref.kernels.triton.decode import KernelConfig
from paged_ref.kernels.triton.split import SplitPlan

CHUNKS = (1, 2, 4, 8)
CONFIGS = [KernelConfig(128, 4, 3), KernelConfig(64, 4, 3), KernelConfig(128, 8, 3),
           KernelConfig(32, 4, 4), KernelConfig(64, 2, 3)]


def main() -> int:
    if not torch.cuda.is_available():
        print("quant_split_probe.py needs a CUDA GPU")
        return 1
    warm_up_gpu()
    result = dict(environment(), copy_bw_gbps=copy_bandwidth_gbps(),
                  shape={**SHAPE, "dtype": "bfloat16"}, case="B64_L4096", rows=[])
    out_path = os.path.join(os.environ.get("OUT", "."), "quant_split_probe.json")
    lens = CASES["B64_L4096"]
    plain = make_paged_inputs(lens, device="cuda", seed=0, **SHAPE)
    for fmt in ("fp8", "int4"):
        inp = plain.quantized(fmt)
        want = float64_reference(inp)
        out = torch.empty_like(inp.q)
        args = inp.args()
        nbytes = bytes_moved(inp)
        for n, cfg in itertools.product(CHUNKS, CONFIGS):
            chunk, num = split_chunks(max(lens), n, cfg.tile)
            plan = SplitPlan(chunk, num)
            row = dict(format=fmt, chunks=num, tile=cfg.tile, warps=cfg.num_warps,
                       stages=cfg.num_stages)
            row |= time_split(args, want, plan, cfg, out, nbytes, result["copy_bw_gbps"])
            result["rows"].append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
                  flush=True)
            write_result(result, out_path)
        del inp, want
        torch.cuda.empty_cache()
    for fmt in ("fp8", "int4"):
        ok = [r for r in result["rows"] if r["format"] == fmt and "ms" in r]
        best = min(ok, key=lambda r: r["ms"]) if ok else None
        print(f"{fmt} fastest: {best}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
