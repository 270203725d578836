"""The planned call's bound launches compiled on a CUDA GPU (skipped without one): they run the
C launcher with raw pointers, agree with the full path, are captured in CUDA graphs, and a
tensor on another device after binding is a named error, never Triton's own."""

from __future__ import annotations

import time

import pytest
import torch

import paged_ref
from paged_course.checks import assert_close
from paged_course.testing import make_paged_inputs
from paged_ref import attention

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
CASES = {"B4_L2048": [2048] * 4, "B2_ragged": [700, 33], "B8_L300": [300] * 8}


def _planned(lens, seed=0):
    inp = make_paged_inputs(lens, dtype=torch.bfloat16, device="cuda", seed=seed, **SHAPE)
    plan = paged_ref.plan_decode(lens, dtype=torch.bfloat16, device="cuda", **SHAPE)
    return inp, plan


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_bound_call_runs_the_c_launcher_with_pointers(name):
    inp, plan = _planned(CASES[name])
    out = torch.empty_like(inp.q)
    paged_ref.paged_attention(*inp.args(), plan=plan, out=out)
    (binding,) = plan.bindings.values()
    assert binding is not None and binding.device == inp.q.get_device()
    for bound in binding.launches:
        assert not any(isinstance(v, torch.Tensor) for v in bound.template), "tensors bound"
    fresh = make_paged_inputs(CASES[name], dtype=torch.bfloat16, device="cuda", seed=1,
                              **SHAPE)
    paged_ref.paged_attention(*fresh.args(), plan=plan, out=out)
    torch.cuda.synchronize()
    assert_close(out, fresh.reference(), name=f"{name} bound")


@pytest.mark.parametrize("name", list(CASES))
def test_gpu_bound_and_full_paths_agree_bit_for_bit(name, monkeypatch):
    inp, plan = _planned(CASES[name], seed=2)
    bound = [paged_ref.paged_attention(*inp.args(), plan=plan) for _ in range(3)]
    monkeypatch.setattr(attention, "call_planned", lambda *a: None)  # the full path
    full = paged_ref.paged_attention(*inp.args(), plan=plan)
    assert all(torch.equal(b, full) for b in bound)


def test_gpu_cpu_tensor_after_binding_is_a_named_error():
    inp, plan = _planned(CASES["B2_ragged"])
    paged_ref.paged_attention(*inp.args(), plan=plan)
    with pytest.raises(ValueError, match="q is on cpu"):
        paged_ref.paged_attention(inp.q.cpu(), *inp.args()[1:], plan=plan)
    with pytest.raises(ValueError, match="block_tables is on cpu"):
        paged_ref.paged_attention(inp.q, inp.k_cache, inp.v_cache, inp.block_tables.cpu(),
                                  inp.seq_lens, plan=plan)


def test_gpu_unaligned_q_after_binding_is_right():
    """A q view 2 bytes into its buffer: the bound kernels assume 16-byte alignment, so the
    call takes the full path (Triton compiles the unaligned specialisation)."""
    inp, plan = _planned(CASES["B2_ragged"], seed=3)
    paged_ref.paged_attention(*inp.args(), plan=plan)
    flat = torch.empty(inp.q.numel() + 1, dtype=inp.q.dtype, device="cuda")
    q = flat[1:].view(inp.q.shape)
    q.copy_(inp.q)
    out = paged_ref.paged_attention(q, *inp.args()[1:], plan=plan)
    assert_close(out, inp.reference(), name="unaligned q")


def _host_us(fn, calls=2000):
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(calls):
        if i % 100 == 0:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    torch.cuda.synchronize()
    return sorted(times)[len(times) // 2] * 1e6


def test_gpu_bound_call_costs_less_host_time_than_the_full_path(monkeypatch):
    inp, plan = _planned(CASES["B4_L2048"])
    out = torch.empty_like(inp.q)
    args = inp.args()
    bound = _host_us(lambda: paged_ref.paged_attention(*args, plan=plan, out=out))
    monkeypatch.setattr(attention, "call_planned", lambda *a: None)
    full = _host_us(lambda: paged_ref.paged_attention(*args, plan=plan, out=out))
    print(f"B4_L2048 planned call host: bound {bound:.1f} us, full path {full:.1f} us")
    assert bound < 0.7 * full
