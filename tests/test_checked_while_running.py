"""The unplanned call's GPU path of :func:`paged_ref.paged_attention`, run here in Triton's
interpreter (on a GPU ``paged_attention`` takes it for every Triton backend; tests/test_gpu.py
checks that there): the check kernel is queued first and the attention kernel right behind it,
and the verdict is read only after both.

The check kernel writes ``checked_lens`` (``-1`` for a row that failed a check) and the
attention kernels skip such rows: nothing of theirs is read (their table entries may point
anywhere) and their output rows are left as they were. Rows that passed are right; the call
then raises the same named error as the checks done first would.
"""

from __future__ import annotations

import pytest
import torch

from paged_course.checks import assert_close
from paged_course.testing import make_paged_inputs
from paged_ref import attention, paged_attention, planned
from paged_ref.kernels.triton import checks as triton_checks
from paged_ref.kernels.triton.checks import start_checks
from paged_ref.kernels.triton.decode import KernelConfig, paged_attention_triton
from paged_ref.kernels.triton.split import SplitPlan, paged_attention_split
from paged_ref.validation import check_shapes, check_values
from tests.conftest import KERNEL_DEVICE
from tests.mutations.mutate import mutant_of

SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4, dtype=torch.float32)
LENS = [9, 0, 23, 14]
SENTINEL = 7.25
#: Where the Triton kernels take tensors here: CUDA on a GPU (compiled), the CPU otherwise.
DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)


def inputs(seed=0):
    return make_paged_inputs(LENS, seed=seed, device=DEVICE, **SHAPE)


def spoil(inp, how):
    """Make row 2 fail a check; returns the error text the checks give."""
    if how == "bad entry":
        inp.block_tables[2, 3] = 10**6
        return r"block_tables\[2, 3\] = 1000000"
    if how == "negative length":
        inp.seq_lens[2] = -3
        return r"seq_lens\[2\] = -3 is negative"
    inp.seq_lens[2] = inp.block_tables.shape[1] * inp.k_cache.shape[1] + 1
    return r"seq_lens\[2\] = \d+ needs more blocks"


@pytest.fixture
def device_checks(monkeypatch):
    """``paged_attention`` takes its GPU path here: the checks as a kernel, queued before the
    attention kernel. Returns the list of the check launches' batch sizes."""
    launches = []

    def counted(block_tables, seq_lens, block_size, num_blocks):
        launches.append(block_tables.shape[0])
        return start_checks(block_tables, seq_lens, block_size, num_blocks)

    monkeypatch.setattr(attention, "checks_on_device", lambda seq_lens: True)
    monkeypatch.setattr(triton_checks, "start_checks", counted)
    monkeypatch.setattr(planned, "_UNPLANNED", {})  # no plan remembered from another test
    return launches


@pytest.mark.parametrize("backend", ["triton", "triton_split"])
def test_valid_inputs_give_the_reference(backend, device_checks):
    inp = inputs()
    out = paged_attention(*inp.args(), backend=backend)
    assert device_checks == [len(LENS)], "the checks were not queued as a kernel"
    assert_close(out, inp.reference())


@pytest.mark.parametrize("how", ["bad entry", "negative length", "too long"])
@pytest.mark.parametrize("backend", ["triton", "triton_split"])
def test_a_failed_check_raises_the_named_error_and_skips_only_that_row(backend, how,
                                                                       device_checks):
    inp = inputs(seed=1)
    want = inp.reference()
    match = spoil(inp, how)
    with pytest.raises(ValueError, match=match):  # the same message as checking first
        check_values(inp.block_tables, inp.seq_lens, check_shapes(*inp.args()))
    out = torch.full_like(inp.q, SENTINEL)
    with pytest.raises(ValueError, match=match):
        paged_attention(*inp.args(), backend=backend, out=out)
    assert device_checks == [len(LENS)]
    assert (out[2] == SENTINEL).all(), "the failing row was written"
    keep = [0, 1, 3]
    assert_close(out[keep], want[keep])


@pytest.mark.parametrize("backend", ["triton", "triton_split"])
def test_a_pool_of_no_blocks_reads_nothing(backend, device_checks):
    """num_blocks == 0 (tests/test_inputs.py's case, on this path): the plan covers length 0
    only, so the kernel reads nothing; empty rows give zeros, a row of length 1 the named
    error (the GPU path planned for the table's capacity and refused its own plan)."""
    k = torch.randn(0, 8, 2, 32, device=DEVICE)
    q = torch.randn(2, 4, 32, device=DEVICE)
    tables = torch.full((2, 1), -1, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([0, 0], dtype=torch.int32, device=DEVICE)
    assert (paged_attention(q, k, k, tables, lens, backend=backend) == 0).all()
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = -1 is outside \[0, num_"):
        paged_attention(q, k, k, tables, lens + torch.tensor([0, 1], dtype=torch.int32,
                                                             device=DEVICE), backend=backend)
    assert device_checks == [2, 2]


@pytest.mark.parametrize("runner", ["one pass", "split + merge kernel", "split, fused merge"])
def test_kernels_skip_a_row_of_length_minus_one(runner):
    """Row 2's table points far outside the pool: a kernel that read it would crash or
    return garbage; skipped, its output keeps the sentinel."""
    inp = inputs(seed=2)
    want = inp.reference()
    inp.block_tables[2] = 10**6
    lens = inp.seq_lens.clone()
    lens[2] = -1
    out = torch.full_like(inp.q, SENTINEL)
    args = (inp.q, inp.k_cache, inp.v_cache, inp.block_tables, lens)
    if runner == "one pass":
        paged_attention_triton(*args, config=KernelConfig(tile=16), out=out)
    else:
        plan = SplitPlan(8, 4, fused_merge=runner.endswith("fused merge"))
        paged_attention_split(*args, plan=plan, config=KernelConfig(tile=16), out=out)
    assert (out[2] == SENTINEL).all()
    assert_close(out[[0, 1, 3]], want[[0, 1, 3]])


@pytest.mark.skipif(DEVICE != "cpu", reason="on a GPU the verdict comes with a CUDA event")
def test_pending_checks_on_the_cpu_need_no_event():
    inp = inputs()
    pending = start_checks(inp.block_tables, inp.seq_lens, SHAPE["block_size"],
                           inp.k_cache.shape[0])
    assert pending.done is None
    assert pending.stats() == (0, max(LENS), sum(LENS), 0)
    assert pending.checked_lens.tolist() == LENS


KERNEL_MUTATIONS = [  # (module, line as written, planted mistake, runner)
    ("decode", "    if seq_len >= 0:\n", "    if seq_len >= -1:\n", "one pass"),
    ("split", "    if seq_len >= 0:\n", "    if seq_len >= -1:\n", "split + merge kernel"),
    ("split", "if (c == 0) & (seq_len == 0):", "if c == 0:", "split, fused merge"),
]


@pytest.mark.parametrize("module, old, new, runner", KERNEL_MUTATIONS,
                         ids=[m[3] for m in KERNEL_MUTATIONS])
def test_planted_mistakes_in_the_skip_are_caught(module, old, new, runner, tmp_path,
                                                 monkeypatch):
    """A kernel that treats a rejected row (-1) as empty writes zeros over it: caught."""
    import importlib

    real = importlib.import_module(f"paged_ref.kernels.triton.{module}")
    mutant = mutant_of(real, [(old, new)], tmp_path, monkeypatch)
    name = "paged_attention_triton" if module == "decode" else "paged_attention_split"
    monkeypatch.setitem(globals(), name, getattr(mutant, name))
    with pytest.raises(AssertionError):
        test_kernels_skip_a_row_of_length_minus_one(runner)


# -- Later calls with the same metadata: the remembered plan (paged_ref.planned.call_unplanned)


@pytest.fixture
def plans_made(monkeypatch):
    """The number of plans the unplanned path has made so far (a list of one int)."""
    made = [0]
    real = attention.make_plan

    def counted(*args, **kwargs):
        made[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "make_plan", counted)
    return made


def fresh_values(inp, seed):
    """Other lengths (up to what the table holds) and a shuffled table, same metadata."""
    gen = torch.Generator().manual_seed(seed)
    capacity = inp.block_tables.shape[1] * SHAPE["block_size"]
    inp.seq_lens.copy_(torch.randint(0, capacity + 1, inp.seq_lens.shape, generator=gen))
    num_blocks = inp.k_cache.shape[0]
    inp.block_tables.copy_(torch.randint(0, num_blocks, inp.block_tables.shape, generator=gen))
    return inp


@pytest.mark.parametrize("backend", ["auto", "triton", "triton_split"])
def test_later_calls_reuse_the_plan_and_check_every_time(backend, device_checks, plans_made):
    inp = inputs(seed=3)
    outs = []
    for seed in range(3):
        fresh_values(inp, seed)
        outs.append((paged_attention(*inp.args(), backend=backend), inp.reference()))
    assert plans_made == [1], "the plan was not remembered"
    assert device_checks == [len(LENS)] * 3, "a later call skipped the check kernel"
    for got, want in outs:
        assert_close(got, want)


def later_call_with_a_bad_value(how, seed=4):
    """A call remembered with valid values, then the same call with row 2 spoiled: it must
    raise the named error, leave row 2 unwritten and get the other rows right."""
    inp = inputs(seed=seed)
    out = torch.full_like(inp.q, SENTINEL)
    paged_attention(*inp.args(), backend="triton_split", out=out)  # remembered
    out.fill_(SENTINEL)
    want = inp.reference()
    match = spoil(inp, how)
    with pytest.raises(ValueError, match=match):
        paged_attention(*inp.args(), backend="triton_split", out=out)
    assert (out[2] == SENTINEL).all(), "the failing row was written"
    assert_close(out[[0, 1, 3]], want[[0, 1, 3]])


@pytest.mark.parametrize("how", ["bad entry", "negative length", "too long"])
def test_a_later_call_with_a_bad_value_raises_the_named_error(how, device_checks, plans_made):
    later_call_with_a_bad_value(how)
    assert plans_made == [1]
    assert device_checks == [len(LENS)] * 2


def other_scales(inp):
    """Calls that differ from a remembered one in scale only: each must be right, and a
    scale of True refused although ``True == 1.0``."""
    paged_attention(*inp.args())
    assert_close(paged_attention(*inp.args(), scale=0.5), inp.reference(scale=0.5))
    assert_close(paged_attention(*inp.args(), scale=0.25), inp.reference(scale=0.25))
    paged_attention(*inp.args(), scale=1.0)
    with pytest.raises(TypeError, match="scale"):
        paged_attention(*inp.args(), scale=True)


def test_other_metadata_scale_or_backend_is_planned_again(device_checks, plans_made):
    inp = inputs(seed=5)
    other_scales(inp)
    assert plans_made == [4]  # None, 0.5, 0.25, 1.0
    paged_attention(*inp.args(), backend="triton")
    paged_attention(inp.q[:3], inp.k_cache, inp.v_cache, inp.block_tables[:3], inp.seq_lens[:3])
    assert plans_made == [6]


def test_remembered_plans_are_bounded(device_checks):
    inp = inputs(seed=6)
    for i in range(planned.MAX_UNPLANNED + 3):
        paged_attention(*inp.args(), scale=0.1 * (i + 1))
    assert 0 < len(planned._UNPLANNED) <= planned.MAX_UNPLANNED


#: (planted mistake in paged_ref.planned, old text, new text, the test that catches it)
UNPLANNED_MUTATIONS = [
    ("value checks skipped", "    check_values(block_tables, seq_lens, shapes, pending.stats())",
     "    pass", "bad value"),
    ("scale not in the key", "type(scale), scale, backend, device", "backend, device", "scale"),
    ("scale's type not in the key", "type(scale), scale, backend", "scale, backend", "scale"),
]


@pytest.mark.parametrize("old, new, catcher", [m[1:] for m in UNPLANNED_MUTATIONS],
                         ids=[m[0] for m in UNPLANNED_MUTATIONS])
def test_planted_mistakes_in_the_remembered_path_are_caught(old, new, catcher, device_checks,
                                                           plans_made, tmp_path, monkeypatch):
    mutant = mutant_of(planned, [(old, new)], tmp_path, monkeypatch)
    for name in ("call_unplanned", "remember_unplanned", "unplanned_key"):
        monkeypatch.setattr(attention, name, getattr(mutant, name))
    with pytest.raises((AssertionError, pytest.fail.Exception)):  # (a check, or DID NOT RAISE)
        if catcher == "bad value":
            for how in ("bad entry", "negative length", "too long"):
                later_call_with_a_bad_value(how)
        else:
            other_scales(inputs(seed=5))


def test_unknown_lengths_are_planned_as_a_ragged_batch():
    """Before its checks have run, an unplanned GPU call plans for lengths it does not know:
    B32_ragged's table (32 rows of 1,010 blocks of 16) must get the split its lengths get
    (8 chunks of 2,048), not the one of 32 full rows (2 of 8,128: a long row alone at the
    end); one row is as long as the table holds."""
    from paged_bench.decode import CASES
    from paged_ref.kernels.triton.split import plan_split
    from paged_ref.validation import Shapes

    lens = CASES["B32_ragged"]
    shapes = Shapes(batch=32, num_q_heads=32, num_kv_heads=8, head_dim=128, num_blocks=20000,
                    block_size=16, max_blocks_per_seq=1010)
    got = attention.unknown_lengths(shapes)
    split = plan_split(batch=32, num_kv_heads=8, max_len=got.max_len,
                       total_tokens=got.total_tokens)
    wanted = plan_split(batch=32, num_kv_heads=8, max_len=max(lens), total_tokens=sum(lens))
    assert split.num_chunks >= wanted.num_chunks == 8
    one = attention.unknown_lengths(Shapes(1, 32, 8, 128, 9000, 16, 8193))
    assert one.max_len == one.total_tokens == 8193 * 16
