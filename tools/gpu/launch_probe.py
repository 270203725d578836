"""Where do the host microseconds of a planned call go? (lesson 06, B4_L2048)

A planned call on B4_L2048 is bound by the host: its GPU work takes ~0.014-0.03 ms, its Python
~0.06-0.09 ms, most of it in Triton's launch of ``split_kv_kernel``. This times, per call
(host microseconds, GPU work not awaited):

* the public planned call, and the split wrapper called directly;
* ``split_kv_kernel[grid](...)`` alone, with its arguments made beforehand;
* Triton's steps inside that launch: the binder (argument specialisation), and the compiled
  kernel's launcher called directly (``CompiledKernel.run`` with pre-bound arguments);
* FlashInfer's ``run()`` when it is installed;

the GPU time (``time_ms``: L2 flushed, as every ``ms`` of the course) of the planned call, the
direct launch (little host time, so the pure GPU time) and FlashInfer; and writes a cProfile of
2,000 planned calls. Run on a GPU from the repository root:

    OUT=/tmp/out python3 tools/gpu/launch_probe.py

Writes ``$OUT/launch_probe.json`` and ``$OUT/launch_probe_profile.txt``.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys

import torch
import triton

import paged_ref
from paged_bench.decode import SHAPE
from paged_course.results import environment, write_result
from paged_course.testing import make_paged_inputs
from paged_course.timing import cpu_us_per_call, time_ms
from paged_ref.kernels.triton import split as triton_split
from paged_ref.kernels.triton.decode import default_config, launch_constants
from paged_ref.kernels.triton.kv_formats import kv_kernel_args


def split_launch_args(inp, plan, out):
    """(grid, positional args, keyword args) of the split kernel launch the wrapper makes."""
    q, k, v, tables, lens = inp.args()
    consts = launch_constants(q, k, None)
    qk_scale = consts.pop("qk_scale")
    config = default_config(q, k)
    (k_data, v_data, *scales), formats = kv_kernel_args(k, v)
    scratch = plan.scratch
    split = plan.split
    args = (scratch.part_out, scratch.part_lse, scratch.counters, out, q, k_data, v_data, tables,
            lens, qk_scale, split.chunk_size, plan.max_seq_len, q.stride(0), q.stride(1),
            out.stride(0), out.stride(1), tables.stride(0), k_data.stride(0), k_data.stride(1),
            k_data.stride(2), *scales, q.shape[1], split.num_chunks)
    kwargs = dict(TILE=config.tile, num_warps=config.num_warps, num_stages=config.num_stages,
                  FUSED_MERGE=True, CHUNK_TILE=triton_split.CHUNK_TILE,
                  GROUP_P2=triton.next_power_of_2(consts["GROUP"]), **consts, **formats)
    return (q.shape[0], k.shape[2], split.num_chunks), args, kwargs


def main() -> int:
    if not torch.cuda.is_available():
        print("launch_probe.py needs a CUDA GPU")
        return 1
    lens = [2048] * 4
    inp = make_paged_inputs(lens, device="cuda", seed=0, **SHAPE)
    plan = paged_ref.plan_decode(lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                                 block_size=16, dtype=torch.bfloat16, device="cuda")
    out = torch.empty_like(inp.q)
    kernel = triton_split.split_kv_kernel
    grid, args, kwargs = split_launch_args(inp, plan, out)
    compiled = kernel[grid](*args, **kwargs)
    device = torch.cuda.current_device()
    binder = kernel.device_caches[device][4]
    bound, _, _ = binder(*args, **kwargs)
    bound = tuple(bound.values())
    stream = torch.cuda.current_stream().cuda_stream

    def raw_launch():
        compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None,
                     None, *bound)

    steps = {
        "planned_call": lambda: paged_ref.paged_attention(*inp.args(), plan=plan, out=out),
        "split_wrapper": lambda: triton_split.paged_attention_split(
            *inp.args(), plan=plan.split, scratch=plan.scratch, out=out,
            max_seq_len=plan.max_seq_len),
        "jit_launch": lambda: kernel[grid](*args, **kwargs),
        "binder_only": lambda: binder(*args, **kwargs),
        "compiled_run": raw_launch,
        "empty_like": lambda: torch.empty_like(inp.q),
    }
    result = dict(environment(), case="B4_L2048", plan=repr(plan.split), host_us={})
    for name, fn in steps.items():
        result["host_us"][name] = cpu_us_per_call(fn, calls=2000)
        print(f"{name:14s} {result['host_us'][name]:7.1f} us", flush=True)
    raw_launch()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, inp.reference().to(out.device, out.dtype), rtol=2e-2, atol=2e-2)
    from paged_bench.decode import flashinfer_runners

    timed = {"planned_call": steps["planned_call"], "compiled_run": raw_launch,
             **{label: run for label, (_, _, run) in flashinfer_runners(inp).items()}}
    result["gpu_ms"] = {}
    for name, fn in timed.items():
        result["gpu_ms"][name] = [time_ms(fn) for _ in range(3)]
        print(f"{name:22s} {result['gpu_ms'][name]} ms", flush=True)
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(2000):
        steps["planned_call"]()
    profile.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(30)
    out_dir = os.environ.get("OUT", ".")
    with open(os.path.join(out_dir, "launch_probe_profile.txt"), "w") as f:
        f.write(text.getvalue())
    print(text.getvalue()[:4000])
    write_result(result, os.path.join(out_dir, "launch_probe.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
