"""Split-KV specifics, in Triton's interpreter on a CPU (compiled on a GPU machine): explicit
chunkings (empty chunks, chunks shorter than a block, a sequence shorter than one chunk) and
the plan heuristic."""

from __future__ import annotations

import math

import pytest
import torch

from paged_course.checks import assert_close, relative_error, tolerance
from paged_course.testing import make_paged_inputs
from paged_ref.kernels.triton.decode import KernelConfig
from paged_ref.kernels.triton.split import SplitPlan, paged_attention_split, plan_split
from tests.conftest import KERNEL_DEVICE as DEVICE
from tests.mutations.mutate import mutant_of

CHUNKINGS = [
    # lengths, block_size, chunk_size, head_dim, (num_q_heads, num_kv_heads), dtype
    ([0, 1, 7, 40], 8, 16, 64, (4, 1), torch.float32),  # many chunks empty for short rows
    ([3, 50], 16, 5, 64, (8, 2), torch.float16),  # chunk not a multiple of the block or tile
    ([1, 2, 3], 4, 64, 80, (8, 8), torch.float32),  # every sequence shorter than one chunk
    ([33, 64, 65], 1, 32, 96, (16, 2), torch.bfloat16),  # block size 1, exact multiples
    ([70, 17], 32, 24, 128, (8, 1), torch.float16),  # chunks straddle blocks
    # 23 chunks, a group of 16: the merges take several steps (merge kernel 16 chunks a step,
    # the fused merge fused_chunk_tile(16, 128) = 4), carrying a running max between them
    ([90, 7], 8, 4, 128, (16, 1), torch.float32),
]


@pytest.mark.parametrize("case", range(len(CHUNKINGS)))
@pytest.mark.parametrize("poison", ["large", "nan"])
@pytest.mark.parametrize("fused", [False, True], ids=["merge kernel", "fused merge"])
def test_split_matches_reference_for_any_chunking(case, poison, fused):
    lens, bs, chunk, d, (hq, hkv), dtype = CHUNKINGS[case]
    inp = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                            dtype=dtype, device=DEVICE, seed=10 + case, poison=poison)
    plan = SplitPlan(chunk_size=chunk, num_chunks=math.ceil(max(lens) / chunk), fused_merge=fused)
    out = paged_attention_split(*inp.args(), plan=plan, config=KernelConfig(tile=16))
    assert out.dtype == inp.q.dtype and out.shape == inp.q.shape
    assert_close(out, inp.reference(), name=f"chunking {case}")


def test_split_with_custom_scale_and_extra_chunks():
    """More chunks than any sequence needs: the extra programs do nothing, the merge skips them."""
    inp = make_paged_inputs([20, 9], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=8,
                            device=DEVICE, seed=3)
    out = paged_attention_split(*inp.args(), scale=0.3, plan=SplitPlan(8, 6),
                                config=KernelConfig(tile=16))
    assert_close(out, inp.reference(scale=0.3))


def test_split_is_deterministic():
    inp = make_paged_inputs([45, 3, 30], num_q_heads=8, num_kv_heads=2, head_dim=64,
                            device=DEVICE, seed=4)
    plan = SplitPlan(16, 3)
    a = paged_attention_split(*inp.args(), plan=plan, config=KernelConfig(tile=16))
    b = paged_attention_split(*inp.args(), plan=plan, config=KernelConfig(tile=16))
    assert torch.equal(a, b)


STANDARD = {  # name: (batch, lengths) as in paged_bench.decode, 8 KV heads, 132 SMs
    "B64_L4096": [4096] * 64,
    "B8_L32768": [32768] * 8,
    "B1_L131072": [131072],
    "B256_L1024": [1024] * 256,
    "B4_L2048": [2048] * 4,
}


def _plan(lens, num_kv_heads=8, num_sms=132):
    return plan_split(batch=len(lens), num_kv_heads=num_kv_heads, max_len=max(lens),
                      total_tokens=sum(lens), num_sms=num_sms)


def test_plan_does_not_split_when_the_grid_is_full_and_balanced():
    assert _plan(STANDARD["B64_L4096"]).num_chunks == 1
    assert _plan(STANDARD["B256_L1024"]).num_chunks == 1


def test_plan_splits_long_sequences_into_enough_programs():
    for name in ("B8_L32768", "B1_L131072", "B4_L2048"):
        lens = STANDARD[name]
        plan = _plan(lens)
        programs = len(lens) * 8 * plan.num_chunks
        assert plan.num_chunks > 1, name
        assert programs >= 132, f"{name}: {programs} programs leave SMs idle"
        assert plan.chunk_size * plan.num_chunks >= max(lens), name
        assert plan.chunk_size % 64 == 0 and plan.chunk_size >= 256, name


def test_only_small_plans_merge_in_the_split_kernel_when_run_eagerly():
    """B4_L2048 is launch-bound: run eagerly it merges in one launch; big cases keep the
    merge kernel (the fused merge's serial tail costs GPU time there)."""
    assert _plan(STANDARD["B4_L2048"]).eager_fused_merge
    for name in ("B8_L32768", "B1_L131072"):
        assert not _plan(STANDARD[name]).eager_fused_merge, name


def test_an_eager_fused_plan_runs_fused_and_is_right():
    """Off a CUDA graph (always, in the interpreter) an eager_fused_merge plan takes the fused
    path: the counters it uses come back to zero and the answer matches float64."""
    from paged_ref.kernels.triton.split import SplitPlan, SplitScratch, paged_attention_split

    inp = make_paged_inputs([40, 7, 65], num_q_heads=4, num_kv_heads=2, head_dim=16,
                            block_size=8, device=DEVICE)
    plan = SplitPlan(16, 5, eager_fused_merge=True)
    scratch = SplitScratch.allocate(3, 4, 2, 16, plan, DEVICE)
    scratch.counters.fill_(0)
    out = paged_attention_split(*inp.args(), plan=plan, scratch=scratch)
    assert_close(out, inp.reference(), name="eager fused")
    assert (scratch.counters == 0).all()


def test_plan_splits_a_ragged_batch_whose_longest_sequence_dominates():
    lens = [64] * 31 + [16384]
    assert _plan(lens).num_chunks > 1


@pytest.mark.parametrize("lens", [[0], [1], [0, 0], [5, 300000], [17] * 1000])
def test_plan_is_valid_and_covers_every_token(lens):
    plan = _plan(lens)
    assert plan.num_chunks >= 1 and plan.chunk_size >= 1
    assert plan.chunk_size * plan.num_chunks >= max(lens)
    assert plan == _plan(lens)  # same numbers, same plan


def test_plan_follows_the_number_of_multiprocessors():
    lens = STANDARD["B8_L32768"]
    assert _plan(lens, num_sms=264).num_chunks > _plan(lens, num_sms=66).num_chunks


def test_plan_cuts_a_ragged_batch_finer_than_a_uniform_one():
    uniform = _plan([8192] * 32)
    ragged = _plan([16384] + [7936] * 31)  # about the same total, one long sequence
    assert ragged.chunk_size < uniform.chunk_size


MERGE_MUTATIONS = [  # planted mistakes in merge_heads, each must make a multi-step merge wrong
    ("running sum not rescaled", "total = total * alpha + tl.sum(w, axis=1)",
     "total = total + tl.sum(w, axis=1)"),
    ("partials not rescaled", "acc = acc * alpha[:, None] + ", "acc = acc + "),
    ("chunks past the sequence merged", "(c0 + offs_c < used)[None, :]",
     "(c0 + offs_c < num_chunks)[None, :]"),
]


def _multi_step_merge_error(module, fused: bool) -> float:
    """The relative error of a multi-step merge (CHUNKINGS[-1]) over stale partials, by
    ``module``'s split kernel. The keys of sequence 0's last 26 tokens (chunks 16-22) are
    scaled up, so every head's largest score comes in a late step of either merge (the merge
    kernel's second of two, the fused merge's fifth of six): the running max rises there and
    the sums so far must be rescaled, whatever numbers the generator of this device draws."""
    lens, bs, chunk, d, (hq, hkv), dtype = CHUNKINGS[-1]
    inp = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                            dtype=dtype, device=DEVICE, seed=5)
    row = inp.block_tables[0].tolist()
    for t in range(64, lens[0]):
        inp.k_cache[row[t // bs], t % bs] *= 3.0
    plan = module.SplitPlan(chunk, math.ceil(max(lens) / chunk), fused_merge=fused)
    scratch = module.SplitScratch.allocate(len(lens), hq, hkv, d, plan, DEVICE)
    scratch.part_out.fill_(3.0)  # stale partials from an earlier launch
    scratch.part_lse.fill_(1.0)
    out = module.paged_attention_split(*inp.args(), plan=plan, scratch=scratch,
                                       config=KernelConfig(tile=16))
    late = scratch.part_lse[0].argmax(1)  # (what the scaled keys are for)
    assert (late >= 16).all(), f"a head's largest chunk comes early: {late.tolist()}"
    return relative_error(out, inp.reference())


@pytest.mark.parametrize("fused", [False, True], ids=["merge kernel", "fused merge"])
@pytest.mark.parametrize("desc, old, new", MERGE_MUTATIONS, ids=[m[0] for m in MERGE_MUTATIONS])
def test_planted_mistakes_in_the_merge_are_caught(desc, old, new, fused, tmp_path, monkeypatch):
    from paged_ref.kernels.triton import split as triton_split

    tol = tolerance(torch.float32)
    right = _multi_step_merge_error(triton_split, fused)
    assert right <= tol, f"the real merge is off by {right:.3g} (tolerance {tol:.0e})"
    mutant = mutant_of(triton_split, [(old, new)], tmp_path, monkeypatch)
    wrong = _multi_step_merge_error(mutant, fused)
    assert wrong > 100 * tol, f"{desc}: survived (relative error {wrong:.3g})"
