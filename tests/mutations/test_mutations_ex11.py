"""Lesson 11's likely mistakes, planted into the solution: the exercise tests must catch each."""

from __future__ import annotations

import pytest

from tests.mutations.mutate import Mutation, assert_caught

MUTATIONS = [
    Mutation("pack swaps K and V", "torch.stack([k.index_select(0, idx), v.index_select(0, idx)])",
             "torch.stack([v.index_select(0, idx), k.index_select(0, idx)])", keyword="pack"),
    Mutation("pack sorts the block ids (loses the logical order)",
             "idx = torch.tensor(block_ids, dtype=torch.long, device=cache.device)\n"
             "    packed",
             "idx = torch.tensor(sorted(block_ids), dtype=torch.long, device=cache.device)\n"
             "    packed", keyword="pack"),
    Mutation("pack gathers one layer only",
             "for k, v in zip(cache.k_caches, cache.v_caches, strict=True)])",
             "for k, v in zip(cache.k_caches[:1], cache.v_caches[:1], strict=True)])",
             keyword="pack"),
    Mutation("unpack writes the sender's positions, not block_ids",
             "k.index_copy_(0, idx, packed[layer, 0])",
             "k.index_copy_(0, torch.arange(len(idx)), packed[layer, 0])", keyword="unpack"),
    Mutation("unpack forgets V", "        v.index_copy_(0, idx, packed[layer, 1])\n", "",
             keyword="unpack"),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=str)
def test_mutation_is_caught(mutation, tmp_path):
    assert_caught("ex11_transfer", mutation, tmp_path)
