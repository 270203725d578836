"""A copy-on-write is owed from ``append_slot`` until ``take_copies`` hands it out. A sequence
freed in between (finished, preempted or aborted in the middle of a step) must not break it:

* the copy *into* the freed writer's block is dropped, and that block, which never got its
  K/V, is not left in the prefix cache;
* the copy's *source* stays held until the copy is handed out, even when its last holder is
  freed, so no other sequence gets that block (and writes into it, or has it filled from the
  host tier) before the copy has read it.

Each scenario runs on the real manager and, by planting each mistake into ``manager.py``'s
source, on a broken one that it must catch. The hypothesis state machine in
``test_sharing_machine.py`` (rule ``step_with_frees_before_the_block_moves``) checks the same
with random streams.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path

import pytest
import torch

import paged_ref.memory.manager
from paged_ref import KVCacheManager, OutOfBlocksError, PagedKVCache


class Run:
    """A manager + a one-layer cache whose K and V of a token are its id (exact in float32)."""

    def __init__(self, manager_cls, num_blocks: int, block_size: int, num_host_blocks=0):
        self.m = manager_cls(num_blocks, block_size, enable_prefix_caching=True,
                             num_host_blocks=num_host_blocks)
        self.cache = PagedKVCache(1, num_blocks, block_size, 1, 1, dtype=torch.float32,
                                  num_host_blocks=num_host_blocks)
        self.tokens: dict[str, list[int]] = {}

    def add(self, seq: str, tokens: list[int]) -> int:
        self.tokens[seq] = list(tokens)
        return self.m.add_sequence(seq, token_ids=tokens)

    def moves(self) -> None:
        self.cache.apply_block_ops(self.m.take_block_ops())

    def write(self, seq: str, start: int = 0) -> None:
        kv = torch.tensor(self.tokens[seq][start:], dtype=torch.float32).view(-1, 1, 1)
        self.cache.write(0, kv, kv, self.m.slot_mapping(seq, start))

    def read(self, seq: str) -> list[int]:
        k, _ = self.cache.gather(0, self.m.block_table(seq), self.m.seq_len(seq))
        return [int(x) for x in k.flatten().tolist()]


def source_survives_its_last_holder(manager_cls) -> None:
    """p's last block is the source of c's owed copy; p is freed, a new prompt is admitted
    whose cached block comes back from the host tier, all before the step's block moves.
    (With the source handed back at once, the new prompt gets that very block, its host
    copy-back runs before the copy, and c reads the wrong K/V.)"""
    r = Run(manager_cls, 4, 2, num_host_blocks=1)
    r.add("x", [5, 6])
    r.write("x")
    r.m.free_sequence("x")  # block 0 cached, nobody holds it
    r.add("p", [1])
    r.add("w", [9])
    r.write("p")
    r.write("w")
    r.add("hog", [99, 99])  # evicts block 0 to the host tier
    r.moves()
    r.write("hog")
    r.m.fork("p", "c")
    r.tokens["c"] = [1, 2]
    r.m.append_slot("c", 2)  # copy-on-write: (p's block, a fresh one) owed
    (src, dst), = r.m._copies
    r.m.free_sequence("p")  # the source's last holder
    r.m.free_sequence("w")
    assert r.m.ref_count(src) == 0, "a kept source is held by no sequence"
    try:
        hit = r.add("y", [5, 6, 8])  # a host-tier hit: copied back into a fresh block
    except OutOfBlocksError:  # the kept source is not free yet: y waits for the next step
        hit = None
        del r.tokens["y"]
    else:
        assert src not in r.m.block_table("y"), "the owed copy's source was handed out"
    r.moves()
    r.write("c", 1)
    assert r.read("c") == [1, 2], "the copy-on-write read an overwritten source"
    if hit is not None:
        r.write("y", hit)
        assert r.read("y") == [5, 6, 8]
    else:  # the source is released with the copy: now y fits, and its hit is right
        hit = r.add("y", [5, 6, 8])
        r.moves()
        r.write("y", hit)
        assert (hit, r.read("y")) == (2, [5, 6, 8])


def freed_writer_leaves_no_copy_and_no_stale_cache_entry(manager_cls) -> None:
    """c's append fills the block it copied into (so it is cached); c is freed before the
    step's block moves: no copy is owed any more, and no later prompt may hit that block."""
    r = Run(manager_cls, 4, 2)
    r.add("p", [1])
    r.write("p")
    r.m.fork("p", "c")
    r.m.append_slot("c", 2)  # copy-on-write into a fresh block, which is then full: [1, 2]
    r.m.free_sequence("c")  # never computed
    assert r.m.take_copies() == [], "a copy into a block nobody holds"
    assert r.m.num_free_blocks == 3 and r.m.allocator.num_evictable_blocks == 0
    assert [e.token_ids for e in r.m.cached_blocks()] == []
    assert r.add("q", [1, 2, 3]) == 0, "a hit on a block whose K/V were never written"


def kept_source_counts_as_used_until_taken(manager_cls) -> None:
    """The kept source is used (not free), held by no sequence, released by take_copies."""
    m = manager_cls(4, 4)
    m.add_sequence("p", 2)
    m.fork("p", "c")
    m.append_slot("c")  # owes (0, 1)
    m.free_sequence("p")
    assert (m.ref_count(0), m.num_free_blocks, m.stats().blocks_used) == (0, 2, 2)
    hog = m.num_free_blocks * m.block_size
    m.add_sequence("hog", hog)
    assert 0 not in m.block_table("hog"), "the owed copy's source was handed out"
    assert m.take_copies() == [(0, 1)]
    assert m.num_free_blocks == 1 and m.allocator.is_free(0)
    m.free_sequence("hog")
    m.free_sequence("c")
    assert m.num_free_blocks == 4


SCENARIOS = [source_survives_its_last_holder,
             freed_writer_leaves_no_copy_and_no_stale_cache_entry,
             kept_source_counts_as_used_until_taken]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_scenario(scenario):
    scenario(KVCacheManager)


def test_both_copies_and_host_moves_release_the_kept_source():
    m = KVCacheManager(4, 4, enable_prefix_caching=True, num_host_blocks=2)
    m.add_sequence("p", 2)
    m.fork("p", "c")
    m.append_slot("c")
    m.free_sequence("p")
    assert m.num_free_blocks == 2
    assert m.take_block_ops().copies == [(0, 1)]
    assert m.num_free_blocks == 3 and m.take_block_ops().copies == []


def test_a_source_still_held_by_another_sequence_is_not_kept_twice():
    m = KVCacheManager(4, 4)
    m.add_sequence("p", 2)
    m.fork("p", "a")
    m.fork("p", "b")
    m.append_slots(["a", "b"])  # owes (0, 1) and (0, 2); p still holds block 0
    m.free_sequence("p")
    assert m._pinned == [0] and m.ref_count(0) == 0
    assert m.take_copies() == [(0, 1), (0, 2)]
    assert m._pinned == [] and m.allocator.is_free(0)


# ---- the same scenarios on a manager with a planted mistake ---------------------------------

MISTAKES = {
    "the source is released with its last holder": (
        "            if block_id in keep:", "            if False:"),
    "a copy into a freed block is still owed": (
        "owed = [(s, d) for s, d in self._copies if held_after(d)]", "owed = list(self._copies)"),
    "the freed writer's block stays cached": (
        "            self._uncache(dst)", "            pass"),
    "take_copies never releases the kept source": (
        "        copies, self._copies = self._copies, []\n        self._release_pinned()",
        "        copies, self._copies = self._copies, []"),
}


def mutated_manager(old: str, new: str):
    """``KVCacheManager`` from ``paged_ref/memory/manager.py`` with ``old`` replaced by ``new``."""
    source = Path(paged_ref.memory.manager.__file__).read_text()
    assert source.count(old) == 1, f"{old!r} must occur once in manager.py (did it change?)"
    module = types.ModuleType("paged_ref._manager_mutant")
    sys.modules[module.__name__] = module  # dataclasses look their module up
    try:
        exec(compile(source.replace(old, new), "manager_mutant.py", "exec"), module.__dict__)
    finally:
        del sys.modules[module.__name__]
    return module.KVCacheManager


@pytest.mark.parametrize("mistake", MISTAKES)
def test_each_planted_mistake_is_caught(mistake):
    broken = mutated_manager(*MISTAKES[mistake])
    caught = []
    for scenario in SCENARIOS:
        try:
            scenario(broken)
        except (AssertionError, ValueError, RuntimeError):
            caught.append(scenario.__name__)
    assert caught, f"no scenario caught the planted mistake: {mistake}"
