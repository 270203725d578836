"""``plan_prefill`` + ``paged_prefill(..., plan=plan)``: the planned call gives the unplanned
call's answer (against float64) on ragged batches, reads no tensor value back, refuses
tensors that do not match its plan (named), and refuses bad plans. On a CPU the Triton kernel
runs in the interpreter; the GPU run also takes the decode kernels for one-row batches."""

from __future__ import annotations

import random

import pytest
import torch

from paged_course.checks import assert_close
from paged_course.cost import HostReadError, forbid_host_reads
from paged_course.testing import make_prefill_inputs
from paged_ref import PrefillPlan, paged_prefill, plan_prefill, prefill_plan
from tests.conftest import COMPILED, KERNEL_DEVICE
from tests.mutations.mutate import mutant_of

SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=5)


def _case(seed: int, batch: int = 4):
    """Ragged lengths: whole prompts, chunks after a prefix, one-row and zero-row sequences."""
    rng = random.Random(seed)
    seq_lens = [rng.randint(1, 40) for _ in range(batch)]
    query_lens = [rng.choice([s, rng.randint(0, s), 1, 0]) for s in seq_lens]
    return seq_lens, query_lens


def _plan(seq_lens, query_lens, inp, **kw):
    return plan_prefill(query_lens, seq_lens, dtype=inp.q.dtype, device=inp.q.device,
                        **SHAPE, **kw)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("seed", range(3))
def test_planned_call_matches_float64_and_reads_nothing_back(backend, seed):
    seq_lens, query_lens = _case(seed)
    inp = make_prefill_inputs(seq_lens, query_lens, seed=seed, device=KERNEL_DEVICE,
                              poison="nan", **SHAPE)
    plan = _plan(seq_lens, query_lens, inp, backend=backend)
    want = inp.reference()
    assert_close(paged_prefill(*inp.args(), plan=plan), want, name=f"planned {backend}")
    if backend == "torch" or COMPILED:  # (the interpreter copies tensors to run a kernel)
        with forbid_host_reads():
            out = paged_prefill(*inp.args(), plan=plan)
        assert_close(out, want, name=f"planned {backend}, no host reads")


def test_a_mixed_batch_is_split_once_at_plan_time(monkeypatch):
    """A mixed batch (long prompts with decode-like rows) runs as two launches whose row ids
    the plan uploaded once, each its own aligned tensor: every layer's call reuses them (no
    upload per layer, which on a GPU may wait for the GPU), and still gives the float64
    answer."""
    from paged_ref.kernels.triton import prefill as triton_prefill

    seq_lens, query_lens = [30, 9, 21, 5, 40], [20, 1, 3, 0, 15]  # (GQA 2: <= 8 rows is short)
    inp = make_prefill_inputs(seq_lens, query_lens, seed=5, device=KERNEL_DEVICE, **SHAPE)
    plan = _plan(seq_lens, query_lens, inp, backend="triton")
    long_, short = plan.launches
    assert long_.seq_ids.device == inp.q.device and long_.seq_ids.dtype == torch.int32
    assert (long_.seq_ids.tolist(), short.seq_ids.tolist()) == ([0, 4], [1, 2])
    assert (long_.max_query_len, short.max_query_len) == (20, 3)
    assert short.config == triton_prefill.SHORT_CONFIG
    # 16-byte aligned, as warm-up's were (Triton compiles unaligned pointers apart)
    assert long_.seq_ids.data_ptr() % 16 == 0 and short.seq_ids.data_ptr() % 16 == 0

    def replanned(*args, **kw):
        raise AssertionError("a planned call worked its launches out again")

    monkeypatch.setattr(triton_prefill, "plan_launches", replanned)
    for layer in range(2):
        assert_close(paged_prefill(*inp.args(), plan=plan), inp.reference(),
                     name=f"planned mixed batch, layer {layer}")


def test_unplanned_call_reads_values_back():
    """The contrast the plan exists for (and proof that the guard above can fail)."""
    inp = make_prefill_inputs([9, 4], [9, 2], device="cpu", **SHAPE)
    with forbid_host_reads(), pytest.raises(HostReadError):
        paged_prefill(*inp.args(), backend="torch")


def test_non_causal_and_scale_come_from_the_plan():
    inp = make_prefill_inputs([12, 7], [5, 7], seed=3, device="cpu", **SHAPE)
    plan = _plan([12, 7], [5, 7], inp, backend="torch", causal=False, scale=0.3)
    assert_close(paged_prefill(*inp.args(), plan=plan), inp.reference(scale=0.3, causal=False),
                 name="non-causal, scale 0.3")
    with pytest.raises(ValueError, match="scale: the plan's"):
        paged_prefill(*inp.args(), plan=plan, scale=0.3)
    with pytest.raises(ValueError, match="causal, backend: the plan's"):
        paged_prefill(*inp.args(), plan=plan, causal=False, backend="torch")


@pytest.mark.skipif(not COMPILED, reason="the decode kernels are picked only where Triton "
                    "compiles (auto plans torch on a CPU)")
def test_one_row_batches_take_the_decode_kernels():
    seq_lens = [300, 17, 1, 2048]
    inp = make_prefill_inputs(seq_lens, [1] * 4, seed=9, device="cuda", **SHAPE)
    plan = _plan(seq_lens, [1] * 4, inp)
    assert plan.backend == "decode" and plan.decode is not None
    assert_close(paged_prefill(*inp.args(), plan=plan), inp.reference(), name="decode plan")


def test_an_asked_backend_is_kept_for_one_row_batches():
    """Only "auto" hands one-row batches to the decode kernels (as the unplanned call)."""
    inp = make_prefill_inputs([6, 3], [1, 1], seed=4, device=KERNEL_DEVICE, **SHAPE)
    plan = _plan([6, 3], [1, 1], inp, backend="triton")
    assert plan.backend == "triton" and plan.decode is None
    assert_close(paged_prefill(*inp.args(), plan=plan), inp.reference(), name="triton, 1 row")


def _refusals():
    """(name, what changes in the call, the error's words)."""
    seq_lens, query_lens = [10, 6], [4, 6]
    inp = make_prefill_inputs(seq_lens, query_lens, device="cpu", **SHAPE)
    plan = _plan(seq_lens, query_lens, inp, backend="torch")
    a = dict(zip(("q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"),
                 inp.args(), strict=True))
    other_cache = make_prefill_inputs(seq_lens, query_lens, device="cpu",
                                      **{**SHAPE, "block_size": 4})
    return plan, a, [
        ("more q rows", {"q": torch.cat([a["q"], a["q"][:1]])}, "q has 11 rows"),
        ("another batch", {"seq_lens": a["seq_lens"][:1], "block_tables": a["block_tables"][:1],
                           "query_start_loc": a["query_start_loc"][:2]}, "query_start_loc is"),
        ("q heads", {"q": a["q"].repeat(1, 2, 1)}, "num_q_heads"),
        ("block size", {"k_cache": other_cache.k_cache, "v_cache": other_cache.v_cache,
                        "block_tables": other_cache.block_tables}, "block_size"),
        ("dtype", {"q": a["q"].half()}, "float16"),
        ("table too short", {"block_tables": a["block_tables"][:, :1]}, "max_seq_len"),
        ("int64 starts", {"query_start_loc": a["query_start_loc"].long()}, "int32"),
    ]


@pytest.mark.parametrize("case", range(7))
def test_tensors_other_than_planned_are_refused(case):
    plan, args, refusals = _refusals()
    name, change, words = refusals[case]
    with pytest.raises((ValueError, TypeError), match=words):
        paged_prefill(**{**args, **change}, plan=plan)


def test_a_planted_missing_check_is_caught(tmp_path, monkeypatch):
    """Without the comparison against the plan, a batch other than planned runs (silently
    wrong); the refusal test above then fails."""
    plan, args, refusals = _refusals()
    mutant = mutant_of(prefill_plan, [(
        "    check_against_plan(plan, shapes, q, getattr(k_cache, \"format\", None))\n", "")],
        tmp_path, monkeypatch)
    _, change, _ = refusals[2]  # q heads: only check_against_plan sees it
    with pytest.raises(ValueError):
        prefill_plan.check_planned_prefill(plan, **{**args, **change})
    mutant_plan = mutant.plan_prefill(plan.query_lens, plan.seq_lens, dtype=plan.dtype,
                                      device=plan.device, backend="torch", **SHAPE)
    mutant.check_planned_prefill(mutant_plan, **{**args, **change})  # passes: caught above


@pytest.mark.parametrize("kw, error, words", [
    (dict(query_lens=[3, 5], seq_lens=[3, 4]), ValueError, r"query_lens\[1\] = 5 > seq_lens"),
    (dict(query_lens=[1], seq_lens=[3, 4]), ValueError, "query_lens has 1 sequences"),
    (dict(query_lens=[-1], seq_lens=[3]), ValueError, "must be >= 0"),
    (dict(causal="yes"), TypeError, "causal must be a bool"),
    (dict(backend="triton_split"), ValueError, "backend must be one of"),
    (dict(num_q_heads=3), ValueError, "multiple of num_kv_heads"),
    (dict(dtype=torch.int32), TypeError, "dtype must be one of"),
])
def test_bad_plans_are_refused_by_name(kw, error, words):
    args = dict(query_lens=[2], seq_lens=[3], **SHAPE, dtype=torch.float32, device="cpu") | kw
    with pytest.raises(error, match=words):
        plan_prefill(args.pop("query_lens"), args.pop("seq_lens"), **args)


def test_plan_is_a_prefill_plan_and_other_plans_are_refused():
    inp = make_prefill_inputs([4], [4], device="cpu", **SHAPE)
    plan = _plan([4], [4], inp, backend="torch")
    assert isinstance(plan, PrefillPlan) and plan.total_query_tokens == 4
    with pytest.raises(TypeError, match="plan must be a PrefillPlan"):
        paged_prefill(*inp.args(), plan=object())
