"""Lesson 02's likely mistakes, planted into the solution: the exercise tests must catch each."""

from __future__ import annotations

import pytest

from tests.mutations.mutate import Mutation, assert_caught

NAME = "ex02_block_allocator"

MUTATIONS = [
    # 2.1 allocate
    Mutation("2.1 free set out of step: allocate leaves the block in _free_set",
             "        self._free_set.remove(block_id)\n", "", keyword="2_1"),
    Mutation("2.1 no empty check: popleft on an empty deque raises IndexError",
             "if not self._free_list:", "if False:", keyword="2_1"),
    # 2.2 free
    Mutation("2.2 no range check: free(-1) or free(num_blocks) is accepted",
             "if not 0 <= block_id < self.num_blocks:", "if False:", keyword="2_2"),
    Mutation("2.2 off-by-one range check: free(num_blocks) is accepted",
             "if not 0 <= block_id < self.num_blocks:", "if not 0 <= block_id <= self.num_blocks:",
             keyword="2_2"),
    Mutation("2.2 no double-free check",
             "if block_id in self._free_set:", "if False:", keyword="2_2"),
    Mutation("2.2 free set out of step: free forgets _free_set.add",
             "        self._free_set.add(block_id)\n", "", keyword="2_2"),
    # 2.3 blocks_needed
    Mutation("2.3 floor instead of ceiling",
             "return (num_tokens + block_size - 1) // block_size",
             "return num_tokens // block_size", keyword="2_3"),
    Mutation("2.3 one block too many when the length is a multiple of block_size",
             "return (num_tokens + block_size - 1) // block_size",
             "return num_tokens // block_size + 1", keyword="2_3"),
    Mutation("2.3 ceiling through a float (wrong for huge numbers)",
             "return (num_tokens + block_size - 1) // block_size",
             "return __import__('math').ceil(num_tokens / block_size)", keyword="2_3"),
    # 2.4 append_slot
    Mutation("2.4 off-by-one at the block boundary: a new block one token early",
             "if seq_len % block_size == 0:", "if (seq_len + 1) % block_size == 0:",
             keyword="2_4"),
    Mutation("2.4 a new block only after the first (the empty sequence gets none)",
             "if seq_len % block_size == 0:", "if seq_len % block_size == 0 and seq_len:",
             keyword="2_4"),
    Mutation("2.4 the slot ignores the block table (logical position)",
             "return block_table[seq_len // block_size] * block_size + seq_len % block_size",
             "return seq_len", keyword="2_4"),
    Mutation("2.4 a new block on every call",
             "    if seq_len % block_size == 0:\n        block_table.append(allocator.allocate())",
             "    block_table.append(allocator.allocate())", keyword="2_4"),
    # 2.5 slot_mapping
    Mutation("2.5 block id not multiplied by block_size",
             "[block_table[p // block_size] * block_size + p % block_size for p in positions]",
             "[block_table[p // block_size] + p % block_size for p in positions]",
             keyword="2_5"),
    Mutation("2.5 // and % swapped",
             "[block_table[p // block_size] * block_size + p % block_size for p in positions]",
             "[block_table[p % block_size] * block_size + p // block_size for p in positions]",
             keyword="2_5"),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=str)
def test_mutation_is_caught(mutation, tmp_path):
    assert_caught(NAME, mutation, tmp_path)
