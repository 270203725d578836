"""Checks for lesson 06's exercises (plan once, run many), on fresh random inputs.

Run against the worked solutions (default) or your file:
``pytest tests/exercises/test_ex06_plan_run.py --impl exercises``.
In the notebook: ``course.check("ex06_plan_run", keyword="plan_split")``.

The last tests plant likely mistakes into the solution's source and check that the tests above
catch each one (mutation tests).
"""

from __future__ import annotations

import inspect
import types

import pytest
import torch

import paged_ref
from paged_course.checks import assert_close, assert_equal
from paged_course.cost import HostReadError, forbid_host_reads
from paged_course.testing import make_paged_inputs, ragged_lengths
from paged_ref.kernels.triton.split import num_multiprocessors
from tests.conftest import load_exercise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def ex(request):
    return load_exercise(request.config, "ex06_plan_run")


# ---- Exercise 6.1: plan_split_for_host_lengths ----------------------------------------------

PLAN_IDS = ["B64", "B4", "B4_grow", "B1_grow", "ragged", "B64_grow", "zeros", "empty"]
PLAN_CASES = [  # lengths, max_seq_len
    ([4096] * 64, None),  # enough programs: no split
    ([2048] * 4, None),  # small batch: split
    ([2048] * 4, 3000),  # ... covering growth
    ([40000], 50000),
    (ragged_lengths(32, 64, 16384, seed=0), 20000),
    ([500] * 64, 5000),  # no split now, though the bound alone would split
    ([0, 0], None),
    ([], None),
]


@pytest.mark.parametrize("lens, max_seq_len", PLAN_CASES, ids=PLAN_IDS)
def test_plan_split_matches_plan_decode(ex, lens, max_seq_len):
    # The plan paged_ref makes on this machine's device (a GPU refuses triton_split for CPU
    # tensors), for its number of multiprocessors (132 in the interpreter).
    sms = num_multiprocessors(DEVICE)
    got = ex.plan_split_for_host_lengths(lens, num_kv_heads=8, max_seq_len=max_seq_len,
                                         num_sms=sms)
    want = paged_ref.plan.dispatch("triton_split", torch.device(DEVICE), batch=len(lens),
                                   num_kv_heads=8, max_len=max(lens, default=0),
                                   total_tokens=sum(lens), max_seq_len=max_seq_len)[1]
    if want is None:  # no split: one chunk
        assert got.num_chunks == 1, f"expected no split (1 chunk), got {got}"
    else:
        assert (got.chunk_size, got.num_chunks) == (want.chunk_size, want.num_chunks), (
            f"expected {want.num_chunks} chunks of {want.chunk_size}, got {got}")
    if got.num_chunks > 1:
        assert got.num_chunks * got.chunk_size >= (max_seq_len or max(lens)), (
            "the chunks do not cover max_seq_len")


@pytest.mark.parametrize("lens, max_seq_len, error, text", [
    ([3, -1], None, ValueError, "seq_lens[1]"),
    ([3, 2.0], None, TypeError, "seq_lens[1]"),
    ([True], None, TypeError, "seq_lens[0]"),
    ([3, torch.tensor(4)], None, TypeError, "seq_lens[1]"),
    ([3, 9], 8, ValueError, "max_seq_len"),
], ids=["negative", "float", "bool", "tensor", "max_too_small"])
def test_plan_split_bad_lengths(ex, lens, max_seq_len, error, text):
    with pytest.raises(error) as info:
        ex.plan_split_for_host_lengths(lens, num_kv_heads=8, max_seq_len=max_seq_len)
    assert text in str(info.value), f"the message should name {text!r}: {info.value}"


# ---- Exercise 6.2: append_tokens_on_device -----------------------------------------------------


def _inputs(lens, seed, extra_tokens=3, **kw):
    """Inputs whose tables hold the blocks for ``extra_tokens`` more tokens per sequence."""
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=4) | kw
    inp = make_paged_inputs([n + extra_tokens for n in lens], device=DEVICE, seed=seed, **kw)
    inp.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
    return inp


@pytest.mark.parametrize("lens, dtype", [([5, 0, 8, 11], torch.float32),
                                         ([3, 4, 1], torch.bfloat16)], ids=["f32", "bf16"])
def test_append_writes_the_right_slots_without_a_sync(ex, lens, dtype):
    inp = _inputs(lens, seed=len(lens), dtype=dtype)
    k, v = inp.k_cache.clone(), inp.v_cache.clone()
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    k_new = torch.randn(len(lens), 2, 32, generator=gen, device=DEVICE).to(dtype)
    v_new = torch.randn(len(lens), 2, 32, generator=gen, device=DEVICE).to(dtype)
    with forbid_host_reads():
        ex.append_tokens_on_device(inp.k_cache, inp.v_cache, inp.block_tables, inp.seq_lens,
                                   k_new, v_new)
    assert_equal(inp.seq_lens.cpu(), torch.tensor(lens, dtype=torch.int32) + 1,
                 name="seq_lens after the step")
    for b, n in enumerate(lens):  # the expected slot, computed on the host
        block, offset = int(inp.block_tables[b, n // 4]), n % 4
        k[block, offset], v[block, offset] = k_new[b], v_new[b]
    assert_equal(inp.k_cache, k, name="k_cache (the new token's slot, nothing else)")
    assert_equal(inp.v_cache, v, name="v_cache (the new token's slot, nothing else)")


def test_append_then_attention_matches_the_reference(ex):
    inp = _inputs([6, 13], seed=3)
    k_new, v_new = torch.randn(2, 2, 2, 32, device=DEVICE).unbind(0)
    ex.append_tokens_on_device(*inp.args()[1:], k_new, v_new)
    assert_close(paged_ref.paged_attention(*inp.args()), inp.reference(), name="attention")


# ---- Exercise 6.3: capture_step --------------------------------------------------------------


def test_capture_step_replays_the_step(ex):
    """The returned function runs the step on the values its tensors hold when called."""
    x = torch.randn(8, device=DEVICE)
    y = torch.zeros(8, device=DEVICE)

    def step():
        y.copy_(x * 2 + 1)

    replay = ex.capture_step(step)
    for _ in range(3):
        x.copy_(torch.randn(8, device=DEVICE))  # new input, same tensor
        replay()
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        assert_close(y, (x.double() * 2 + 1), name="y after replay")


# ---- given: run_decode_steps = 6.1..6.3 with a plan ------------------------------------------


def test_decode_steps_match_the_reference(ex):
    inp = _inputs([5, 9, 1], seed=4, extra_tokens=4, dtype=torch.float32)
    results = ex.run_decode_steps(inp, 4, seed=5)
    assert len(results) == 4
    for i, (out, ref) in enumerate(results):
        assert_close(out, ref, name=f"step {i}")
    assert_equal(inp.seq_lens.cpu(), torch.tensor([9, 13, 5], dtype=torch.int32),
                 name="lengths after 4 steps")


# ---- mutation tests: each planted mistake must make a test above fail -----------------------

MUTATIONS = [
    # (id, test to run, text in the solution, its replacement)
    ("plan_ignores_growth", test_plan_split_matches_plan_decode,
     "cdiv(max_seq_len, plan.chunk_size)", "plan.num_chunks"),
    ("plan_from_the_bound", test_plan_split_matches_plan_decode,
     "max_len=longest,", "max_len=max_seq_len,"),
    ("plan_accepts_negative", test_plan_split_bad_lengths, "if n < 0:", "if n < -10:"),
    ("plan_accepts_bool", test_plan_split_bad_lengths,
     "isinstance(n, bool) or ", ""),
    ("append_forgets_length", test_append_writes_the_right_slots_without_a_sync,
     "seq_lens.add_(1)", "pass"),
    ("append_offset_swapped", test_append_writes_the_right_slots_without_a_sync,
     "block * block_size + pos % block_size", "block * block_size + pos // block_size"),
    ("append_reads_back", test_append_writes_the_right_slots_without_a_sync,
     "pos = seq_lens.long()", "pos = torch.tensor(seq_lens.tolist(), device=seq_lens.device)"),
    ("append_one_past", test_append_writes_the_right_slots_without_a_sync,
     "pos = seq_lens.long()", "pos = seq_lens.long() + 1"),
    ("capture_runs_nothing", test_capture_step_replays_the_step,
     "return lambda: step()", "return lambda: None"),
    ("capture_runs_once", test_capture_step_replays_the_step,
     "return lambda: step()", "step()\n        return lambda: None"),
]


def _mutant(old: str, new: str):
    import solutions.ex06_plan_run as solution

    source = inspect.getsource(solution)
    parts = source.split("# BEGIN SOLUTION")  # plant the mistake inside a solution block only
    hits = [i for i, part in enumerate(parts) if old in part.split("# END SOLUTION")[0]]
    assert len(hits) == 1 and parts[hits[0]].count(old) == 1, f"target {old!r} not unique"
    parts[hits[0]] = parts[hits[0]].replace(old, new)
    module = types.ModuleType("ex06_mutant")
    exec(compile("# BEGIN SOLUTION".join(parts), "ex06_mutant", "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("test, old, new", [m[1:] for m in MUTATIONS],
                         ids=[m[0] for m in MUTATIONS])
def test_mutation_is_caught(request, test, old, new):
    if request.config.getoption("--impl") != "solutions":
        pytest.skip("mutation tests check the tests, against the solutions")
    if test is test_capture_step_replays_the_step and DEVICE == "cuda" and "lambda" in old:
        pytest.skip("the CPU fallback is not used on a GPU")
    mutant = _mutant(old, new)
    params = [mark for mark in getattr(test, "pytestmark", []) if mark.name == "parametrize"]
    cases = [dict(zip([n.strip() for n in p.args[0].split(",")], values, strict=True))
             for p in params for values in p.args[1]] or [{}]
    caught = 0
    for case in cases:
        try:
            test(mutant, **case)
        except (AssertionError, HostReadError, TypeError, ValueError, RuntimeError,
                pytest.fail.Exception):
            caught += 1
    assert caught, f"no test caught the planted mistake {old!r} -> {new!r}"
