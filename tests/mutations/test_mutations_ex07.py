"""Lesson 07's likely mistakes, planted into the solution: the exercise tests must catch each."""

from __future__ import annotations

import pytest

from tests.mutations.mutate import Mutation, assert_caught

NAME = "ex07_sharing"

MUTATIONS = [
    Mutation("7.1 fork copies the table but not the holds (no ref count +1)",
             "        for block_id in table:\n            self.share(block_id)\n", "",
             keyword="7_1"),
    Mutation("7.1 fork shares the parent's list object",
             "self.tables[child] = list(table)", "self.tables[child] = table", keyword="7_1"),
    Mutation("7.2 counting evictable blocks twice: a released cached block also goes to "
             "free_list",
             "                self.evictable[block_id] = None\n            else:\n"
             "                self.free_list.append(block_id)",
             "                self.evictable[block_id] = None\n"
             "            self.free_list.append(block_id)", keyword="7_2"),
    Mutation("7.3 free_sequence frees blocks a fork still holds",
             "        for block_id in reversed(self.tables.pop(seq_id)):\n"
             "            self.release(block_id)",
             "        for block_id in reversed(self.tables.pop(seq_id)):\n"
             "            self.ref_counts[block_id] = 1\n            self.release(block_id)",
             keyword="7_3"),
    Mutation("7.4 writing into a shared block (no copy-on-write)",
             "elif self.ref_counts[table[-1]] > 1:", "elif False:", keyword="7_4"),
    Mutation("7.4 copy-on-write forgets to record the copy",
             "            self.copies.append((table[-1], fresh))\n", "", keyword="7_4"),
    Mutation("7.4 copy-on-write keeps the hold on the old block",
             "            self.release(table[-1])\n            table[-1] = fresh",
             "            table[-1] = fresh", keyword="7_4"),
    Mutation("7.5 hashing without the parent",
             'h.update(b"root" if parent_hash is None else parent_hash)', 'h.update(b"root")',
             keyword="7_5"),
    Mutation("7.6 lookup keeps going after a miss",
             "            if h not in self.block_of:\n                break\n"
             "            found.append(self.block_of[h])",
             "            if h in self.block_of:\n                found.append(self.block_of[h])",
             keyword="7_6"),
    Mutation("7.6 lookup may cover the whole prompt (no token left to compute)",
             "for j in range((len(token_ids) - 1) // bs):",
             "for j in range(len(token_ids) // bs):", keyword="7_6"),
    Mutation("7.8 evicting a held block: share leaves a revived block on the evictable list",
             "            del self.evictable[block_id]\n", "            pass\n", keyword="7_8"),
    Mutation("7.7 evicting before using free blocks",
             "        if self.free_list:\n            block_id = self.free_list.popleft()\n"
             "        elif self.evictable:",
             "        if self.evictable and False:\n            pass\n"
             "        elif self.evictable:\n            block_id, _ = "
             "self.evictable.popitem(last=False)\n            "
             "del self.block_of[self.hash_of.pop(block_id)]\n        elif self.free_list:\n"
             "            block_id = self.free_list.popleft()\n        elif False:",
             keyword="7_7"),
    Mutation("7.7 evicting the most recently used block",
             "self.evictable.popitem(last=False)", "self.evictable.popitem(last=True)",
             keyword="7_7"),
    Mutation("7.7 an evicted block keeps its hash (a later prompt would find stale K/V)",
             "            del self.block_of[self.hash_of.pop(block_id)]\n", "",
             keyword="7_7"),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=str)
def test_mutation_is_caught(mutation, tmp_path):
    assert_caught(NAME, mutation, tmp_path)
