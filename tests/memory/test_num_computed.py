"""``free_sequence(seq_id, num_computed=n)``: a sequence whose K/V were written only up to token
``n`` (a failed step, a broken transfer) takes the blocks it registered itself past ``n`` out of
the prefix cache; hits, blocks copied back from the host and a fork parent's blocks stay.

Each scenario drives a real manager and a one-layer cache whose K of a token is its id and
whose V is a fingerprint of the whole prefix, writes only what a step would have written, and
checks :func:`assert_cache_is_written`: every cached block holds exactly the K/V its hash names.
Each planted mistake (``PLANTED``) makes at least one scenario fail.
"""

from __future__ import annotations

import pytest
import torch

import paged_ref.memory.manager as manager_module
import paged_ref.memory.prefix_cache as prefix_module
from paged_ref import KVCacheManager, OutOfBlocksError, PagedKVCache
from tests.memory.test_sharing import snapshot
from tests.memory.test_sharing_machine import token_kv
from tests.mutations.mutate import mutant_of


class Run:
    """A manager over a one-layer cache; ``tokens``: the model's token ids per sequence."""

    def __init__(self, manager_cls, num_blocks, block_size, num_host_blocks=0):
        self.m = manager_cls(num_blocks, block_size, enable_prefix_caching=True,
                             num_host_blocks=num_host_blocks)
        self.cache = PagedKVCache(1, num_blocks, block_size, 1, 2, dtype=torch.float32,
                                  num_host_blocks=num_host_blocks)
        self.tokens: dict[str, list[int]] = {}
        self.written: dict[str, int] = {}  # leading tokens whose K/V are in the cache

    def add(self, seq, tokens, *, write=True):
        self.tokens[seq] = list(tokens)
        hit = self.m.add_sequence(seq, token_ids=tokens)
        self.written[seq] = hit
        if write:
            self.write(seq)
        return hit

    def append(self, seq, token, *, write=True):
        self.m.append_slot(seq, token)
        self.tokens[seq].append(token)
        if write:
            self.write(seq)

    def write(self, seq, end=None):
        """The step's moves, then tokens ``written .. end`` of ``seq``."""
        self.cache.apply_block_ops(self.m.take_block_ops())
        end = len(self.tokens[seq]) if end is None else end
        start = self.written[seq]
        k, v = token_kv(self.tokens[seq])
        self.cache.write(0, k[start:end], v[start:end], self.m.slot_mapping(seq, start, end))
        self.written[seq] = end

    def free(self, seq, num_computed="written"):
        n = self.written[seq] if num_computed == "written" else num_computed
        self.m.free_sequence(seq, num_computed=n)
        del self.tokens[seq], self.written[seq]


def assert_cache_is_written(r: Run) -> None:
    """Every cached block holds the K/V of the prefix its hash names (the chain of cached
    entries gives that prefix), and the pool's counts add up."""
    entries = {e.block_hash: e for e in r.m.cached_blocks()}
    for e in entries.values():
        chain, parent = [e.token_ids], e.parent_hash
        while parent is not None:
            assert parent in entries or parent in (r.m._host.hashes() if r.m._host else ()), (
                "a cached block whose parent is gone")
            if parent not in entries:  # on the host: its K/V are checked when it comes back
                return
            chain.append(entries[parent].token_ids)
            parent = entries[parent].parent_hash
        tokens = [t for block in reversed(chain) for t in block]
        k, v = token_kv(tokens)
        bs = r.m.block_size
        got = r.cache.k_caches[0][e.block_id], r.cache.v_caches[0][e.block_id]
        assert torch.equal(got[0], k[-bs:]) and torch.equal(got[1], v[-bs:]), (
            f"block {e.block_id} is cached for tokens {e.token_ids} but holds other K/V")
    a = r.m.allocator
    held = {b for s in r.m.seq_ids for b in r.m.block_table(s)}
    assert r.m.num_free_blocks + len(held | set(r.m._pinned)) == a.num_blocks


# ---- scenarios (each takes a manager class, so a planted mistake can run them too) ---------


def prompt_never_computed(cls):
    """Add a prompt (its 3 full blocks registered), compute nothing, free with 0: no hit."""
    r = Run(cls, 8, 2)
    r.add("a", [4, 5, 6, 7, 8, 9, 1], write=False)
    r.free("a", 0)
    assert r.m.cached_blocks() == [] and r.m.allocator.num_evictable_blocks == 0
    assert r.add("b", [4, 5, 6, 7, 8, 9, 1]) == 0, "a hit on blocks never written"
    assert_cache_is_written(r)


def prompt_computed_in_part(cls):
    """Chunked prefill broke off after 5 of 9 tokens: blocks 0 and 1 (tokens 0-3) stay cached,
    block 2 (tokens 4-5) goes, although its first token was written."""
    r = Run(cls, 8, 2)
    r.add("a", [3, 1, 4, 1, 5, 9, 2, 6, 5], write=False)
    r.write("a", 5)
    r.free("a")
    assert [e.token_ids for e in r.m.cached_blocks()] == [(3, 1), (4, 1)]
    assert r.add("b", [3, 1, 4, 1, 5, 9, 0]) == 4
    assert_cache_is_written(r)


def hits_stay_cached(cls):
    """b hits a's 2 computed blocks, registers 2 more, computes nothing: only b's go."""
    r = Run(cls, 10, 2)
    r.add("a", [7, 7, 8, 8, 9])
    r.free("a")
    assert r.add("b", [7, 7, 8, 8, 1, 2, 3, 4, 5], write=False) == 4
    r.free("b", 0)
    assert [e.token_ids for e in r.m.cached_blocks()] == [(7, 7), (8, 8)]
    assert r.add("c", [7, 7, 8, 8, 1, 2, 3]) == 4
    assert_cache_is_written(r)


def token_that_filled_a_block(cls):
    """A decode step's token fills a block in place (registered), the step fails: that block
    goes, the earlier one stays; then the next turn hits only the earlier one."""
    r = Run(cls, 8, 3)
    r.add("a", [1, 2, 3, 4, 5])
    r.append("a", 6, write=False)  # fills block 1: registered, never written
    r.free("a")  # num_computed = 5
    assert [e.token_ids for e in r.m.cached_blocks()] == [(1, 2, 3)]
    assert r.add("b", [1, 2, 3, 4, 5, 6, 7]) == 3
    assert_cache_is_written(r)


def fork_parent_and_child(cls):
    """The child holds the parent's registered blocks: freeing the child with 0 leaves them;
    the parent freed with 0 while a child still holds them uncaches them (the child keeps
    its blocks); the child's own block filled by copy-on-write goes with the child."""
    r = Run(cls, 10, 2)
    r.add("p", [5, 6, 7, 8, 9], write=False)  # blocks 0, 1 registered, 2 partial
    r.m.fork("p", "c")
    r.tokens["c"], r.written["c"] = list(r.tokens["p"]), 0
    r.free("c", 0)
    assert len(r.m.cached_blocks()) == 2, "the child dropped the parent's registrations"
    r.m.fork("p", "c")
    r.tokens["c"], r.written["c"] = list(r.tokens["p"]), 0
    table = r.m.block_table("p")
    r.append("c", 1, write=False)  # copy-on-write into a fresh block, which it fills: [9, 1]
    assert len(r.m.cached_blocks()) == 3
    r.free("p", 0)
    assert [e.token_ids for e in r.m.cached_blocks()] == [(9, 1)]  # the child's own
    assert r.m.block_table("c")[:2] == table[:2] and r.m.ref_count(table[0]) == 1
    r.free("c", 0)
    assert r.m.cached_blocks() == []
    assert r.m.take_copies() == [] and r.m.num_free_blocks == 10
    assert r.m.allocator.num_evictable_blocks == 0
    assert_cache_is_written(r)


def host_copy_back_counts_as_written(cls):
    """A hit copied back from the host tier: the sequence is freed (num_computed=0) before the
    step's moves run. The block stays cached and kept (no other prompt may be given it and no
    spill may read it) until take_block_ops hands the copy out; then it holds the right K/V."""
    r = Run(cls, 3, 2, num_host_blocks=2)
    r.add("x", [4, 2, 9])
    r.free("x")  # block 0 cached: (4, 2)
    r.add("hog", [1, 1, 1, 1, 1, 1])  # takes every block: (4, 2) spills to the host
    r.free("hog", 0)
    assert r.m.allocator.num_cached_blocks == 0 and r.m.stats().blocks_on_host == 1
    assert r.add("y", [4, 2, 7], write=False) == 2  # (4, 2) comes back from the host
    (slot, block), = r.m._host.swap_in
    r.free("y", 0)
    assert [e.token_ids for e in r.m.cached_blocks()] == [(4, 2)]
    assert not r.m.allocator.is_free(block) and r.m.ref_count(block) == 0
    try:
        r.m.add_sequence("hog2", 6)
    except OutOfBlocksError:
        pass
    else:
        raise AssertionError("the kept block was handed out before its copy back ran")
    r.cache.apply_block_ops(r.m.take_block_ops())
    assert r.m.allocator.is_evictable(block)
    assert_cache_is_written(r)
    assert r.add("z", [4, 2, 5]) == 2
    assert_cache_is_written(r)


def eviction_order_after_a_drop(cls):
    """Dropped blocks go back as plain free blocks, handed out before any cached one; the
    blocks that stay cached keep their order (the prompt's last block is evicted first)."""
    r = Run(cls, 6, 2)
    r.add("a", [1, 2, 3, 4, 5, 6, 7], write=False)
    r.write("a", 4)
    table = r.m.block_table("a")
    r.free("a")  # blocks 0, 1 stay cached; 2 dropped, 3 partial
    assert r.m.allocator.evictable_blocks() == [table[1], table[0]]
    r.add("b", [9] * 8, write=False)  # 2 never-used blocks, then the 2 freed plain ones
    assert sorted(r.m.block_table("b")) == sorted([4, 5, table[2], table[3]])
    assert r.m.allocator.num_evictable_blocks == 2
    r.free("b", 0)
    assert_cache_is_written(r)


SCENARIOS = [prompt_never_computed, prompt_computed_in_part, hits_stay_cached,
             token_that_filled_a_block, fork_parent_and_child,
             host_copy_back_counts_as_written, eviction_order_after_a_drop]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_scenario(scenario):
    scenario(KVCacheManager)


@pytest.mark.parametrize("value, error", [(1.5, TypeError), (True, TypeError),
                                          ("2", TypeError), (-1, ValueError), (6, ValueError)])
def test_bad_num_computed_is_refused_naming_it_and_changes_nothing(value, error):
    m = KVCacheManager(8, 2, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1, 2, 3, 4, 5])
    before = snapshot(m)
    with pytest.raises(error, match="num_computed"):
        m.free_sequence("a", num_computed=value)
    assert snapshot(m) == before and "a" in m


def test_num_computed_without_prefix_caching_frees_as_usual():
    m = KVCacheManager(4, 2)
    m.add_sequence("a", 5)
    m.free_sequence("a", num_computed=0)
    assert m.num_free_blocks == 4 and len(m) == 0


def test_num_computed_equal_to_the_length_keeps_every_block():
    m = KVCacheManager(8, 2, enable_prefix_caching=True)
    m.add_sequence("a", token_ids=[1, 2, 3, 4, 5])
    m.free_sequence("a", num_computed=5)
    assert len(m.cached_blocks()) == 2


# ---- the same scenarios with a planted mistake -----------------------------------------------

PLANTED = {
    "num_computed is ignored": (prefix_module, (
        "            if (j + 1) * bs > num_computed and",
        "            if False and")),
    "a block is dropped only if it starts past n": (prefix_module, (
        "            if (j + 1) * bs > num_computed and",
        "            if j * bs >= num_computed and")),
    "hits copied back from the host count as the sequence's own": (prefix_module, (
        "self.register(seq_id, table, j, own=j >= len(hit))",
        "self.register(seq_id, table, j, own=True)")),
    "a fork child inherits the parent's registrations": (prefix_module, (
        "        self.own[child_id] = {}",
        "        self.own[child_id] = dict(self.own[parent_id])")),
    "a block coming back from the host is released with its last holder": (manager_module, (
        "        keep |= {d for d in self._owed_targets() if not held_after(d)}  # copy back owed",
        "        pass")),
}


@pytest.mark.parametrize("mistake", PLANTED)
def test_each_planted_mistake_is_caught(mistake, tmp_path, monkeypatch):
    module, edit = PLANTED[mistake]
    mutant = mutant_of(module, [edit], tmp_path, monkeypatch)
    if module is prefix_module:
        monkeypatch.setattr(manager_module, "PrefixCache", mutant.PrefixCache)
        cls = KVCacheManager
    else:
        cls = mutant.KVCacheManager
    caught = []
    for scenario in SCENARIOS:
        try:
            scenario(cls)
        except (AssertionError, ValueError, RuntimeError):
            caught.append(scenario.__name__)
    assert caught, f"no scenario caught the planted mistake: {mistake}"
