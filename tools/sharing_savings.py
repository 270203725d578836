"""Lesson 07's committed numbers: memory saved by sharing blocks, and a shared system prompt.

    .venv/bin/python tools/sharing_savings.py [--requests 100] [--out results/cpu/sharing.json]

Runs :mod:`paged_course.sharing_sim` (plain Python, the real KVCacheManager; minutes on a
CPU) and writes one JSON with the savings table (ours next to the PagedAttention paper's) and
the system-prompt runs (hit rate, requests running at once, with and without prefix caching).
"""

from __future__ import annotations

import argparse
import datetime
import platform

from paged_course import sharing_sim
from paged_course.results import commit, write_result


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=100)
    parser.add_argument("--max-len", type=int, default=1024, help="clip prompt + output")
    parser.add_argument("--out", default="results/cpu/sharing.json")
    args = parser.parse_args(argv)
    savings = sharing_sim.saving_table(args.requests, max_len=args.max_len)
    for row in savings:
        print(row)
    reqs = sharing_sim.dataset("ShareGPT-like", 4 * args.requests, seed=1, max_len=args.max_len)
    system_runs = []
    for system_tokens in (256, 1024):
        for on in (False, True):
            r = sharing_sim.system_prompt_run(reqs, system_tokens, num_blocks=2000,
                                              enable_prefix_caching=on)
            system_runs.append({"system_tokens": system_tokens, "num_blocks": 2000,
                                "block_size": 16, "prefix_caching": on,
                                "hit_rate": r.hit_rate, "mean_running": r.mean_running,
                                "steps": r.steps})
            print(system_runs[-1])
    result = {"machine": f"CPU ({platform.machine()}), plain Python",
              "date": datetime.date.today().isoformat(), "commit": commit(),
              "requests": args.requests,
              "max_len": args.max_len,
              "block_size": 16, "datasets": sharing_sim.DATASETS,
              "paper_saving_pct": sharing_sim.PAPER_SAVING,
              "savings": savings, "system_prompt": system_runs}
    print(f"wrote {write_result(result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
