"""``KVCacheManager.lookahead`` / ``extend``: blocks taken ahead of tokens whose ids come later
(multi-step decoding), all or nothing, and the same tables and prefix-cache entries as one
``append_slot`` per token."""

from __future__ import annotations

import pytest

from paged_ref.cache_math import token_slots
from paged_ref.memory.allocator import OutOfBlocksError
from paged_ref.memory.manager import KVCacheManager


def one_by_one(tokens_after: dict, prompt: dict, **kw) -> KVCacheManager:
    m = KVCacheManager(16, 4, enable_prefix_caching=True, **kw)
    for s, p in prompt.items():
        m.add_sequence(s, token_ids=p)
    for s, tokens in tokens_after.items():
        for t in tokens:
            m.append_slot(s, t)
    return m


@pytest.mark.parametrize("start", [5, 8, 3])
def test_lookahead_then_extend_is_append_slot_per_token(start):
    prompt = {"a": list(range(10, 10 + start)), "b": list(range(50, 57))}
    after = {"a": [90, 91, 92, 93, 94, 95, 96], "b": [70, 71, 72]}
    want = one_by_one(after, prompt)
    m = one_by_one({}, prompt)
    for s, tokens in after.items():
        m.append_slot(s, tokens[0])
    free, short = m.num_free_blocks, sum(len(want.block_table(s)) - len(m.block_table(s))
                                         for s in after)
    m.lookahead(["a", "b"], [len(after["a"]) - 1, len(after["b"]) - 1])
    taken = free - m.num_free_blocks
    assert taken == short > 0
    assert [m.seq_len(s) for s in after] == [len(prompt[s]) + 1 for s in after]
    tables = {s: m.block_table(s) for s in after}
    for s, tokens in after.items():
        m.extend(s, tokens[1:])
    assert m.num_free_blocks == free - taken, "extend took a block"
    for s in after:
        assert m.block_table(s) == tables[s] and m.seq_len(s) == want.seq_len(s)
        assert len(m.block_table(s)) == len(want.block_table(s))
        assert m.slot_mapping(s) == token_slots(tables[s], m.seq_len(s), 4)
    entries = sorted((e.block_hash, e.token_ids) for e in m.cached_blocks())
    assert entries == sorted((e.block_hash, e.token_ids) for e in want.cached_blocks())
    assert len(entries) > 3
    # append_slot into a lookahead block takes none either; freeing returns them all
    m.lookahead(["a"], [3])
    free = m.num_free_blocks
    m.append_slot("a", 97)
    assert m.num_free_blocks == free
    for s in after:
        m.free_sequence(s)
    assert m.num_free_blocks == m.num_blocks


def test_lookahead_is_all_or_nothing():
    m = KVCacheManager(6, 4)
    m.add_sequence("a", 4)
    m.add_sequence("b", 4)  # 4 blocks free
    with pytest.raises(OutOfBlocksError, match="lookahead needs 6 new blocks"):
        m.lookahead(["a", "b"], [9, 12])  # 3 + 3 blocks
    assert m.num_free_blocks == 4 and m.block_table("a") == [0] and m.block_table("b") == [1]
    m.lookahead(["a", "b"], [8, 4])
    assert m.num_free_blocks == 1 and len(m.block_table("a")) == 3


def test_lookahead_refuses_bad_calls_and_changes_nothing():
    m = KVCacheManager(8, 4, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1, 2, 3, 4, 5, 6])
    m.fork("a", "b")  # (their last block is shared: the next write must copy it first)
    cases = [(["a"], [2], ValueError, "shared"), (["z"], [1], ValueError, "unknown"),
             (["a", "a"], [1, 1], ValueError, "distinct"), (["a"], [1, 2], ValueError, "one "),
             (["a"], [-1], ValueError, "num_tokens"), (["a"], [1.5], TypeError, "num_tokens")]
    for ids, counts, exc, match in cases:
        with pytest.raises(exc, match=match):
            m.lookahead(ids, counts)
        assert m.num_free_blocks == 6 and m.block_table("a") == m.block_table("b") == [0, 1]
    m.append_slot("a", 7)  # (copies on write: a's block its own)
    m.lookahead(["a"], [5])
    with pytest.raises(ValueError, match="need 1 more"):
        m.extend("a", [8, 9, 10, 11, 12, 13])  # one past what was taken
    with pytest.raises(ValueError):
        m.extend("a", [8, -1])
    assert m.seq_len("a") == 7
    m.extend("a", [8, 9, 10, 11, 12])
    assert m.seq_len("a") == 12
