"""Checks for lesson 05's exercises (split-KV decode), on fresh random paged inputs.

Run against the worked solutions (default) or your file:
``pytest tests/exercises/test_ex05_split_kv.py --impl exercises``.
In the notebook: ``course.check("ex05_split_kv", keyword="merge_partials")``.

Sizes are tiny: on a CPU the Triton kernels run in Triton's interpreter.
"""

from __future__ import annotations

import math

import pytest
import torch

from paged_ref import _device
from paged_course.checks import assert_close, assert_equal
from paged_course.testing import make_paged_inputs
from paged_ref.reference import token_slots
from tests.conftest import load_exercise

DEVICE = _device.triton_device()


@pytest.fixture
def ex(request):
    return load_exercise(request.config, "ex05_split_kv")


def _chunk_results(scores: torch.Tensor, values: torch.Tensor, bounds: list[int]):
    """float64 per-chunk results of one row of scores [n] and values [n, D]: (outs [C, D],
    lses [C], natural log); empty chunks get NaN outputs and -inf lses."""
    outs, lses = [], []
    for lo, hi in zip(bounds[:-1], bounds[1:], strict=True):
        if hi > lo:
            outs.append(torch.softmax(scores[lo:hi], 0) @ values[lo:hi])
            lses.append(torch.logsumexp(scores[lo:hi], 0))
        else:
            outs.append(torch.full(values.shape[1:], math.nan, dtype=torch.float64))
            lses.append(torch.tensor(-math.inf, dtype=torch.float64))
    return torch.stack(outs), torch.stack(lses)


def _expected_partials(inp, chunk_size: int, num_chunks: int, scale: float):
    """float64 (part_out [B, Hq, C, D], part_lse [B, Hq, C], used [B, C] bool)."""
    batch, num_q_heads, head_dim = inp.q.shape
    block_size, num_kv_heads = inp.k_cache.shape[1], inp.k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    k_flat = inp.k_cache.detach().cpu().double().flatten(0, 1)
    v_flat = inp.v_cache.detach().cpu().double().flatten(0, 1)
    q = inp.q.detach().cpu().double()
    part_out = torch.full((batch, num_q_heads, num_chunks, head_dim), math.nan, dtype=torch.float64)
    part_lse = torch.full((batch, num_q_heads, num_chunks), -math.inf, dtype=torch.float64)
    used = torch.zeros(batch, num_chunks, dtype=torch.bool)
    for b, n in enumerate(inp.seq_lens.tolist()):
        slots = torch.tensor(token_slots(inp.block_tables[b].tolist(), n, block_size),
                             dtype=torch.long)
        bounds = [min(c * chunk_size, n) for c in range(num_chunks + 1)]
        used[b] = torch.tensor([hi > lo for lo, hi in zip(bounds[:-1], bounds[1:], strict=True)])
        for h in range(num_q_heads):
            k = k_flat[slots, h // group]
            v = v_flat[slots, h // group]
            outs, lses = _chunk_results(k @ q[b, h] * scale, v, bounds)
            part_out[b, h], part_lse[b, h] = outs, lses
    return part_out, part_lse, used


# ---- Exercise 5.1: merge_partials (plain torch) ----------------------------------------------


def test_merge_partials_docstring_example(ex):
    outs = torch.tensor([[2.0], [7.0]])
    lses = torch.tensor([math.log(2.0), math.log(2.0)])
    out, lse = ex.merge_partials(outs, lses)
    assert_close(out, torch.tensor([4.5], dtype=torch.float64), name="out")
    assert_close(lse, torch.tensor(math.log(4.0), dtype=torch.float64), name="lse")


@pytest.mark.parametrize(
    "n, bounds",
    [(37, [0, 16, 32, 37]), (50, [0, 1, 2, 50]), (20, [0, 7, 20, 20, 20]), (5, [0, 5])],
    ids=["three_chunks", "tiny_chunks", "empty_tail", "one_chunk"],
)
def test_merge_partials_equals_attention_over_the_whole_sequence(ex, n, bounds):
    gen = torch.Generator().manual_seed(n + len(bounds))
    rows, d = 6, 8  # e.g. 2 sequences x 3 heads
    scores = torch.randn(rows, n, generator=gen, dtype=torch.float64) * 3
    values = torch.randn(rows, n, d, generator=gen, dtype=torch.float64)
    parts = [_chunk_results(scores[r], values[r], bounds) for r in range(rows)]
    outs = torch.stack([p[0] for p in parts], dim=1).view(len(bounds) - 1, 2, 3, d)
    lses = torch.stack([p[1] for p in parts], dim=1).view(len(bounds) - 1, 2, 3)
    out, lse = ex.merge_partials(outs, lses)
    whole = torch.einsum("rn,rnd->rd", torch.softmax(scores, -1), values).view(2, 3, d)
    assert_close(out, whole, name="merged output vs attention over the whole sequence")
    assert_close(lse, torch.logsumexp(scores, -1).view(2, 3), name="merged lse")


def test_merge_partials_float32_large_lse(ex):
    """Long sequences with large scores have lse in the hundreds: exp(lse) alone overflows."""
    gen = torch.Generator().manual_seed(51)
    lses = 800 + 50 * torch.rand(4, 3, generator=gen)
    outs = torch.randn(4, 3, 16, generator=gen)
    out, lse = ex.merge_partials(outs, lses)
    assert out.dtype == torch.float32, f"output dtype {out.dtype}, expected float32"
    w = torch.softmax(lses.double(), dim=0)
    assert_close(out, (w[..., None] * outs.double()).sum(0), name="merged output")
    assert_close(lse, torch.logsumexp(lses.double(), 0), name="merged lse")


def test_merge_partials_empty_chunks_are_ignored(ex):
    """Empty chunks have lse -inf and garbage (NaN) outputs; a row with no chunk gives zeros."""
    gen = torch.Generator().manual_seed(52)
    lses = torch.randn(3, 4, generator=gen)
    outs = torch.randn(3, 4, 8, generator=gen)
    lses[1, 0] = lses[0, 2] = -math.inf
    lses[:, 3] = -math.inf  # row 3: every chunk empty
    outs[lses == -math.inf] = math.nan
    out, lse = ex.merge_partials(outs, lses)
    assert not out.isnan().any(), f"NaN in the output at {out.isnan().nonzero()[:3].tolist()}"
    assert_equal(out[3], torch.zeros(8), name="row whose chunks are all empty")
    assert lse[3].item() == -math.inf, f"lse of a row with no tokens: expected -inf, got {lse[3]}"
    w = torch.softmax(lses[:, :3].double(), dim=0)
    expected = (w[..., None] * torch.nan_to_num(outs[:, :3].double())).sum(0)
    assert_close(out[:3], expected, name="merged output")


def test_merge_partials_merges_again(ex):
    """The merged (out, lse) is a partial result too: merging in two rounds gives the same."""
    gen = torch.Generator().manual_seed(53)
    lses = torch.randn(6, 5, generator=gen, dtype=torch.float64) * 4
    outs = torch.randn(6, 5, 16, generator=gen, dtype=torch.float64)
    once, _ = ex.merge_partials(outs, lses)
    left, right = ex.merge_partials(outs[:2], lses[:2]), ex.merge_partials(outs[2:], lses[2:])
    twice, _ = ex.merge_partials(torch.stack([left[0], right[0]]), torch.stack([left[1], right[1]]))
    assert_close(twice, once, name="merge of two merges vs one merge")


# ---- Exercise 5.2: attend_chunk (lesson 04's loop on one chunk) -------------------------------


def _expected_state(inp, b, kv_head, start, end, scale):
    """float64 (m [G], lse [G], out [G, D]) of tokens [start, end) of sequence b."""
    block_size, num_kv_heads = inp.k_cache.shape[1], inp.k_cache.shape[2]
    group = inp.q.shape[1] // num_kv_heads
    slots = torch.tensor(token_slots(inp.block_tables[b].tolist(), end, block_size, start),
                         dtype=torch.long)
    k = inp.k_cache.detach().cpu().double().flatten(0, 1)[slots, kv_head]  # [n, D]
    v = inp.v_cache.detach().cpu().double().flatten(0, 1)[slots, kv_head]
    q = inp.q.detach().cpu().double()[b, kv_head * group:(kv_head + 1) * group]  # [G, D]
    scores = q @ k.T * scale  # [G, n]
    return scores.max(dim=1).values, torch.logsumexp(scores, 1), torch.softmax(scores, 1) @ v


@pytest.mark.parametrize(
    "seq_lens, hq, hkv, block_size, dtype, b, kv_head, start, end",
    [([100, 37], 8, 2, 16, torch.float32, 0, 1, 40, 80),    # inside the sequence: tokens
     ([100, 37], 8, 2, 16, torch.float32, 1, 0, 24, 37),    # on both sides are real
     ([70, 9], 4, 4, 4, torch.float16, 0, 3, 5, 62),        # 4 tiles of 16, MHA
     ([50], 8, 1, 8, torch.bfloat16, 0, 0, 0, 50)],         # the whole sequence, GQA 8
    ids=["middle_f32_gqa4", "tail_f32", "f16_mha_bs4", "whole_bf16_gqa8"],
)
def test_attend_chunk_matches_float64(ex, seq_lens, hq, hkv, block_size, dtype, b, kv_head,
                                      start, end):
    inp = make_paged_inputs(seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=32,
                            block_size=block_size, dtype=dtype, poison="nan", device=DEVICE,
                            seed=60 + start + end)
    scale = 32**-0.5
    m, l, acc = ex.chunk_state(*inp.args()[:4], b, kv_head, start, end, tile=16)
    want_m, want_lse, want_out = _expected_state(inp, b, kv_head, start, end, scale)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    got_m = m.cpu().double()
    assert (got_m - want_m).abs().max() < 1e-3 * (1 + want_m.abs().max()), (
        f"m should be the largest scaled score of tokens {start}..{end - 1}: expected "
        f"{want_m.tolist()}, got {got_m.tolist()}"
    )
    assert_close(acc.cpu() / l.cpu()[:, None], want_out, rel_tol=tol,
                 name=f"acc / l (the attention output over tokens {start}..{end - 1})")
    got_lse = got_m + torch.log(l.cpu().double())
    assert (got_lse - want_lse).abs().max() < 1e-3 * (1 + want_lse.abs().max()), (
        f"m + log(l) should be the log-sum-exp of the chunk's scores: expected "
        f"{want_lse.tolist()}, got {got_lse.tolist()}"
    )


# ---- Exercise 5.3: partial_attention_kernel (stage 1) ----------------------------------------

STAGE1_CASES = [
    # seq_lens, chunk_size, num_chunks, hq, hkv, block_size, dtype, poison
    ([0, 1, 37, 100], 24, 5, 8, 2, 16, torch.float32, "nan"),  # chunk not a multiple of 16
    ([9, 3], 64, 2, 4, 4, 8, torch.float16, "large"),  # shorter than one chunk; chunk 1 empty
    ([70, 16, 33], 16, 6, 8, 1, 4, torch.float32, "large"),  # GQA 8, chunk = 4 blocks
]
STAGE1_IDS = ["gqa4_f32_chunk24_nan", "mha_f16_short", "gqa8_bs4_chunk16"]


@pytest.mark.parametrize("seq_lens, chunk_size, num_chunks, hq, hkv, block_size, dtype, poison",
                         STAGE1_CASES, ids=STAGE1_IDS)
def test_partial_attention_kernel_matches_float64(ex, seq_lens, chunk_size, num_chunks, hq, hkv,
                                                   block_size, dtype, poison):
    inp = make_paged_inputs(seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=32,
                            block_size=block_size, dtype=dtype, poison=poison, device=DEVICE,
                            seed=sum(seq_lens) + chunk_size)
    scale = 32**-0.5
    part_out, part_lse = ex.launch_partials(*inp.args(), chunk_size=chunk_size,
                                            num_chunks=num_chunks)
    exp_out, exp_lse, used = _expected_partials(inp, chunk_size, num_chunks, scale)
    mask = used[:, None, :].expand(-1, hq, -1)  # [B, Hq, C] chunks that hold tokens
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close(part_out.cpu()[mask], exp_out[mask], rel_tol=tol,
                 name="part_out of the chunks that hold tokens (flattened)")
    # lse: an absolute check (a relative one is meaningless near 0).
    got_lse, want_lse = part_lse.cpu().double()[mask], exp_lse[mask]
    worst = (got_lse - want_lse).abs().max().item()
    assert worst < 1e-3 * (1 + want_lse.abs().max().item()), (
        f"part_lse off by up to {worst:.3e}; first chunks: expected "
        f"{want_lse[:4].tolist()}, got {got_lse[:4].tolist()}"
    )


def test_partial_attention_kernel_skips_empty_chunks(ex):
    """Chunks past a sequence's end write nothing (the sentinel stays)."""
    inp = make_paged_inputs([5, 0, 40], num_q_heads=4, num_kv_heads=2, head_dim=16,
                            block_size=8, device=DEVICE, seed=54)
    sentinel = 12345.0
    buffers = (torch.full((3, 4, 4, 16), sentinel, device=DEVICE),
               torch.full((3, 4, 4), sentinel, device=DEVICE))
    part_out, part_lse = ex.launch_partials(*inp.args(), chunk_size=16, num_chunks=4,
                                            buffers=buffers)
    _, _, used = _expected_partials(inp, 16, 4, 0.25)
    untouched = (part_lse.cpu() == sentinel).all(dim=1)  # [B, C]
    assert_equal(untouched, ~used, name="chunks left untouched (True = no tokens)")
    assert (part_out.cpu()[~used[:, None, :].expand(-1, 4, -1)] == sentinel).all(), (
        "part_out of a chunk with no tokens was written"
    )


# ---- Exercise 5.4: merge_chunks_kernel (stage 2) ---------------------------------------------


def _random_partials(seq_lens, chunk_size, num_chunks, hq, d, seed, lse_offset=0.0):
    """float32 partials with NaN in every chunk that holds no tokens, and the float64 merge."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(seq_lens)
    part_out = torch.randn(batch, hq, num_chunks, d, generator=gen)
    part_lse = lse_offset + 8 * torch.rand(batch, hq, num_chunks, generator=gen)
    used = torch.tensor([[c * chunk_size < n for c in range(num_chunks)] for n in seq_lens])
    mask = used[:, None, :].expand(-1, hq, -1)
    part_out[~mask] = math.nan
    part_lse[~mask] = math.nan
    w = torch.where(mask, torch.exp(part_lse.double() - lse_offset), 0.0)
    total = w.sum(-1, keepdim=True)
    merged = (w[..., None] * torch.nan_to_num(part_out.double())).sum(-2)
    merged = merged / torch.where(total > 0, total, 1.0)
    return part_out, part_lse, merged


@pytest.mark.parametrize(
    "seq_lens, chunk_size, num_chunks, dtype, lse_offset",
    [([100, 0, 7, 64], 16, 7, torch.float32, 0.0),
     ([1, 300], 10, 30, torch.float32, 0.0),
     ([50, 20], 32, 2, torch.float16, 500.0)],
    ids=["ragged_with_empty", "many_chunks", "f16_large_lse"],
)
def test_merge_chunks_kernel_matches_float64(ex, seq_lens, chunk_size, num_chunks, dtype,
                                             lse_offset):
    part_out, part_lse, expected = _random_partials(seq_lens, chunk_size, num_chunks, 4, 32,
                                                    seed=55 + num_chunks, lse_offset=lse_offset)
    lens = torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE)
    out = ex.launch_merge(part_out.to(DEVICE), part_lse.to(DEVICE), lens,
                          chunk_size=chunk_size, dtype=dtype)
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected {dtype}"
    assert_close(out, expected, name="merged output")
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert_equal(out[b].cpu(), torch.zeros_like(out[b].cpu()),
                         name=f"sequence {b} (length 0)")


# ---- given: split_kv_decode = 5.3 + 5.4, against the float64 reference ------------------------


@pytest.mark.parametrize(
    "seq_lens, chunk_size, hq, hkv, d, block_size, dtype, poison",
    [([0, 1, 37, 60], 24, 4, 1, 32, 16, torch.float32, "nan"),
     ([200, 13], 64, 4, 1, 64, 16, torch.float16, "large"),
     ([3, 5, 2], 48, 4, 2, 32, 4, torch.float32, "nan"),  # every sequence shorter than a chunk
     ([9, 30], 7, 2, 2, 16, 8, torch.bfloat16, "large")],  # 5 chunks of 7 to merge
    ids=["gqa4_f32_ragged", "gqa4_d64_f16", "shorter_than_a_chunk", "mha_bf16_chunk7"],
)
def test_split_kv_decode_matches_reference(ex, seq_lens, chunk_size, hq, hkv, d, block_size,
                                           dtype, poison):
    inp = make_paged_inputs(seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                            block_size=block_size, dtype=dtype, poison=poison, device=DEVICE,
                            seed=56 + chunk_size)
    out = ex.split_kv_decode(*inp.args(), chunk_size=chunk_size)
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected {dtype}"
    assert_close(out, inp.reference(), name=f"split_kv_decode output (chunk_size {chunk_size})")


def test_split_kv_decode_uses_the_scale(ex):
    inp = make_paged_inputs([33, 8], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8,
                            device=DEVICE, seed=57)
    out = ex.split_kv_decode(*inp.args(), chunk_size=16, scale=0.3)
    assert_close(out, inp.reference(scale=0.3), name="split_kv_decode output with scale 0.3")
