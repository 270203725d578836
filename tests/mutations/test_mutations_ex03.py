"""Lesson 03's likely mistakes, planted into the solution: the exercise tests must catch each."""

from __future__ import annotations

import pytest

from tests.mutations.mutate import Mutation, assert_caught

NAME = "ex03_gather_attention"

MUTATIONS = [
    # 3.1 padded_slots
    Mutation("3.1 missed int64 cast: the slot is computed in int32 (overflows)",
             "block = block_tables.long()[:, pos // block_size]",
             "block = block_tables[:, pos // block_size]", keyword="padded_slots"),
    Mutation("3.1 int64 cast after the multiplication (the int32 product has wrapped already)",
             ("block = block_tables.long()[:, pos // block_size]", "return slots, valid"),
             ("block = block_tables[:, pos // block_size]", "return slots.long(), valid"),
             keyword="padded_slots"),
    Mutation("3.1 garbage table entries turn into slots (no masking of invalid positions)",
             ("    block = torch.where(valid, block, 0)\n",
              "slots = torch.where(valid, block * block_size + pos % block_size, 0)"),
             ("", "slots = block * block_size + pos % block_size"), keyword="padded_slots"),
    Mutation("3.1 off-by-one: position seq_len counted as valid",
             "valid = pos[None, :] < seq_lens.long()[:, None]",
             "valid = pos[None, :] <= seq_lens.long()[:, None]", keyword="padded_slots"),
    Mutation("3.1 // and % swapped (column and offset)",
             ("[:, pos // block_size]", "block * block_size + pos % block_size"),
             ("[:, pos % block_size]", "block * block_size + pos // block_size"),
             keyword="padded_slots"),
    # 3.2 gather_slots
    Mutation("3.2 v gathered from the K cache",
             "v = v_cache.flatten(0, 1)[slots]", "v = k_cache.flatten(0, 1)[slots]",
             keyword="gather_slots"),
    Mutation("3.2 slots used as block ids (forgot to flatten blocks into slots)",
             "k = k_cache.flatten(0, 1)[slots]",
             "k = k_cache[slots % k_cache.shape[0], 0]", keyword="gather_slots"),
    # 3.3 masked_attention
    Mutation("3.3 missed mask: padding scores take part in the softmax",
             'scores.masked_fill(~mask, float("-inf"))', "scores", keyword="masked_attention"),
    Mutation("3.3 NaN in padded v leaks through (0 * nan)",
             "v = torch.where(valid[:, :, None, None], v.float(), 0.0)", "v = v.float()",
             keyword="masked_attention"),
    Mutation("3.3 empty sequence gives NaN (softmax of an all -inf row)",
             "    probs = torch.where(mask.any(dim=-1, keepdim=True), probs, 0.0)", "",
             keyword="masked_attention"),
    Mutation("3.3 wrong GQA head mapping: query head h reads KV head h % Hkv",
             "qg = q.float().view(batch, num_kv_heads, group, head_dim)",
             "qg = q.float().view(batch, group, num_kv_heads, head_dim).transpose(1, 2)",
             keyword="masked_attention"),
    Mutation("3.3 scale forgotten",
             'torch.einsum("bhgd,bthd->bhgt", qg, k.float()) * scale',
             'torch.einsum("bhgd,bthd->bhgt", qg, k.float())', keyword="masked_attention"),
    Mutation("3.3 softmax over the wrong axis (heads instead of tokens)",
             'torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)',
             'torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-2)',
             keyword="masked_attention"),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=str)
def test_mutation_is_caught(mutation, tmp_path):
    assert_caught(NAME, mutation, tmp_path)
