"""The prefill + decode loop: paged decode equals contiguous decode token by token, the
manager takes blocks only as sequences cross block boundaries, and freeing returns them all."""

from __future__ import annotations

import pytest
import torch

from paged_course.decode_loop import (
    ContiguousDecoder,
    PagedDecoder,
    TinyAttentionLayer,
    dense_decode_attention,
    run_side_by_side,
)
from paged_ref.reference import contiguous_attention


@pytest.mark.parametrize(
    "prompt_lens, block_size, heads",
    [
        ([3, 9, 16], 4, (4, 2)),
        ([1, 7, 8, 15], 8, (8, 1)),
        ([5], 1, (4, 4)),
        ([16, 17, 2], 16, (8, 2)),
    ],
    ids=["bs4_gqa2", "bs8_gqa8", "bs1_mha", "bs16_gqa4"],
)
def test_paged_equals_contiguous_token_by_token(prompt_lens, block_size, heads):
    model = TinyAttentionLayer.random(hidden=48, num_q_heads=heads[0], num_kv_heads=heads[1],
                                      head_dim=16, seed=block_size)
    trace = run_side_by_side(model, prompt_lens, num_steps=14, block_size=block_size,
                             seed=len(prompt_lens))
    assert len(trace.max_diff) == 15  # prefill + 14 steps
    worst = max(trace.max_diff)
    assert worst < 1e-5, f"paged and contiguous decode differ by {worst:.2e}: {trace.max_diff}"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_half_precision_caches_agree(dtype):
    model = TinyAttentionLayer.random(seed=5)
    trace = run_side_by_side(model, [4, 11], num_steps=8, block_size=4, dtype=dtype)
    assert max(trace.max_diff) < 2e-2, trace.max_diff


def test_blocks_are_taken_exactly_at_block_boundaries():
    """One sequence of a 5-token prompt, block size 4: blocks are taken when its length
    goes 8 -> 9, 12 -> 13, ... (the new token starts a block), never in between."""
    block_size, prompt = 4, 5
    model = TinyAttentionLayer.random(seed=1)
    dec = PagedDecoder(model, num_blocks=10, block_size=block_size)
    x = dec.prefill([0], [model.random_prompt(prompt, seed=1)])
    assert dec.manager.num_free_blocks == 10 - 2
    free_before = dec.manager.num_free_blocks
    for length in range(prompt + 1, prompt + 20):
        x = dec.step([0], x)
        free = dec.manager.num_free_blocks
        starts_block = (length - 1) % block_size == 0
        assert free_before - free == int(starts_block), (
            f"length {length}: free blocks went {free_before} -> {free}"
        )
        assert len(dec.manager.block_table(0)) == -(-length // block_size)
        free_before = free


def test_free_counts_follow_lengths_and_freeing_returns_every_block():
    prompt_lens, block_size, steps = [1, 6, 8, 13], 4, 11
    trace = run_side_by_side(TinyAttentionLayer.random(seed=2), prompt_lens, steps,
                             block_size=block_size, num_blocks=40)
    for step, lens in enumerate(trace.seq_lens):
        assert lens == [n + step for n in prompt_lens]
        expected = 40 - sum(-(-n // block_size) for n in lens)
        assert trace.free_blocks[step] == expected, f"step {step}: lens {lens}"
    assert trace.free_after_finish == 40


def test_finishing_one_sequence_frees_its_blocks_and_others_continue():
    model = TinyAttentionLayer.random(seed=3)
    paged = PagedDecoder(model, num_blocks=12, block_size=4)
    dense = ContiguousDecoder(model)
    prompts = [model.random_prompt(n, seed=n) for n in (6, 3)]
    xp, xd = paged.prefill(["a", "b"], prompts), dense.prefill(["a", "b"], prompts)
    for _ in range(3):
        xp, xd = paged.step(["a", "b"], xp), dense.step(["a", "b"], xd)
    held_by_a = len(paged.manager.block_table("a"))
    free = paged.manager.num_free_blocks
    paged.free("a")
    assert paged.manager.num_free_blocks == free + held_by_a
    xp, xd = xp[1:], xd[1:]
    for _ in range(6):  # "b" keeps going, possibly reusing "a"'s blocks
        xp, xd = paged.step(["b"], xp), dense.step(["b"], xd)
        assert (xp - xd).abs().max() < 1e-5
    paged.free("b")
    assert paged.manager.num_free_blocks == 12


def test_dense_decode_attention_matches_reference_attention():
    """The contiguous twin's softmax agrees with paged_ref's contiguous_attention."""
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(8, 32, generator=gen)
    k, v = torch.randn(2, 19, 2, 32, generator=gen).unbind(0)
    ours = dense_decode_attention(q, k, v)
    ref = contiguous_attention(q[None], k[None], v[None], torch.ones(1, 19, dtype=torch.bool))
    torch.testing.assert_close(ours, ref[0])


def test_empty_prompt_is_rejected():
    model = TinyAttentionLayer.random(seed=0)
    dec = PagedDecoder(model, num_blocks=4, block_size=4)
    with pytest.raises(ValueError, match="empty"):
        dec.prefill([0], [torch.zeros(0, model.hidden)])
