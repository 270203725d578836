"""Sharing blocks: reference counts, fork, copy-on-write, prefix caching, eviction."""

from __future__ import annotations

import pytest
import torch

from paged_ref import KVCacheManager, OutOfBlocksError, PagedKVCache
from paged_ref.memory.manager import hash_block_tokens


def snapshot(m: KVCacheManager):
    """Everything observable about a manager's state, sharing and cache included."""
    a = m.allocator
    return (
        m.num_free_blocks,
        [(a.ref_count(b), a.is_evictable(b), a.block_hash(b)) for b in range(m.num_blocks)],
        a.evictable_blocks(),
        {s: (m.block_table(s), m.seq_len(s)) for s in m.seq_ids},
        m.stats(),
        list(m._copies), list(m._pinned),
        None if m._host is None else (
            m._host.hashes(), m._host.num_free_slots,
            [[(s if isinstance(s, int) else id(s), d) for s, d in moves]  # (a read block: its id)
             for moves in m._host._moves()]),
        None if m._host is None or m._host.disk is None else (
            m._host.disk.hashes(), m._host.disk.num_free_blocks),
    )


# ---- reference counts and fork -----------------------------------------------------------


def test_fork_shares_every_block_and_free_drops_one_reference():
    m = KVCacheManager(8, 4)
    assert m.add_sequence("p", 6) == 0
    m.fork("p", "c")
    assert m.block_table("c") == m.block_table("p") == [0, 1]
    assert m.seq_len("c") == 6
    assert [m.ref_count(b) for b in range(3)] == [2, 2, 0]
    assert m.num_free_blocks == 6  # nothing new was taken
    st = m.stats()
    assert (st.blocks_used, st.blocks_shared, st.tokens_stored, st.slots_reserved_empty) == (
        2, 2, 12, 2)
    m.free_sequence("p")
    assert [m.ref_count(b) for b in range(2)] == [1, 1] and m.num_free_blocks == 6
    m.free_sequence("c")
    assert m.num_free_blocks == 8 and m.ref_count(0) == 0


def test_copy_on_write_gives_the_writer_a_fresh_block_and_records_the_copy():
    m = KVCacheManager(8, 4)
    m.add_sequence("p", 6)  # blocks [0, 1], block 1 holds 2 tokens
    m.fork("p", "c")
    slot = m.append_slot("c")  # c writes token 6 into the shared block 1 -> copy to block 2
    assert m.block_table("c") == [0, 2] and slot == 2 * 4 + 2
    assert m.take_copies() == [(1, 2)]
    assert m.take_copies() == []  # handed over once
    assert (m.ref_count(1), m.ref_count(2), m.ref_count(0)) == (1, 1, 2)
    assert m.append_slot("p") == 1 * 4 + 2  # p is now the only holder: writes in place
    assert m.take_copies() == []


def test_full_shared_block_needs_no_copy():
    m = KVCacheManager(8, 4)
    m.add_sequence("p", 8)
    m.fork("p", "c")
    assert m.append_slot("c") == 2 * 4  # new block at the boundary, nothing copied
    assert m.take_copies() == [] and m.block_table("c") == [0, 1, 2]


def test_decode_step_counts_copy_on_writes_exactly():
    m = KVCacheManager(4, 4)
    m.add_sequence("p", 2)  # block 0
    m.fork("p", "a")
    m.fork("p", "b")  # block 0 held 3 times; 3 blocks free
    assert m.append_slots(["p", "a", "b"]) == [1 * 4 + 2, 2 * 4 + 2, 0 * 4 + 2]
    assert m.take_copies() == [(0, 1), (0, 2)]  # the last holder (b) writes in place
    assert m.num_free_blocks == 1
    m.fork("b", "d")  # block 0 shared by b and d
    before = snapshot(m)
    m.fork("a", "e")  # block 2 shared by a and e
    m.free_sequence("e")
    assert snapshot(m) == before
    m.fork("a", "e")
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError, match="needs 2 new blocks but only 1"):
        m.append_slots(["b", "d", "a", "e"])  # copies: min(2, 1) + min(2, 1) = 2
    assert snapshot(m) == before


def test_pending_copy_into_a_freed_block_is_dropped():
    m = KVCacheManager(4, 4)
    m.add_sequence("p", 1)
    m.fork("p", "c")
    m.append_slot("c")
    m.free_sequence("c")
    assert m.take_copies() == []


@pytest.mark.parametrize("call, error, text", [
    (lambda m: m.fork("ghost", "x"), ValueError, "unknown sequence 'ghost'"),
    (lambda m: m.fork("p", "p"), ValueError, "sequence 'p' already exists"),
    (lambda m: m.fork("p", ["x"]), TypeError, "child_id must be hashable"),
    (lambda m: m.append_slot("p", -1), ValueError, "token_id must be >= 0"),
    (lambda m: m.append_slot("p", 1.5), TypeError, "token_id must be an int"),
    (lambda m: m.append_slot("ghost", 1), ValueError, "unknown sequence 'ghost'"),
    (lambda m: m.free_sequence("ghost"), ValueError, "unknown sequence 'ghost'"),
    (lambda m: m.ref_count(99), ValueError, "unknown block_id 99"),
    (lambda m: m.add_sequence("x", token_ids=[]), ValueError, "token_ids must not be empty"),
    (lambda m: m.add_sequence("x", token_ids=[1, -2]), ValueError, r"token_ids\[1\] must be"),
    (lambda m: m.add_sequence("x", token_ids="abc"), TypeError, "token_ids must be"),
    (lambda m: m.add_sequence("x", token_ids=[1.0]), TypeError, r"token_ids\[0\] must be an"),
    (lambda m: m.add_sequence("x", 3, token_ids=[1, 2]), ValueError, "num_tokens=3 but"),
    (lambda m: m.add_sequence("x"), TypeError, "num_tokens or token_ids"),
    (lambda m: m.append_slots(["p"], [1, 2]), ValueError, "token_ids has 2 ids for 1"),
])
@pytest.mark.parametrize("caching", [False, True])
def test_bad_sharing_calls_raise_and_change_nothing(call, error, text, caching):
    m = KVCacheManager(8, 4, enable_prefix_caching=caching)
    m.add_sequence("p", token_ids=[5, 6, 7, 8, 9])
    before = snapshot(m)
    with pytest.raises(error, match=text):
        call(m)
    assert snapshot(m) == before


def test_ref_count_of_an_unheld_block_is_zero():
    m = KVCacheManager(4, 2)
    assert m.ref_count(3) == 0


# ---- prefix caching ----------------------------------------------------------------------


def test_block_hash_chains_over_the_parent():
    a = hash_block_tokens(None, [1, 2])
    assert a == hash_block_tokens(None, (1, 2)) and len(a) == 32
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert hash_block_tokens(None, [1, 2]) != hash_block_tokens(None, [2, 1])


def test_prefix_hit_shares_full_blocks_and_leaves_one_token_to_compute():
    m = KVCacheManager(16, 4, enable_prefix_caching=True)
    prompt = [11, 12, 13, 14, 21, 22, 23, 24, 31, 32]
    assert m.add_sequence("a", token_ids=prompt) == 0  # cold cache
    assert m.add_sequence("b", token_ids=prompt) == 8  # two full blocks shared
    assert m.block_table("b")[:2] == m.block_table("a")[:2]
    assert m.block_table("b")[2] != m.block_table("a")[2]  # partial block: fresh
    assert m.add_sequence("c", token_ids=prompt[:8]) == 4  # keep >= 1 token to compute
    assert m.add_sequence("d", token_ids=[11, 12, 13, 14, 99]) == 4
    assert m.add_sequence("e", token_ids=[0, 12, 13, 14, 21, 22, 23, 24, 5]) == 0
    st = m.stats()
    assert (st.prefix_hit_tokens, st.prefix_miss_tokens) == (16, 10 + 2 + 4 + 1 + 9)
    assert st.prefix_hit_rate == pytest.approx(16 / 42)


def test_same_block_after_a_different_prefix_is_not_a_hit():
    m = KVCacheManager(16, 2, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1, 2, 3, 4, 5])
    assert m.add_sequence("b", token_ids=[9, 9, 3, 4, 5]) == 0


def test_freed_blocks_stay_cached_and_count_as_free():
    m = KVCacheManager(4, 2, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1, 2, 3, 4, 5])  # blocks 0, 1 full, 2 partial
    m.free_sequence("a")
    assert m.num_free_blocks == 4
    assert m.allocator.num_evictable_blocks == 2 and m.allocator.evictable_blocks() == [1, 0]
    assert m.stats().blocks_evictable == 2
    assert m.add_sequence("b", token_ids=[1, 2, 3, 4, 7]) == 4
    assert m.block_table("b")[:2] == [0, 1] and m.ref_count(0) == 1
    assert m.num_free_blocks == 1


def test_never_used_blocks_go_before_evicting_and_eviction_is_lru():
    m = KVCacheManager(5, 2, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1, 2, 3])  # blocks 0 (cached), 1
    m.add_sequence("b", token_ids=[4, 5, 6])  # blocks 2 (cached), 3
    m.free_sequence("a")  # 0 evictable, 1 free
    m.free_sequence("b")  # 2 evictable, 3 free
    m.add_sequence("c", 6)  # 3 blocks: 4 (never used), then freed 1 and 3 -- no eviction
    assert m.block_table("c") == [4, 1, 3] and m.allocator.num_evictions == 0
    m.add_sequence("d", 1)  # evicts the least recently used cached block: 0
    assert m.block_table("d") == [0] and m.allocator.num_evictions == 1
    m.free_sequence("d")
    assert m.add_sequence("e", token_ids=[1, 2, 9]) == 0  # a's block is gone


def test_a_hit_makes_a_block_recently_used():
    m = KVCacheManager(4, 2, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1, 2])
    m.add_sequence("b", token_ids=[3, 4])
    m.free_sequence("a")
    m.free_sequence("b")
    assert m.allocator.evictable_blocks() == [0, 1]
    m.add_sequence("c", token_ids=[1, 2, 7])  # hit on block 0 (revived)
    m.free_sequence("c")
    assert m.allocator.evictable_blocks() == [1, 0]  # block 0 used last


def test_hit_on_blocks_a_running_sequence_holds():
    m = KVCacheManager(6, 2, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1, 2, 3, 4, 5])
    assert m.add_sequence("b", token_ids=[1, 2, 3, 4, 6]) == 4
    assert m.ref_count(0) == m.ref_count(1) == 2 and m.stats().blocks_shared == 2


def test_add_sequence_with_a_hit_is_all_or_nothing():
    m = KVCacheManager(4, 2, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1, 2, 3, 4])
    m.free_sequence("a")  # blocks 1, 0 evictable; 2, 3 free
    before = snapshot(m)
    # hit on 2 evictable blocks revives them, leaving only 2 blocks for 3 fresh ones
    with pytest.raises(OutOfBlocksError, match="needs 3 blocks .* only 2"):
        m.add_sequence("b", token_ids=[1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert snapshot(m) == before


def test_decode_tokens_fill_and_cache_blocks():
    m = KVCacheManager(8, 2, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1])
    m.append_slot("a", 2)  # fills block 0: cached
    m.append_slots(["a"], [3])
    m.append_slot("a", 4)
    m.free_sequence("a")
    assert m.add_sequence("b", token_ids=[1, 2, 3, 4, 5]) == 4


def test_blocks_after_an_unknown_token_are_never_hits():
    m = KVCacheManager(8, 2, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1, 2, 3])
    m.append_slot("a")  # token 3 unknown: block 1 uncacheable
    m.append_slot("a", 5)
    m.append_slot("a", 6)  # block 2 full, but after an unknown token
    assert len(m.cached_blocks()) == 1
    m.free_sequence("a")
    assert m.add_sequence("b", token_ids=[1, 2, 3, 0, 5, 6, 7]) == 2


def test_add_sequence_by_length_caches_nothing_but_empty_start_learns_tokens():
    m = KVCacheManager(8, 2, enable_prefix_caching=True)
    m.add_sequence("a", 4)
    assert m.cached_blocks() == []
    m.add_sequence("b", 0)
    m.append_slot("b", 1)
    m.append_slot("b", 2)
    assert [e.token_ids for e in m.cached_blocks()] == [(1, 2)]


def test_fork_child_inherits_token_ids():
    m = KVCacheManager(8, 2, enable_prefix_caching=True)
    m.add_sequence("p", token_ids=[1, 2, 3])
    m.fork("p", "c")
    m.append_slot("c", 4)  # copy-on-write, then c's block [3, 4] is full: cached
    m.append_slot("p", 9)
    assert sorted(e.token_ids for e in m.cached_blocks()) == [(1, 2), (3, 4), (3, 9)]
    assert m.take_copies() == [(1, 2)]


def test_prefix_caching_off_returns_zero_and_shares_nothing():
    m = KVCacheManager(8, 2)
    assert m.add_sequence("a", token_ids=[1, 2, 3]) == 0
    assert m.add_sequence("b", token_ids=[1, 2, 3]) == 0
    assert set(m.block_table("a")).isdisjoint(m.block_table("b"))
    m.free_sequence("a")
    assert m.allocator.num_evictable_blocks == 0 and m.stats().prefix_hit_tokens == 0


def test_cached_blocks_form_a_chain():
    m = KVCacheManager(8, 2, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1, 2, 3, 4, 5])
    first, second = m.cached_blocks()
    assert first.parent_hash is None and second.parent_hash == first.block_hash
    assert (first.token_ids, second.token_ids) == ((1, 2), (3, 4))
    assert (first.ref_count, first.evictable) == (1, False)


# ---- copy_blocks -------------------------------------------------------------------------


def test_copy_blocks_copies_every_layer_k_and_v():
    gen = torch.Generator().manual_seed(0)
    cache = PagedKVCache(3, 6, 4, 2, 8, dtype=torch.float32)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    before = cache.kv.clone()
    cache.copy_blocks([(1, 4), (4, 0)])  # sources read before any write
    for t in range(2):
        for layer in range(3):
            assert torch.equal(cache.kv[t, layer, 4], before[t, layer, 1])
            assert torch.equal(cache.kv[t, layer, 0], before[t, layer, 4])
            for b in (1, 2, 3, 5):
                assert torch.equal(cache.kv[t, layer, b], before[t, layer, b])
    assert cache.k_caches[2].data_ptr() == cache.kv[0, 2].data_ptr()  # views, not copies
    cache.copy_blocks([])
    assert torch.equal(cache.kv[:, :, 1], before[:, :, 1])


@pytest.mark.parametrize("pairs, error, text", [
    ((1, 2), TypeError, r"pairs\[0\] must be a \(src, dst\) pair"),
    ({1: 2}, TypeError, "pairs must be a list"),
    ([(0, 6)], ValueError, r"pairs\[0\] dst = 6 is outside"),
    ([(-1, 2)], ValueError, r"pairs\[0\] src must be >= 0"),
    ([(1, 1)], ValueError, "onto itself"),
    ([(1, 2), (3, 2)], ValueError, "destination block twice"),
    ([(1.0, 2)], TypeError, r"pairs\[0\] src must be an int"),
])
def test_bad_copy_blocks_raises_and_copies_nothing(pairs, error, text):
    cache = PagedKVCache(1, 6, 2, 1, 4, dtype=torch.float32)
    cache.kv.normal_()
    before = cache.kv.clone()
    with pytest.raises(error, match=text):
        cache.copy_blocks(pairs)
    assert torch.equal(cache.kv, before)


# ---- the host tier -----------------------------------------------------------------------


def test_evicted_block_spills_to_the_host_and_comes_back_on_a_hit():
    gen = torch.Generator().manual_seed(1)
    m = KVCacheManager(3, 2, enable_prefix_caching=True, num_host_blocks=2)
    cache = PagedKVCache(2, 3, 2, 1, 4, dtype=torch.float32, num_host_blocks=2)
    assert m.add_sequence("a", token_ids=[1, 2, 3]) == 0  # blocks 0 (cached), 1
    k = torch.randn(3, 1, 4, generator=gen)
    for layer in range(2):
        cache.write(layer, k + layer, -k, m.slot_mapping("a"))
    m.free_sequence("a")
    m.add_sequence("b", 6)  # needs all 3 blocks: evicts block 0 -> host slot 0
    ops = m.take_block_ops()
    assert ops.swap_out == [(0, 0)] and ops.swap_in == [] and ops.copies == []
    cache.apply_block_ops(ops)
    assert m.stats().blocks_on_host == 1 and m.allocator.num_cached_blocks == 0
    cache.write(0, torch.full((6, 1, 4), 7.0), torch.full((6, 1, 4), 7.0), m.slot_mapping("b"))
    m.free_sequence("b")
    assert m.add_sequence("c", token_ids=[1, 2, 9]) == 2  # a hit, from the host
    ops = m.take_block_ops()
    assert ops.swap_in == [(0, m.block_table("c")[0])]
    cache.apply_block_ops(ops)
    for layer in range(2):
        k_c, v_c = cache.gather(layer, m.block_table("c"), 2)
        assert torch.equal(k_c, k[:2] + layer) and torch.equal(v_c, -k[:2])
    st = m.stats()
    assert (st.prefix_hit_tokens, st.prefix_host_hit_tokens, st.blocks_on_host) == (2, 2, 0)


def test_take_copies_refuses_while_host_moves_are_pending():
    m = KVCacheManager(1, 2, enable_prefix_caching=True, num_host_blocks=1)
    m.add_sequence("a", token_ids=[1, 2])
    m.free_sequence("a")
    m.add_sequence("b", 1)  # evicts and spills
    with pytest.raises(RuntimeError, match="take_block_ops"):
        m.take_copies()
    assert m.take_block_ops().swap_out == [(0, 0)]


def test_host_tier_needs_prefix_caching():
    with pytest.raises(ValueError, match="num_host_blocks > 0 needs enable_prefix_caching"):
        KVCacheManager(4, 2, num_host_blocks=2)
    with pytest.raises(ValueError, match="num_host_blocks must be >= 0"):
        KVCacheManager(4, 2, enable_prefix_caching=True, num_host_blocks=-1)


def test_prompt_admitted_mid_step_shares_the_block_this_step_fills():
    """Found by the state machine: a decode token fills a block, which is registered as cached
    at once; a prompt admitted in the same step, before the step's K/V are written, hits it.
    The filler's write then lands in a block the prompt holds -- the very token the hash names,
    so both read the same K/V once the step has written it (as in vLLM v1, where a block is
    cached when the step that computes it is scheduled)."""
    m = KVCacheManager(4, 2, enable_prefix_caching=True)
    cache = PagedKVCache(1, 4, 2, 1, 1, dtype=torch.float32)
    m.add_sequence("a", token_ids=[5])
    cache.write(0, torch.tensor([[[5.0]]]), torch.tensor([[[5.0]]]), m.slot_mapping("a"))
    (slot,) = m.append_slots(["a"], [7])  # fills block 0: [5, 7], cached now
    assert m.add_sequence("b", token_ids=[5, 7, 1]) == 2  # a hit, before the write
    block = m.block_table("a")[0]
    assert m.block_table("b")[0] == block and m.ref_count(block) == 2
    assert m.take_copies() == []  # the token goes in place: nothing to copy
    cache.write(0, torch.tensor([[[7.0]]]), torch.tensor([[[7.0]]]), torch.tensor([slot]))
    assert cache.k_caches[0][block, :, 0, 0].tolist() == [5.0, 7.0]  # what b's hit promised
