"""Exploratory tuning on a GPU (lesson 05 notes): one case, a grid of chunk counts and kernel
configs for triton_split, and the launch overhead of each backend.

    python tools/tune_split.py B32_ragged --chunks 4,8,16,32 --stages 2,3
    python tools/tune_split.py B4_L2048 --overhead
    python tools/tune_split.py B4_L2048 --host-breakdown

Prints one line per variant: ms (do_bench median, L2 flushed), ms with CUDA-graph replay, and
CPU microseconds per call (the Python launch path). The variants are the benchmark's own
(:func:`paged_bench.decode.our_runners`, the same launch path and labels) and so are the
timers (:mod:`paged_course.timing`); this script only picks the grid and prints.
"""

from __future__ import annotations

import argparse
import itertools

from paged_bench.decode import CASES, SHAPE, bytes_moved, flashinfer_runners, our_runners
from paged_course import timing
from paged_course.testing import make_paged_inputs
from paged_ref.kernels.triton.decode import KernelConfig


def host_breakdown(inp) -> None:
    """Host microseconds per call of each step of the public launch path, outermost last."""
    from paged_ref.attention import paged_attention
    from paged_ref.kernels.triton.decode import launch_constants, paged_attention_triton
    from paged_ref.kernels.triton.split import paged_attention_split, plan_for_inputs
    from paged_ref.validation import Lengths

    args = inp.args()
    lens = inp.seq_lens.tolist()
    plan = plan_for_inputs(inp.q, inp.k_cache, Lengths(max(lens), sum(lens)))
    pieces = {
        "plan_for_inputs": lambda: plan_for_inputs(inp.q, inp.k_cache,
                                                   Lengths(max(lens), sum(lens))),
        "launch_constants": lambda: launch_constants(inp.q, inp.k_cache, None),
        "paged_attention_triton (1 launch)": lambda: paged_attention_triton(*args),
        f"paged_attention_split ({plan.num_chunks} chunks)": (
            lambda: paged_attention_split(*args, plan=plan)),
        "paged_attention(auto), checks included": lambda: paged_attention(*args),
    }
    for name, fn in pieces.items():
        print(f"host {name:40s} {timing.cpu_us_per_call(fn, 2000):6.1f} us/call", flush=True)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("case", choices=list(CASES))
    p.add_argument("--chunks", default="", help="comma-separated chunk counts (else the plan)")
    p.add_argument("--tiles", default="64")
    p.add_argument("--warps", default="4")
    p.add_argument("--stages", default="3")
    p.add_argument("--overhead", action="store_true", help="also CPU us/call and graph replay")
    p.add_argument("--host-breakdown", action="store_true",
                   help="host us/call of each step of the public launch path")
    args = p.parse_args(argv)
    inp = make_paged_inputs(CASES[args.case], device="cuda", **SHAPE)
    if args.host_breakdown:
        host_breakdown(inp)
        return
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    configs = [KernelConfig(t, w, s) for t, w, s in
               itertools.product(ints(args.tiles), ints(args.warps), ints(args.stages))]
    chunk_counts = ints(args.chunks)
    runners = our_runners(inp, [] if chunk_counts else ["triton_split"], configs, chunk_counts)
    if args.overhead:
        runners.update(flashinfer_runners(inp))
    nbytes = bytes_moved(inp)
    for label, (_, _, fn) in runners.items():
        ms = timing.time_ms(fn)
        line = f"{args.case:11s} {label:40s} {ms:.4f} ms {timing.gbps(nbytes, ms):6.0f} GB/s"
        if args.overhead:
            graph = timing.graph_ms(fn)
            line += (f"  graph {'-' if graph is None else f'{graph:.4f}'} ms"
                     f"  cpu {timing.cpu_us_per_call(fn, 300):5.1f} us/call")
        print(line, flush=True)


if __name__ == "__main__":
    main()
