"""Plan once, run many: ``plan_decode`` + ``paged_attention(..., plan=plan)`` on a CPU (the
Triton backends in the interpreter). The GPU-only parts (no sync under
``torch.cuda.set_sync_debug_mode``, CUDA graph capture and replay) are in tests/test_gpu.py."""

from __future__ import annotations

import pytest
import torch

import paged_ref
from paged_course.checks import assert_close
from paged_course.testing import make_paged_inputs
from paged_ref import paged_attention, plan_decode
from paged_ref.attention import checks_on_device
from paged_ref.kernels.triton import split as triton_split
from paged_ref.kernels.triton.split import SplitPlan
from tests.conftest import KERNEL_DEVICE as DEVICE

SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8)


def _inputs(lens, seed, **kw):
    return make_paged_inputs(lens, device=DEVICE, seed=seed, **(SHAPE | kw))


def _plan(lens, **kw):
    return plan_decode(lens, dtype=torch.float32, device=DEVICE, **(SHAPE | kw))


@pytest.fixture
def small_split(monkeypatch):
    """Make dispatch split into chunks of 8 tokens (the real plan only splits long ones)."""
    calls = []

    def plan_split(*, max_len, **_):
        calls.append(max_len)
        return SplitPlan(8, -(-max_len // 8)) if max_len > 8 else SplitPlan(max(max_len, 1), 1)

    monkeypatch.setattr(triton_split, "plan_split", plan_split)
    return calls


@pytest.mark.parametrize("backend", ["auto", "torch", "triton", "triton_split"])
def test_planned_call_matches_reference(backend, small_split):
    lens = [19, 3, 0, 33]
    inp = _inputs(lens, seed=1)
    plan = _plan(lens, backend=backend)
    assert plan.backend == {"auto": "torch" if DEVICE == "cpu" else plan.backend,
                            "triton_split": "triton_split"}.get(backend, backend)
    out = paged_attention(*inp.args(), plan=plan)
    assert_close(out, inp.reference(), name=f"planned {backend}")
    again = paged_attention(*inp.args(), plan=plan)  # a plan is reused, scratch and all
    assert torch.equal(out, again)


@pytest.mark.parametrize("backend", ["torch", "triton", "triton_split"])
def test_lengths_grow_up_to_max_seq_len_with_tensors_updated_in_place(backend, small_split):
    """Plan for the bound, then write longer lengths (and new q) into the same tensors."""
    grown = _inputs([30, 40, 7], seed=2, spare_columns=0)
    plan = _plan([10, 20, 7], max_seq_len=40, backend=backend)
    if backend == "triton_split":
        assert plan.split.num_chunks * plan.split.chunk_size >= 40
    q, k, v, tables, lens = (t.clone() for t in grown.args())
    lens.copy_(torch.tensor([10, 20, 7]))
    out = torch.empty_like(q)
    assert paged_attention(q, k, v, tables, lens, plan=plan, out=out) is out
    lens.copy_(grown.seq_lens)  # the step: new lengths and queries, same tensors
    q.copy_(grown.q * 2)
    paged_attention(q, k, v, tables, lens, plan=plan, out=out)
    grown.q = grown.q * 2
    assert_close(out, grown.reference(), name=f"{backend} after growing")


def test_one_decision_per_call(small_split):
    """The split is planned once per call (once per plan_decode, zero per planned call). An
    unplanned call plans for its longest length; on a GPU, where its checks run on the device
    and are read back after the kernel, for any length the table can hold (its capacity)."""
    inp = _inputs([20, 9], seed=3)
    paged_attention(*inp.args(), backend="triton_split")
    capacity = inp.block_tables.shape[1] * SHAPE["block_size"]
    assert small_split == [capacity if checks_on_device(inp.seq_lens) else 20]
    small_split.clear()
    plan = _plan([20, 9], backend="triton_split")
    paged_attention(*inp.args(), plan=plan)
    paged_attention(*inp.args(), plan=plan)
    assert small_split == [20]


def test_out_argument_without_plan():
    inp = _inputs([5, 12], seed=4)
    out = torch.full_like(inp.q, float("nan"))
    assert paged_attention(*inp.args(), out=out) is out
    assert_close(out, inp.reference())


def test_host_lengths_from_a_cpu_tensor_and_from_the_manager():
    m = paged_ref.KVCacheManager(num_blocks=16, block_size=8)
    m.add_sequence("a", 13)
    m.add_sequence("b", 30)
    plan = _plan([m.seq_len("a"), m.seq_len("b")])
    assert plan.batch == 2 and plan.max_seq_len == 30
    assert _plan(torch.tensor([13, 30])).max_seq_len == 30


def _planned_call_args():
    inp = _inputs([5, 12], seed=5)
    return inp, _plan([5, 12])


# (id, plan_decode kwargs overriding good ones, exception, text the message must contain)
BAD_PLANS = [
    ("lens_cuda_like", dict(seq_lens=torch.tensor([[1]])), TypeError, "seq_lens"),
    ("lens_floats", dict(seq_lens=[1.0, 2.0]), TypeError, "seq_lens[0]"),
    ("lens_string", dict(seq_lens="12"), TypeError, "seq_lens"),
    ("lens_negative", dict(seq_lens=[3, -1]), ValueError, "seq_lens[1]"),
    ("max_too_small", dict(seq_lens=[3, 9], max_seq_len=8), ValueError, "max_seq_len"),
    ("max_float", dict(max_seq_len=8.0), TypeError, "max_seq_len"),
    ("heads", dict(num_q_heads=5), ValueError, "num_kv_heads"),
    ("head_dim_zero", dict(head_dim=0), ValueError, "head_dim"),
    ("block_size_float", dict(block_size=8.0), TypeError, "block_size"),
    ("dtype", dict(dtype=torch.float64), TypeError, "dtype"),
    ("scale", dict(scale=1e38), ValueError, "scale"),
    ("backend", dict(backend="flash"), ValueError, "backend"),
]


@pytest.mark.parametrize("kwargs, error, text", [c[1:] for c in BAD_PLANS],
                         ids=[c[0] for c in BAD_PLANS])
def test_bad_plan_inputs(kwargs, error, text):
    good = dict(seq_lens=[3, 9], dtype=torch.float32, device=DEVICE, **SHAPE)
    with pytest.raises(error) as info:
        plan_decode(**(good | kwargs))
    assert text in str(info.value), str(info.value)


@pytest.mark.parametrize("change, text", [
    (lambda a: {**a, "q": a["q"][:1], "tables": a["tables"][:1], "lens": a["lens"][:1]},
     "batch 1 (planned 2)"),
    (lambda a: {**a, "tables": a["tables"][:, :1]}, "block_tables holds 1 blocks"),
    (lambda a: {**a, "q": a["q"][:, :2]}, "num_q_heads 2 (planned 4)"),
    (lambda a: {**a, "scale": 0.5}, "scale"),
    (lambda a: {**a, "backend": "torch"}, "backend"),
    (lambda a: {**a, "plan": "plan"}, "plan"),
    (lambda a: {**a, "out": torch.empty(2, 4, 31)}, "out"),
])
def test_planned_call_checks_shapes(change, text):
    inp, plan = _planned_call_args()
    a = change({"q": inp.q, "tables": inp.block_tables, "lens": inp.seq_lens})
    with pytest.raises((ValueError, TypeError)) as info:
        paged_attention(a["q"], inp.k_cache, inp.v_cache, a["tables"], a["lens"],
                        plan=a.get("plan", plan), scale=a.get("scale"),
                        backend=a.get("backend", "auto"), out=a.get("out"))
    assert text in str(info.value), str(info.value)


def test_planned_call_reads_no_value_back(monkeypatch):
    """No .item() / .tolist() / .cpu() / .numpy() / int() / bool() on a tensor during a planned
    call (torch backend, so the interpreter's own copies do not count)."""
    inp, plan = _planned_call_args()
    expected = inp.reference()
    for name in ("item", "tolist", "cpu", "numpy", "__int__", "__bool__", "__index__"):
        def forbidden(*args, _name=name, **kwargs):
            raise AssertionError(f"planned call used Tensor.{_name}")
        monkeypatch.setattr(torch.Tensor, name, forbidden)
    out = paged_attention(*inp.args(), plan=plan)
    monkeypatch.undo()
    assert_close(out, expected)
