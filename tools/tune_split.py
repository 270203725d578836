"""Exploratory tuning on a GPU (lesson 05 notes): one case, a grid of chunk counts and kernel
configs for triton_split, and the launch overhead of each backend.

    python tools/tune_split.py B32_ragged --chunks 4,8,16,32 --stages 2,3
    python tools/tune_split.py B4_L2048 --overhead

Prints one line per variant: ms (do_bench median, L2 flushed), ms with CUDA-graph replay, and
CPU microseconds per call (the Python launch path).
"""

from __future__ import annotations

import argparse
import itertools
import math
import time

import torch
import triton.testing

from paged_ref.course.bench import CASES, SHAPE, bytes_moved, flashinfer_runners
from paged_ref.course.testing import make_paged_inputs
from paged_ref.kernels.triton_decode import KernelConfig
from paged_ref.kernels.triton_split import SplitPlan, paged_attention_split


def cpu_us(fn, n=300) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def graph_ms(fn) -> float:
    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def host_breakdown(inp, plan, config) -> None:
    """Host microseconds of each piece of paged_attention_split's launch path."""
    from paged_ref.kernels.triton_decode import launch_constants
    from paged_ref.kernels.triton_split import merge_kernel, split_kv_kernel

    q, k, v, bt, lens = inp.args()
    batch, num_q_heads, head_dim = q.shape
    consts = launch_constants(q, k, None)
    qk_scale = consts.pop("qk_scale")
    part_out = torch.empty(batch, num_q_heads, plan.num_chunks, head_dim, device="cuda")
    part_lse = torch.empty(batch, num_q_heads, plan.num_chunks, device="cuda")
    out = torch.empty_like(q)

    def split():
        split_kv_kernel[(batch, k.shape[2], plan.num_chunks)](
            part_out, part_lse, q, k, v, bt, lens, qk_scale, plan.chunk_size,
            q.stride(0), q.stride(1), bt.stride(0), k.stride(0), k.stride(1), k.stride(2),
            num_q_heads, plan.num_chunks, TILE=config.tile, num_warps=config.num_warps,
            num_stages=config.num_stages, **consts)

    def merge():
        merge_kernel[(batch, num_q_heads)](
            out, part_out, part_lse, lens, plan.chunk_size, out.stride(0), out.stride(1),
            num_q_heads, plan.num_chunks, HEAD_DIM=head_dim, HEAD_DIM_PAD=consts["HEAD_DIM_PAD"],
            CHUNK_TILE=16, num_warps=4)

    pieces = {
        "launch_constants": lambda: launch_constants(q, k, None),
        "2x torch.empty": lambda: (torch.empty(batch, num_q_heads, plan.num_chunks, head_dim,
                                               device="cuda"),
                                   torch.empty(batch, num_q_heads, plan.num_chunks,
                                               device="cuda")),
        "split_kv_kernel launch": split,
        "merge_kernel launch": merge,
        "paged_attention_split": lambda: paged_attention_split(*inp.args(), plan=plan,
                                                               config=config, out=out),
    }
    for name, fn in pieces.items():
        print(f"host {name:24s} {cpu_us(fn, 2000):6.1f} us/call", flush=True)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("case")
    p.add_argument("--chunks", default="")
    p.add_argument("--tiles", default="64")
    p.add_argument("--warps", default="4")
    p.add_argument("--stages", default="3")
    p.add_argument("--overhead", action="store_true", help="also CPU us/call and graph replay")
    p.add_argument("--host-breakdown", action="store_true",
                   help="host us/call of each piece of the split launch path")
    args = p.parse_args()
    lens = CASES[args.case]
    inp = make_paged_inputs(lens, device="cuda", **SHAPE)
    nbytes = bytes_moved(inp)
    max_len = max(lens)
    out = torch.empty_like(inp.q)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    variants = {}
    for n, t, w, s in itertools.product(ints(args.chunks) or [0], ints(args.tiles),
                                        ints(args.warps), ints(args.stages)):
        cfg = KernelConfig(t, w, s)
        if n:
            chunk = math.ceil(max_len / n / t) * t
            plan = SplitPlan(chunk, math.ceil(max_len / chunk))
        else:
            plan = None
        variants[f"split chunks={n or 'plan'} t{t} w{w} s{s}"] = (
            lambda c=cfg, p=plan: paged_attention_split(*inp.args(), plan=p, config=c, out=out)
            if p else paged_attention_split(*inp.args(), config=c, out=out))
    if args.host_breakdown:
        from paged_ref.kernels.triton_split import plan_for_inputs
        from paged_ref.validation import Lengths

        plan = plan_for_inputs(inp.q, inp.k_cache, Lengths(max_len, sum(lens)))
        host_breakdown(inp, plan, KernelConfig())
        return
    if args.overhead:
        for label, (_, _, fn) in flashinfer_runners(inp).items():
            variants[label] = fn
    for label, fn in variants.items():
        ms = float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))
        line = f"{args.case:11s} {label:34s} {ms:.4f} ms {nbytes / ms / 1e6:6.0f} GB/s"
        if args.overhead:
            line += f"  graph {graph_ms(fn):.4f} ms  cpu {cpu_us(fn):5.1f} us/call"
        print(line, flush=True)


if __name__ == "__main__":
    main()
