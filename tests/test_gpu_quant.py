"""Quantised-cache kernels compiled on a CUDA GPU (skipped without one): every format against
the float64 answer for the de-quantised cache, on sizes only a GPU holds."""

from __future__ import annotations

import pytest
import torch

import paged_ref
from paged_course.checks import assert_close
from paged_course.testing import make_paged_inputs, ragged_lengths
from paged_ref.kernels.triton.split import SplitPlan, paged_attention_split

pytestmark = pytest.mark.gpu  # (tests/conftest.py: skipped without a CUDA GPU)

FORMATS = ["fp8", "fp8_token_head", "int4", "int4_g128"]
CASES = [
    # lengths, block_size, head_dim, num_q_heads, num_kv_heads, q dtype
    ([0, 1, 15, 16, 17, 300], 16, 128, 32, 8, torch.bfloat16),
    (ragged_lengths(9, 1, 3000, seed=1), 16, 128, 32, 8, torch.float16),
    ([1, 2, 33, 64, 65], 1, 128, 8, 8, torch.float32),
    ([40000], 16, 64, 8, 1, torch.bfloat16),
]


@pytest.mark.parametrize("backend", ["triton", "triton_split"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_quantised_matches_float64(backend, case, fmt):
    lens, bs, d, hq, hkv, dtype = CASES[case]
    fmt = "int4_g64" if fmt == "int4_g128" and d == 64 else fmt
    inp = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                            dtype=dtype, device="cuda", seed=case, poison="nan").quantized(fmt)
    out = paged_ref.paged_attention(*inp.args(), backend=backend)
    assert_close(out, inp.reference(), name=f"{backend} {fmt} case {case}")


@pytest.mark.parametrize("num_chunks", [2, 7, 300])
@pytest.mark.parametrize("fmt", FORMATS)
def test_gpu_quantised_split_any_chunking(num_chunks, fmt):
    lens = [1, 700, 4097, 20000]
    inp = make_paged_inputs(lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                            dtype=torch.bfloat16, device="cuda", seed=num_chunks).quantized(fmt)
    chunk = -(-max(lens) // num_chunks)
    out = paged_attention_split(*inp.args(), plan=SplitPlan(chunk, -(-max(lens) // chunk)))
    assert_close(out, inp.reference(), name=f"{fmt} split into {num_chunks}")


@pytest.mark.parametrize("fmt", ["fp8_token_head", "int4"])
@pytest.mark.parametrize("planned_for_format", [False, True])
def test_gpu_quantised_planned_call_replays_in_a_cuda_graph(fmt, planned_for_format):
    """A plan without ``kv_format`` runs Triton; with it, the CUDA kernels where this machine
    builds them (tests/kernels/cuda/test_decode_gpu.py checks which); both replay in a CUDA
    graph with new queries and shorter lengths."""
    lens = [300, 4000, 17]
    inp = make_paged_inputs(lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                            dtype=torch.bfloat16, device="cuda", seed=3).quantized(fmt)
    plan = paged_ref.plan_decode(lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                                 block_size=16, dtype=torch.bfloat16, device="cuda",
                                 kv_format=fmt if planned_for_format else None)
    out = torch.empty_like(inp.q)
    paged_ref.paged_attention(*inp.args(), plan=plan, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_ref.paged_attention(*inp.args(), plan=plan, out=out)
    inp.q.copy_(torch.randn_like(inp.q))
    inp.seq_lens.copy_(torch.tensor([299, 3990, 1], dtype=inp.seq_lens.dtype))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, inp.reference(), name=f"{fmt} graph replay")


def test_gpu_clean_flush_spares_a_reading_kernel_the_write_back():
    """The bench's second timing (``ms_clean_l2``) measures what it says: after do_bench's
    zeroing flush a kernel that only reads 300 MB pays for writing the L2's dirty lines back;
    after ``read_flush`` (clean lines) it does not, so it is faster by microseconds, while a
    flush that reads must itself leave nothing to write back (a second read flush changes
    nothing)."""
    from paged_course.timing import clean_l2_ms, events_ms, read_flush, zero_flush

    x = torch.empty(75 * 2**20, dtype=torch.int32, device="cuda").random_()

    def read():
        return torch.amax(x)

    dirty = events_ms(read, zero_flush)
    clean = clean_l2_ms(read)
    twice = events_ms(read, lambda: (read_flush(), read_flush()))
    assert clean < dirty - 0.002, (clean, dirty)  # ms
    assert abs(twice - clean) < 0.002, (twice, clean)


def test_gpu_bench_timer_sees_the_kernels_not_the_host():
    """The bench times a call with do_bench, which queues flush, call, flush, call, ... and
    reads the GPU's events: if ``plan.run`` spends longer on the host than the GPU spends on
    a flush and a call, the GPU waits for Python and the wait is counted. INT4 on
    B1_L131072 is the shortest large call (~57 us); when ``plan.run`` took 86-94 us of the
    GPU machine's host, the bench read 75 us for it, its CUDA graph 57 us
    (``results/h200/short_calls_study.json``, part ``host_before``). The same calls replayed as
    one CUDA graph cost the host nothing: the two timings must agree."""
    from paged_bench.decode import CASES, SHAPE
    from paged_course.timing import time_ms
    from paged_ref.kernels import cuda as cuda_kernels

    if not cuda_kernels.cuda_kernels_available():
        pytest.skip("needs a GPU with FP8 conversions (sm_89+) and nvcc")
    lens = CASES["B1_L131072"]
    inp = make_paged_inputs(lens, device="cuda", seed=0, **SHAPE).quantized("int4")
    args, out = inp.args(), torch.empty_like(inp.q)
    plan = cuda_kernels.plan_cuda(*args, max_len=max(lens), total_tokens=sum(lens))
    plan.run(*args, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(*args, out=out)
    called, replayed = time_ms(lambda: plan.run(*args, out=out)), time_ms(graph.replay)
    assert called < 1.05 * replayed + 0.002, (called, replayed)  # ms
