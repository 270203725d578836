"""Where does a small planned call's GPU time go? A sweep for lesson 06's B4_L2048 case.

B4_L2048 (4 sequences of 2,048 tokens, 33.6 MB of K/V) takes ~0.03 ms: latency, not bandwidth
(8 us at copy bandwidth). The split kernel's GPU time (L2 flushed, host hidden, as every ``ms``
of the course) is swept over the chunk count, the launch config (tokens a tile, warps, stages)
and the merge (in the split kernel's last program, one launch; or a second kernel), each
checked against float64 first. Run on a GPU from the repository root:

    OUT=/tmp/out python3 tools/gpu/plan_sweep.py [CASE ...]

Writes ``$OUT/plan_sweep.json`` (commit to benchmarks/h200/).
"""

from __future__ import annotations

import itertools
import os
import sys

import torch

from paged_bench.decode import CASES, SHAPE, bytes_moved
from paged_course.checks import relative_error
from paged_course.results import environment, write_result
from paged_course.testing import make_paged_inputs
from paged_course.timing import copy_bandwidth_gbps, time_ms, warm_up_gpu
from paged_ref.cache_math import split_chunks
from paged_ref.kernels.triton.decode import KernelConfig
from paged_ref.kernels.triton.split import SplitPlan, SplitScratch, paged_attention_split

CHUNKS = (4, 8, 16, 32)
CONFIGS = [KernelConfig(t, w, s) for t, w, s in itertools.product((32, 64), (2, 4), (2, 3, 4))]


def time_split(args, want, plan, config, out, nbytes: int, copy_bw: float,
               max_err: float | None = None) -> dict:
    """Check the split kernel at ``plan`` / ``config`` against ``want`` (float64), then time
    it: ``rel_err``, ``ms``, ``pct_copy_bw`` (``nbytes`` moved); ``error`` when it fails to
    compile, raises, or is wrong (``max_err``), so that a sweep records it and goes on.
    (tools/gpu/quant_split_probe.py uses it too.)"""
    scratch = SplitScratch.allocate(*args[0].shape[:2], args[1].shape[2], args[0].shape[2],
                                    plan, "cuda")

    def call():
        return paged_attention_split(*args, plan=plan, config=config, out=out, scratch=scratch)

    row = {}
    try:
        row["rel_err"] = relative_error(call(), want)
        if max_err is not None and row["rel_err"] > max_err:
            raise AssertionError(f"wrong: relative error {row['rel_err']:.3g}")
        row["ms"] = time_ms(call)
        row["pct_copy_bw"] = nbytes / row["ms"] / 1e6 / copy_bw * 100
    except Exception as exc:  # recorded, and on to the next
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        torch.cuda.synchronize()
    return row


def main(argv: list[str]) -> int:
    if not torch.cuda.is_available():
        print("plan_sweep.py needs a CUDA GPU")
        return 1
    cases = argv or ["B4_L2048"]
    warm_up_gpu()
    result = dict(environment(), copy_bw_gbps=copy_bandwidth_gbps(),
                  shape={**SHAPE, "dtype": "bfloat16"}, rows=[])
    out_path = os.path.join(os.environ.get("OUT", "."), "plan_sweep.json")
    for case in cases:
        lens = CASES[case]
        inp = make_paged_inputs(lens, device="cuda", seed=0,
                                **SHAPE)
        want = inp.reference()
        args = inp.args()
        out = torch.empty_like(inp.q)
        for n, cfg, fused in itertools.product(CHUNKS, CONFIGS, (True, False)):
            chunk, num = split_chunks(max(lens), n, cfg.tile)
            plan = SplitPlan(chunk, num, eager_fused_merge=fused)
            row = dict(case=case, chunks=num, chunk_size=chunk, tile=cfg.tile,
                       warps=cfg.num_warps, stages=cfg.num_stages, fused_merge=fused)
            row |= time_split(args, want, plan, cfg, out, bytes_moved(inp),
                              result["copy_bw_gbps"], max_err=2e-2)
            result["rows"].append(row)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
                  flush=True)
        write_result(result, out_path)
        best = sorted((r for r in result["rows"] if r["case"] == case and "ms" in r),
                      key=lambda r: r["ms"])[:5]
        print(f"{case} fastest:", *best, sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
