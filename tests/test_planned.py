"""The planned call's host path (:mod:`paged_ref.planned`): the first call with given tensors
is checked in full and bound; later calls with tensors of the same signature skip the checks
and launch the bound kernels; tensors that differ from what was bound (another shape, dtype,
device, strides, an odd offset) are checked again -- a clear error, or a correct result --
never silently garbage. On a CPU the kernels run in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from paged_course.checks import assert_close
from paged_course.testing import make_paged_inputs
from paged_ref import attention, paged_attention, plan_decode, planned
from paged_ref.kernels.triton import launch as triton_launch
from paged_ref.kernels.triton import split as triton_split
from paged_ref.kernels.triton.split import SplitPlan
from tests.conftest import COMPILED
from tests.mutations.mutate import mutant_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8)
LENS = [19, 3, 33]


@pytest.fixture
def small_split(monkeypatch):
    """Split into chunks of 8 tokens (the real plan only splits long sequences)."""
    def plan_split(*, max_len, **_):
        return SplitPlan(8, -(-max_len // 8)) if max_len > 8 else SplitPlan(max(max_len, 1), 1)

    monkeypatch.setattr(triton_split, "plan_split", plan_split)


@pytest.fixture
def full_checks(monkeypatch):
    """Counts the full metadata checks (``check_shapes``) that planned calls run."""
    calls = []
    for module in (planned, attention):
        real = module.check_shapes

        def counted(*args, _real=real, **kwargs):
            calls.append(1)
            return _real(*args, **kwargs)

        monkeypatch.setattr(module, "check_shapes", counted)
    return calls


def _setup(backend, seed=0, dtype=torch.float32, lens=LENS):
    inp = make_paged_inputs(lens, device=DEVICE, seed=seed, dtype=dtype, **SHAPE)
    plan = plan_decode(lens, dtype=dtype, device=DEVICE, backend=backend, **SHAPE)
    return inp, plan


@pytest.mark.parametrize("with_out", [True, False], ids=["out", "no_out"])
@pytest.mark.parametrize("backend", ["triton", "triton_split"])
def test_second_call_is_bound_and_agrees(backend, with_out, small_split, full_checks):
    inp, plan = _setup(backend, seed=1)
    out = torch.empty_like(inp.q) if with_out else None
    first = paged_attention(*inp.args(), plan=plan, out=out).clone()
    assert len(full_checks) == 1 and len(plan.bindings) == 1
    (binding,) = plan.bindings.values()
    assert binding is not None, "a Triton plan's call is bound"
    assert len(binding.launches) == (2 if backend == "triton_split" else 1)  # split + merge
    # New values in new tensors of the same layout: bound path, no checks, right answer.
    fresh = make_paged_inputs(LENS, device=DEVICE, seed=2, dtype=torch.float32, **SHAPE)
    again = paged_attention(*fresh.args(), plan=plan, out=out)
    assert len(full_checks) == 1, "the bound call ran the full checks again"
    assert (again is out) if with_out else again.is_contiguous()
    assert_close(again, fresh.reference(), name=f"bound {backend}")
    assert_close(first, inp.reference(), name=f"first {backend}")
    assert len(plan.bindings) == 1


def test_bound_call_writes_through_the_bound_slots(small_split):
    """Every tensor of the call is a slot: swapping q alone (same layout) changes the answer."""
    inp, plan = _setup("triton_split", seed=3)
    out = torch.empty_like(inp.q)
    paged_attention(*inp.args(), plan=plan, out=out)
    q2 = torch.randn_like(inp.q)
    other = torch.empty_like(inp.q)
    paged_attention(q2, inp.k_cache, inp.v_cache, inp.block_tables, inp.seq_lens, plan=plan,
                    out=other)
    inp.q = q2
    assert_close(other, inp.reference(), name="q swapped")


def _bound(backend="triton"):
    inp, plan = _setup(backend, seed=4)
    paged_attention(*inp.args(), plan=plan, out=torch.empty_like(inp.q))
    assert None not in plan.bindings.values()
    return inp, plan


def _call(inp, plan, **change):
    a = dict(q=inp.q, k=inp.k_cache, v=inp.v_cache, tables=inp.block_tables, lens=inp.seq_lens,
             out=torch.empty_like(inp.q)) | change
    return paged_attention(a["q"], a["k"], a["v"], a["tables"], a["lens"], plan=plan,
                           out=a["out"])


def _non_contiguous(t):
    """``t``'s values, same shape, in a non-contiguous layout (dims 1 and 2 swapped inside)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


# (id, change to the bound call's tensors, exception, text the message must contain)
REFUSED = [
    # (views of the bound tensors: a kernel launched for the bound batch stays in bounds)
    ("batch", lambda i: dict(q=i.q[:2], tables=i.block_tables[:2], lens=i.seq_lens[:2],
                             out=torch.empty_like(i.q)[:2]), ValueError, "q has batch 2"),
    ("heads", lambda i: dict(q=i.q[:, :2], out=torch.empty_like(i.q[:, :2])), ValueError,
     "num_q_heads 2 (planned 4)"),
    ("q_dtype", lambda i: dict(q=i.q.half(), out=torch.empty_like(i.q.half())), TypeError,
     "q dtype"),
    ("cache_dtype", lambda i: dict(q=i.q.half(), k=i.k_cache.half(), v=i.v_cache.half(),
                                   out=torch.empty_like(i.q.half())), ValueError,
     "the plan is for torch.float32"),
    ("q_device", lambda i: dict(q=i.q.to("meta")), ValueError, "q is on meta"),
    ("cache_device", lambda i: dict(k=i.k_cache.to("meta")), ValueError, "k_cache is on meta"),
    ("non_contiguous_cache", lambda i: dict(v=_non_contiguous(i.v_cache)), ValueError,
     "v_cache must be contiguous"),
    ("short_tables", lambda i: dict(tables=i.block_tables[:, :2]), ValueError,
     "block_tables holds 2 blocks"),
    ("lens_int64", lambda i: dict(lens=i.seq_lens.long()), TypeError, "seq_lens must be"),
    ("out_strided", lambda i: dict(out=torch.empty(*i.q.shape, 2, device=DEVICE)[..., 0]),
     ValueError,
     "out must have stride 1"),
    ("not_a_tensor", lambda i: dict(q=i.q.cpu().numpy()), TypeError,
     "q must be a torch.Tensor"),
]


def _refused(inp, plan, change, error, text) -> bool:
    """Does the bound plan's call with ``change`` raise ``error`` with ``text`` in it?"""
    try:
        _call(inp, plan, **change(inp))
    except error as exc:
        return text in str(exc)
    except Exception:  # (another error: not the refusal)
        return False
    return False


@pytest.mark.parametrize("change, error, text", [c[1:] for c in REFUSED],
                         ids=[c[0] for c in REFUSED])
def test_changed_tensors_after_binding_are_refused(change, error, text, small_split):
    inp, plan = _bound()
    with pytest.raises(error) as info:
        _call(inp, plan, **change(inp))
    assert text in str(info.value), str(info.value)
    assert _refused(inp, plan, change, error, text), "refused once, not twice"
    assert_close(_call(inp, plan), inp.reference(), name="bound call after a refused one")


def _at_odd_offset(t):
    """``t``'s values in a tensor whose data starts 1 element (4 bytes) into its storage."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    return view


# (id, another layout of the same values that the plan fits)
ACCEPTED = [
    ("q_heads_major", lambda i: dict(q=i.q.transpose(0, 1).contiguous().transpose(0, 1))),
    ("q_strided_head_dim", lambda i: dict(q=torch.stack([i.q, i.q], -1)[..., 0])),
    ("q_odd_offset", lambda i: dict(q=_at_odd_offset(i.q))),
    ("tables_wider", lambda i: dict(tables=torch.cat([i.block_tables,
                                                      -torch.ones_like(i.block_tables)], 1))),
    ("tables_column_major", lambda i: dict(tables=i.block_tables.t().contiguous().t())),
    ("lens_strided", lambda i: dict(lens=torch.stack([i.seq_lens, i.seq_lens], -1)[:, 0])),
    ("out_heads_major", lambda i: dict(out=torch.empty_like(i.q.transpose(0, 1)).transpose(0,
                                                                                            1))),
    ("k_is_v", lambda i: dict(v=i.k_cache)),
]


@pytest.mark.parametrize("change", [c[1] for c in ACCEPTED], ids=[c[0] for c in ACCEPTED])
def test_other_layouts_after_binding_are_right(change, small_split):
    inp, plan = _bound()
    changed = change(inp)
    got = _call(inp, plan, **changed)
    if "v" in changed:
        inp.v_cache = changed["v"]
    assert_close(got, inp.reference(), name="another layout")
    again = _call(inp, plan, **changed)  # (bound now, or refused binding: the full path)
    assert_close(again, inp.reference(), name="another layout, twice")
    assert_close(_call(inp, plan), inp.reference(), name="the first layout again")


def test_bindings_are_capped_and_per_plan(small_split):
    inp, plan = _bound()
    other = plan_decode(LENS, dtype=torch.float32, device=DEVICE, backend="triton_split",
                        **SHAPE)
    assert other.bindings == {} and other.bindings is not plan.bindings
    for width in range(planned.MAX_BINDINGS + 2):  # a new table layout each time
        tables = torch.cat([inp.block_tables, torch.zeros(len(LENS), width, dtype=torch.int32,
                                                          device=DEVICE)], 1)
        _call(inp, plan, tables=tables)
    assert len(plan.bindings) <= planned.MAX_BINDINGS


def test_bound_call_is_one_launch_per_kernel_and_nothing_else(small_split, monkeypatch):
    """After binding, a call ends in run_kernel once per kernel, with the bound function."""
    inp, plan = _bound()
    (binding,) = plan.bindings.values()
    seen = []
    real = triton_launch.run_kernel
    monkeypatch.setattr(triton_launch, "run_kernel",
                        lambda fn, *a, **k: seen.append(fn) or real(fn, *a, **k))
    assert_close(_call(inp, plan), inp.reference())
    assert seen == [b.fn for b in binding.launches]


def test_torch_plans_are_not_bound():
    inp, plan = _setup("torch", seed=5)
    for _ in range(2):
        assert_close(paged_attention(*inp.args(), plan=plan), inp.reference())
    assert list(plan.bindings.values()) == [None]


# (planted mistake in paged_ref.planned, old text, new text, the REFUSED case that catches it)
PLANTED = [
    ("signature without shapes", "(type(t), t.shape, t.stride(), t.dtype, t.device)",
     "(type(t), t.stride(), t.dtype, t.device)", "batch"),
    ("signature without dtypes", "(type(t), t.shape, t.stride(), t.dtype, t.device)",
     "(type(t), t.shape, t.stride(), t.device)", "cache_dtype"),
    ("signature without devices", "(type(t), t.shape, t.stride(), t.dtype, t.device)",
     "(type(t), t.shape, t.stride(), t.dtype)", "q_device"),
]


@pytest.mark.skipif(COMPILED, reason="each planted mistake launches the bound kernels on "
                    "tensors they were not bound to (a smaller batch, float16 read as float32): "
                    "out of bounds on a GPU, where the illegal access ends the CUDA context of "
                    "the whole test process; the interpreter (CPU) catches the mistakes safely")
@pytest.mark.parametrize("old, new, case", [p[1:] for p in PLANTED], ids=[p[0] for p in PLANTED])
def test_planted_signature_mistakes_are_caught(old, new, case, small_split, tmp_path,
                                               monkeypatch):
    """A signature that skips shapes (dtypes, devices) lets a smaller batch (a float16 call,
    a meta tensor) through to the bound kernels instead of refusing it: the refusal test of
    that case fails with the mistake planted."""
    (refusal,) = [c for c in REFUSED if c[0] == case]
    inp, plan = _bound()
    assert _refused(inp, plan, *refusal[1:])
    mutant = mutant_of(planned, [(old, new)], tmp_path, monkeypatch)
    monkeypatch.setattr(attention, "call_planned", mutant.call_planned)
    inp, plan = _bound()
    assert not _refused(inp, plan, *refusal[1:])
