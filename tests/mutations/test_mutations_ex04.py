"""Lesson 04's likely mistakes, planted into the solution: the exercise tests must catch each.

The Triton mutants run in the interpreter on a CPU, so each selects only the tests of its own
exercise (and the cheapest test that catches it first).
"""

from __future__ import annotations

import sys

import pytest

from paged_ref import _device
from tests.mutations.mutate import Mutation, assert_caught

NAME = "ex04_triton_paged_decode"

MUTATIONS = [
    # 4.1 online_softmax_update (torch)
    Mutation("4.1 no -inf guard: exp(-inf - -inf) = NaN on an all-masked first tile",
             'm_safe = torch.where(m_new == float("-inf"), 0.0, m_new)', "m_safe = m_new",
             keyword="online_update"),
    Mutation("4.1 acc not rescaled when the max grows",
             "acc_new = acc * alpha[:, None] + p @ v", "acc_new = acc + p @ v",
             keyword="online_update"),
    Mutation("4.1 l not rescaled when the max grows",
             "l_new = l * alpha + p.sum(dim=1)", "l_new = l + p.sum(dim=1)",
             keyword="online_update"),
    Mutation("4.1 the tile's max replaces the running max",
             "m_new = torch.maximum(m, scores.max(dim=1).values)",
             "m_new = scores.max(dim=1).values", keyword="online_update"),
    Mutation("4.1 rescale factor upside down: exp(m_new - m)",
             "alpha = torch.exp(m - m_safe)", "alpha = torch.exp(m_safe - m)",
             keyword="online_update"),
    Mutation("4.1 updates its arguments in place",
             "acc_new = acc * alpha[:, None] + p @ v",
             "acc_new = acc.mul_(alpha[:, None]).add_(p @ v)", keyword="online_update"),
    # 4.2 load_kv_tile
    pytest.param(
        Mutation("4.2 block-table load unmasked (reads past the table row)",
                 "tl.load(table_row_ptr + tok // BLOCK_SIZE, mask=t_mask, other=0)",
                 "tl.load(table_row_ptr + tok // BLOCK_SIZE)",
                 keyword="load_kv_tile_masks_the_block_table"),
        marks=pytest.mark.skipif(_device.triton_device() != "cpu" or sys.platform != "linux",
                                 reason="its check (a guard page) needs the CPU interpreter")),
    Mutation("4.2 missed int64 cast: block * stride_block in int32",
             "block.to(tl.int64) * stride_block", "block * stride_block",
             keyword="load_kv_tile_uses_64bit"),
    Mutation("4.2 row load not masked by tokens: masked rows hold cache data, not 0",
             "mask = t_mask[:, None] & d_mask[None, :]", "mask = d_mask[None, :]",
             keyword="load_kv_tile and not 64bit and not block_table"),
    Mutation("4.2 row load not masked by columns: padded columns read the next head",
             "mask = t_mask[:, None] & d_mask[None, :]", "mask = t_mask[:, None]",
             keyword="load_kv_tile and not 64bit and not block_table"),
    Mutation("4.2 // and % swapped: block id from the offset",
             ("table_row_ptr + tok // BLOCK_SIZE", "(tok % BLOCK_SIZE) * stride_tok"),
             ("table_row_ptr + tok % BLOCK_SIZE", "(tok // BLOCK_SIZE) * stride_tok"),
             keyword="load_kv_tile_docstring"),  # its small cache: wrong rows, no crash
    Mutation("4.2 KV head ignored",
             "            + kv_head * stride_head)", "            )",
             keyword="load_kv_tile and not 64bit and not block_table"),
    Mutation("4.2 logical block index used as the physical block (table ignored)",
             "block = tl.load(table_row_ptr + tok // BLOCK_SIZE, mask=t_mask, other=0)",
             "block = tok // BLOCK_SIZE", keyword="load_kv_tile and not 64bit and not block_table"),
    # 4.3 attend_sequence
    Mutation("4.3 missed mask: masked tokens score 0 instead of -inf",
             '        scores = tl.where(t_mask[None, :], scores, float("-inf"))'
             "  # [GROUP_PAD, TILE]\n", "", keyword="attend_sequence_matches and f32_gqa4"),
    Mutation("4.3 off-by-one mask: token seq_len is attended",
             "        t_mask = tok < seq_len\n        k = load_kv_tile",
             "        t_mask = tok <= seq_len\n        k = load_kv_tile",
             keyword="attend_sequence_uses_the_scale"),  # lengths 9, 40: token seq_len is poison
    Mutation("4.3 last partial tile skipped",
             "for t0 in range(0, seq_len, TILE):",
             "for t0 in range(0, seq_len // TILE * TILE, TILE):",
             keyword="attend_sequence_matches and f32_gqa4"),
    Mutation("4.3 acc not rescaled when the max grows",
             "acc = acc * alpha[:, None] + tl.dot(", "acc = acc + tl.dot(",
             keyword="attend_sequence_many_tiles"),
    Mutation("4.3 l not rescaled when the max grows",
             "l = l * alpha + tl.sum(p, axis=1)", "l = l + tl.sum(p, axis=1)",
             keyword="attend_sequence_many_tiles"),
    Mutation("4.3 empty sequence gives NaN (0 / 0)",
             "return acc / tl.where(l > 0, l, 1.0)[:, None]", "return acc / l[:, None]",
             keyword="attend_sequence_empty"),
    Mutation("4.3 scale forgotten",
             "scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale",
             "scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)",
             keyword="attend_sequence_uses_the_scale"),
    Mutation("4.3 output not normalised (acc returned without dividing by l)",
             "return acc / tl.where(l > 0, l, 1.0)[:, None]", "return acc",
             keyword="attend_sequence_matches and f32_gqa4"),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=str)
def test_mutation_is_caught(mutation, tmp_path):
    assert_caught(NAME, mutation, tmp_path)
