"""The Triton kernels compiled on a CUDA GPU (skipped without one): the same kinds of random
cases as the interpreter tests, plus sizes only a GPU holds (long sequences, 64-bit offsets)."""

from __future__ import annotations

import pytest
import torch

import paged_ref
from paged_course.checks import assert_close
from paged_course.testing import make_paged_inputs, ragged_lengths
from paged_ref.kernels.triton.split import SplitPlan, paged_attention_split

# The input-layout tests of tests/test_inputs.py, compiled (they pick "cuda" when it exists;
# collected here again so that this file alone is the GPU run).
from tests.test_inputs import (  # noqa: F401
    test_any_strides_give_the_right_answer,
    test_minus_inf_keys_agree_with_torch,
    test_no_blocks_at_all,
    test_stride_zero_expanded_inputs,
)

pytestmark = pytest.mark.gpu  # (tests/conftest.py: skipped without a CUDA GPU)

BACKENDS = ["triton", "triton_split", "auto"]
CASES = [
    # lengths, block_size, head_dim, num_q_heads, num_kv_heads, dtype
    ([0, 1, 15, 16, 17, 300], 16, 128, 32, 8, torch.bfloat16),
    (ragged_lengths(9, 1, 3000, seed=1), 16, 128, 32, 8, torch.float16),
    ([1, 2, 33, 64, 65], 1, 64, 8, 8, torch.float32),
    ([7, 100, 257, 1000], 8, 80, 16, 2, torch.bfloat16),
    ([31, 32, 33, 999], 32, 96, 32, 4, torch.float16),
    ([5000, 12000], 16, 256, 8, 1, torch.bfloat16),
    ([40000], 16, 128, 32, 8, torch.bfloat16),
    ([4096] * 3, 64, 128, 64, 8, torch.float32),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("poison", ["large", "nan"])
def test_gpu_matches_float64_reference(backend, case, poison):
    lens, bs, d, hq, hkv, dtype = CASES[case]
    inp = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                            dtype=dtype, device="cuda", seed=case, poison=poison)
    out = paged_ref.paged_attention(*inp.args(), backend=backend)
    assert_close(out, inp.reference(), name=f"{backend} case {case}")


@pytest.mark.parametrize("fused", [False, True], ids=["merge_kernel", "fused_merge"])
@pytest.mark.parametrize("num_chunks", [1, 2, 7, 64, 300])
def test_gpu_split_any_chunking(num_chunks, fused):
    lens = [1, 700, 4097, 20000]
    inp = make_paged_inputs(lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                            dtype=torch.bfloat16, device="cuda", seed=num_chunks)
    chunk = -(-max(lens) // num_chunks)
    plan = SplitPlan(chunk, -(-max(lens) // chunk), fused_merge=fused)
    out = paged_attention_split(*inp.args(), plan=plan)
    assert_close(out, inp.reference(), name=f"split into {num_chunks}")


def test_gpu_offsets_past_2_to_the_31():
    """A cache of more than 2^31 elements: block id x block stride overflows int32."""
    num_kv_heads, head_dim, block_size = 8, 128, 16
    per_block = block_size * num_kv_heads * head_dim
    num_blocks = (2**31) // per_block + 64
    k = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, dtype=torch.bfloat16,
                    device="cuda")
    v = torch.randn_like(k)
    table = torch.arange(num_blocks - 40, num_blocks, dtype=torch.int32, device="cuda")[None]
    table = table.flip(1).contiguous()
    seq_lens = torch.tensor([40 * block_size - 3], dtype=torch.int32, device="cuda")
    q = torch.randn(1, 32, head_dim, dtype=torch.bfloat16, device="cuda")
    # The reference sees only the 40 blocks used, renumbered 0..39 (it copies to the CPU).
    compact = torch.arange(40, dtype=torch.int32, device="cuda")[None]
    ref = paged_ref.reference.paged_attention_reference(
        q, k[table[0].long()], v[table[0].long()], compact, seq_lens)
    for backend in ("triton", "triton_split"):
        out = paged_ref.paged_attention(q, k, v, table, seq_lens, backend=backend)
        assert_close(out, ref, name=backend)


@pytest.mark.parametrize("table_width", [8, (1 << 20) // 2 + 1])  # host check, device check
def test_gpu_value_checks(table_width):
    inp = make_paged_inputs([5, 40], num_q_heads=4, num_kv_heads=2, head_dim=64, device="cuda",
                            spare_columns=table_width, seed=7)
    args = list(inp.args())
    out = paged_ref.paged_attention(*args, backend="triton")  # garbage past the used blocks
    assert_close(out, inp.reference())
    bad_table = inp.block_tables.clone()
    bad_table[1, 2] = inp.k_cache.shape[0]
    with pytest.raises(ValueError, match=r"block_tables\[1, 2\]"):
        paged_ref.paged_attention(*args[:3], bad_table, args[4])
    bad_lens = inp.seq_lens.clone()
    bad_lens[0] = -1
    with pytest.raises(ValueError, match=r"seq_lens\[0\]"):
        paged_ref.paged_attention(*args[:4], bad_lens)


# --------------------------------------------------------------------------- plan once, run many
# Lengths that make dispatch pick each kernel on 132 SMs: one pass, a split into 8 chunks, a
# split into 63 chunks, a ragged batch.
PLANNED = {"one_pass": [512] * 64, "split_short": [2048] * 4, "split_long": [40000],
           "ragged": ragged_lengths(12, 1, 9000, seed=3)}
GPU_SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16)


def _planned(name, grow=0, **kw):
    lens = PLANNED[name]
    inp = make_paged_inputs([n + grow for n in lens], dtype=torch.bfloat16, device="cuda",
                            seed=len(name), **GPU_SHAPE)
    plan = paged_ref.plan_decode(lens, dtype=torch.bfloat16, device="cuda",
                                 max_seq_len=max(lens) + grow, **GPU_SHAPE, **kw)
    return inp, plan


def test_gpu_dispatch_picks_each_kernel():
    kinds = {}
    for name in PLANNED:
        plan = _planned(name)[1]
        kinds[name] = (plan.backend, plan.split and plan.split.fused_merge)
    assert kinds["one_pass"] == ("triton", None)
    assert kinds["split_short"][0] == kinds["split_long"][0] == "triton_split"


def test_gpu_small_plan_merges_in_one_launch_eagerly_and_two_when_captured():
    from paged_ref.kernels.triton.split import capturing

    inp, plan = _planned("split_short")
    assert plan.split.eager_fused_merge and not plan.split.fused_merge
    assert not capturing(inp.q)  # eager here: the fused path (the graph test covers capture)


@pytest.mark.parametrize("name", list(PLANNED))
def test_gpu_planned_call_does_not_sync(name):
    inp, plan = _planned(name)
    out = torch.empty_like(inp.q)
    paged_ref.paged_attention(*inp.args(), plan=plan, out=out)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        paged_ref.paged_attention(*inp.args(), plan=plan, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close(out, inp.reference(), name=name)


@pytest.mark.parametrize("name", list(PLANNED))
def test_gpu_planned_calls_repeat_identically(name):
    """20 planned launches in a row: right, identical, merge counters back to 0."""
    inp, plan = _planned(name)
    outs = [paged_ref.paged_attention(*inp.args(), plan=plan) for _ in range(20)]
    assert_close(outs[0], inp.reference(), name=name)
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "launches differ"
    if plan.split is not None and (plan.split.fused_merge or plan.split.eager_fused_merge):
        assert (plan.scratch.counters == 0).all()


@pytest.mark.parametrize("name", list(PLANNED))
def test_gpu_cuda_graph_capture_and_replay_with_new_values(name):
    """Capture one planned call; write longer lengths (+100), new q and a re-shuffled table
    into the same tensors; replay; compare with the float64 reference of the new inputs."""
    grown, plan = _planned(name, grow=100)
    q, k, v, tables, lens = (t.clone() for t in grown.args())
    lens.sub_(100)  # the lengths the plan was made for
    out = torch.empty_like(q)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm up (compile) off the capture
        paged_ref.paged_attention(q, k, v, tables, lens, plan=plan, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        paged_ref.paged_attention(q, k, v, tables, lens, plan=plan, out=out)
    for step in range(2):
        new = make_paged_inputs(grown.seq_lens.tolist(), dtype=torch.bfloat16, device="cuda",
                                seed=100 + step, **GPU_SHAPE)
        if new.k_cache.shape != k.shape or new.block_tables.shape != tables.shape:
            new = grown  # same shapes needed for in-place updates
        for dst, src in zip((q, k, v, tables, lens), new.args(), strict=True):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        assert_close(out, new.reference(), name=f"{name} replay {step}")


def test_gpu_unplanned_call_is_right_for_odd_layouts():
    """tests/test_inputs.py runs compiled here too; one larger case through 'auto'."""
    inp = make_paged_inputs([3000, 17, 800], dtype=torch.bfloat16, device="cuda", seed=9,
                            **GPU_SHAPE)
    q = inp.q.transpose(0, 1).contiguous().transpose(0, 1)
    lens = torch.stack([inp.seq_lens, inp.seq_lens * 0 + 10**6], 1).flatten()[::2]
    out = paged_ref.paged_attention(q, inp.k_cache, inp.v_cache, inp.block_tables, lens)
    assert_close(out, inp.reference())


@pytest.mark.parametrize("strided", [False, True])
def test_gpu_value_check_kernel_counts_what_numpy_counts(strided):
    from paged_ref.kernels.triton.checks import length_stats
    from tests.kernels.test_triton_checks import CASES, numpy_stats, random_case

    for seed, batch, width in CASES:
        table, lens, bs, nb = random_case(seed, batch, width, strided=strided)
        got = length_stats(table.cuda(), lens.cuda(), bs, nb)
        assert got == numpy_stats(table, lens, bs, nb), (seed, batch, width)


def test_gpu_unplanned_call_still_names_a_bad_entry():
    inp = make_paged_inputs([40, 300], dtype=torch.bfloat16, device="cuda", **GPU_SHAPE)
    inp.block_tables[1, 2] = 10**6
    with pytest.raises(ValueError, match=r"block_tables\[1, 2\] = 1000000"):
        paged_ref.paged_attention(*inp.args())


@pytest.mark.parametrize("backend", BACKENDS)
def test_gpu_unplanned_call_waits_only_for_the_checks(backend):
    """Without a plan the check kernel's verdict is read after the attention kernel is queued
    (a pinned copy and a CUDA event): no implicit sync, and the answer is right."""
    inp = make_paged_inputs([3000, 17, 800, 0], dtype=torch.bfloat16, device="cuda", seed=3,
                            **GPU_SHAPE)
    paged_ref.paged_attention(*inp.args(), backend=backend)  # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = paged_ref.paged_attention(*inp.args(), backend=backend)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert_close(out, inp.reference(), name=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["bad entry", "negative length", "too long"])
def test_gpu_unplanned_bad_row_is_skipped_and_named(backend, how):
    """The attention kernel already queued skips the row the checks rejected (its table points
    far outside the pool), the others are right, and the call raises the checks' message."""
    from tests.test_checked_while_running import SENTINEL, spoil

    inp = make_paged_inputs([40, 0, 300, 77], dtype=torch.bfloat16, device="cuda", seed=4,
                            **GPU_SHAPE)
    want = inp.reference()
    match = spoil(inp, how)
    if how == "bad entry":
        inp.block_tables[2, 4:] = 2**31 - 1  # (the message names the first: [2, 3])
    out = torch.full_like(inp.q, SENTINEL)
    with pytest.raises(ValueError, match=match):
        paged_ref.paged_attention(*inp.args(), backend=backend, out=out)
    torch.cuda.synchronize()  # (an out-of-bounds read would surface here)
    assert (out[2] == SENTINEL).all()
    assert_close(out[[0, 1, 3]], want[[0, 1, 3]])
