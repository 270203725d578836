"""``python -m paged_bench host_path``: the host time of one planned decode call.

A small batch (B4_L2048: 4 sequences of 2,048 tokens, 32 q / 8 KV heads, head_dim 128, bf16)
is bound by the host, not the GPU: its kernel takes ~0.02 ms, so a call that spends more than
that in Python and in Triton's launcher is as slow as its host path. This suite times the call
as the documentation writes it::

    plan = plan_decode(lens, ...)                      # once
    paged_attention(q, k_cache, v_cache, block_tables, seq_lens, plan=plan, out=out)

* host microseconds per call: ``time.perf_counter_ns`` around each of ``--calls`` calls (the
  GPU synchronised every 100 calls, outside the timings, so the launch queue never fills);
  median and 90th percentile;
* on a GPU, also the GPU time of the call (``do_bench``, as the decode suite times it) and,
  when FlashInfer is installed, its decode wrapper's ``run()`` the same two ways, in the same
  process, and the ratio (the bar: planned call <= 1.2x FlashInfer's ``run()``).

``--unplanned`` times the call without a plan as well (``paged_attention(q, ..., seq_lens,
out=out)``: on a GPU the check kernel, the remembered plan's launches, the wait for the
checks' verdict), next to the planned call's GPU time: on a large case (B1_L131072,
B32_ragged) its host path must fit inside the kernel's time for the call to run at the
kernel's speed.

``--stub-launch`` replaces the kernel launch itself with a no-op, so what is timed is
everything around it (checks, look-ups, allocations, argument binding): the proxy used on a
machine without a GPU, where it is the default (the interpreter would otherwise run the
kernel). There, the plan is the one a GPU would make (``triton_split`` for B4_L2048).

Writes JSON (``--out``) stamped with the machine and versions.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time

import torch

from paged_bench.common import suite_parser, sync
from paged_bench.decode import CASES, SHAPE

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def stubbed_launches():
    """Inside, Triton kernels are not run: the last step of every launch is a no-op.

    The library's choke point is ``paged_ref.kernels.triton.launch.run_kernel`` (every launch,
    bound or not, ends there); a checkout without it (before the bound planned call) is
    stubbed at its ``launch`` function, as imported by the decode and split wrappers."""
    from paged_ref.kernels.triton import decode, launch, split

    saved = []
    if hasattr(launch, "run_kernel"):
        targets = [(launch, "run_kernel")]
    else:
        targets = [(decode, "launch"), (split, "launch")]
    for module, name in targets:
        saved.append((module, name, getattr(module, name)))
        setattr(module, name, lambda *args, **kwargs: None)
    try:
        yield
    finally:
        for module, name, fn in saved:
            setattr(module, name, fn)


def gpu_backend(lens: list[int]) -> str:
    """The Triton backend ``backend="auto"`` picks for these lengths on a GPU (132 SMs)."""
    from paged_ref.kernels.triton.split import plan_split

    split = plan_split(batch=len(lens), num_kv_heads=SHAPE["num_kv_heads"], max_len=max(lens),
                       total_tokens=sum(lens))
    return "triton_split" if split.num_chunks > 1 else "triton"


def planned_call(lens: list[int], dtype: torch.dtype, device: str, backend: str,
                 merge: str = "plan"):
    """``(call, inputs, plan)``: the planned call on random inputs of ``lens``; ``merge="kernel"``
    makes a split plan merge with the second kernel also when run eagerly."""
    import dataclasses

    from paged_course.testing import make_paged_inputs
    from paged_ref import paged_attention, plan_decode

    shape = {**SHAPE, "dtype": dtype}
    inp = make_paged_inputs(lens, device=device, seed=0, **shape)
    plan = plan_decode(lens, num_q_heads=shape["num_q_heads"],
                       num_kv_heads=shape["num_kv_heads"], head_dim=shape["head_dim"],
                       block_size=shape["block_size"], dtype=dtype, device=device,
                       backend=backend)
    if merge == "kernel" and plan.split is not None:
        plan = dataclasses.replace(plan, split=dataclasses.replace(plan.split,
                                                                   eager_fused_merge=False))
    out = torch.empty_like(inp.q)
    args = inp.args()

    def call():
        return paged_attention(*args, plan=plan, out=out)

    return call, inp, plan


def host_us(fn, calls: int, stub: bool = False) -> dict:
    """Median and p90 host microseconds per call of ``fn`` over ``calls`` timed calls; with
    ``stub``, the kernels not run in the timed calls (:func:`stubbed_launches`; on a GPU the
    warm-up calls before them launch, so that the kernels are compiled and bound)."""
    on_gpu = torch.cuda.is_available()
    with stubbed_launches() if stub and not on_gpu else contextlib.nullcontext():
        for _ in range(min(100, calls)):  # warm: compilation, caches, the first binding
            fn()
    sync()
    times = []
    with stubbed_launches() if stub else contextlib.nullcontext():
        for i in range(calls):
            if i % 100 == 0:
                sync()
            start = time.perf_counter_ns()
            fn()
            times.append(time.perf_counter_ns() - start)
    sync()
    times.sort()
    return {"median_us": statistics.median(times) / 1e3,
            "p90_us": times[int(0.9 * (len(times) - 1))] / 1e3, "calls": calls}


def flashinfer_run(inp):
    """FlashInfer's decode ``run()`` on the same inputs (tensor cores off and on), or {}."""
    from paged_bench.decode import flashinfer_runners

    return {label: fn for label, (_, _, fn) in flashinfer_runners(inp).items()}


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("host_path", __doc__, out="host_path.json")
    p.add_argument("--case", default="B4_L2048", choices=CASES)
    p.add_argument("--calls", type=int, default=10_000)
    p.add_argument("--dtype", default="bf16", choices=DTYPES)
    p.add_argument("--backend", default=None,
                   help="plan_decode's backend (default: auto on a GPU; on a CPU the Triton "
                        "backend a GPU would pick)")
    p.add_argument("--merge", default="plan", choices=("plan", "kernel"),
                   help="kernel: a split plan merges with the second kernel when run eagerly "
                        "too (the plan's default merges inside the split kernel for small "
                        "work, SplitPlan.eager_fused_merge)")
    p.add_argument("--unplanned", action="store_true",
                   help="also time the call without a plan (host and GPU time)")
    p.add_argument("--stub-launch", action="store_true",
                   help="time the host path with the kernel launch itself a no-op (the "
                        "default without a GPU)")
    args = p.parse_args(argv)
    from paged_course.results import environment, write_result

    on_gpu = torch.cuda.is_available()
    if args.unplanned and not on_gpu:  # (the CPU checks first and runs the interpreter)
        p.error("--unplanned times the GPU path: it needs a GPU")
    device = "cuda" if on_gpu else "cpu"
    lens = CASES[args.case]
    backend = args.backend or ("auto" if on_gpu else gpu_backend(lens))
    stub = args.stub_launch or not on_gpu
    call, inp, plan = planned_call(lens, DTYPES[args.dtype], device, backend, args.merge)
    result = {**environment(), "case": args.case, "dtype": args.dtype, "backend": plan.backend,
              "split": None if plan.split is None else vars(plan.split),
              "merge": args.merge, "launch_stubbed": stub}
    result["planned_call"] = host_us(call, args.calls, stub)
    result["bound"] = any(b is not None for b in getattr(plan, "bindings", {}).values())
    if args.unplanned:
        from paged_ref import paged_attention

        out, inputs = torch.empty_like(inp.q), inp.args()
        unplanned = lambda: paged_attention(*inputs, out=out)  # noqa: E731
        result["unplanned_call"] = host_us(unplanned, args.calls, stub)
    if on_gpu and not stub:
        from paged_course.timing import time_ms

        result["planned_call"]["gpu_ms"] = time_ms(call)
        if args.unplanned:
            result["unplanned_call"]["gpu_ms"] = time_ms(unplanned)
        for label, fn in flashinfer_run(inp).items():
            result[label] = {**host_us(fn, args.calls), "gpu_ms": time_ms(fn)}
            result[label]["planned_over_this"] = (result["planned_call"]["gpu_ms"]
                                                  / result[label]["gpu_ms"])
    for key, row in result.items():
        if isinstance(row, dict) and "median_us" in row:
            extra = "".join(f", {k} {v:.4g}" for k, v in row.items()
                            if k in ("gpu_ms", "planned_over_this"))
            print(f"{args.case} {key}: host {row['median_us']:.2f} us median "
                  f"(p90 {row['p90_us']:.2f}){extra}")
    print(f"wrote {write_result(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
