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

from paged_ref.cache_math import split_chunks
from paged_ref.course.bench import CASES, SHAPE, bytes_moved
from paged_ref.course.checks import relative_error
from paged_ref.course.results import environment, write_result
from paged_ref.course.testing import make_paged_inputs
from paged_ref.course.timing import copy_bandwidth_gbps, time_ms, warm_up_gpu
from paged_ref.kernels.triton_decode import KernelConfig
from paged_ref.kernels.triton_split import SplitPlan, SplitScratch, paged_attention_split

CHUNKS = (4, 8, 16, 32)
CONFIGS = [KernelConfig(t, w, s) for t, w, s in itertools.product((32, 64), (2, 4), (2, 3, 4))]


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
                                **{k: v for k, v in SHAPE.items()})
        want = inp.reference()
        args = inp.args()
        out = torch.empty_like(inp.q)
        for n, cfg, fused in itertools.product(CHUNKS, CONFIGS, (True, False)):
            chunk, num = split_chunks(max(lens), n, cfg.tile)
            plan = SplitPlan(chunk, num, eager_fused_merge=fused)
            scratch = SplitScratch.allocate(*inp.q.shape[:2], inp.k_cache.shape[2],
                                            inp.q.shape[2], plan, "cuda")
            row = dict(case=case, chunks=num, chunk_size=chunk, tile=cfg.tile,
                       warps=cfg.num_warps, stages=cfg.num_stages, fused_merge=fused)
            try:
                def call(p=plan, c=cfg, s=scratch, a=args, o=out):
                    return paged_attention_split(*a, plan=p, config=c, out=o, scratch=s)

                row["rel_err"] = relative_error(call(), want)
                if row["rel_err"] > 2e-2:
                    raise AssertionError(f"wrong: relative error {row['rel_err']:.3g}")
                row["ms"] = time_ms(call)
                row["pct_copy_bw"] = bytes_moved(inp) / row["ms"] / 1e6 / \
                    result["copy_bw_gbps"] * 100
            except Exception as exc:  # recorded, and on to the next
                row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                torch.cuda.synchronize()
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
