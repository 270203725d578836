"""KVCacheManager: worked examples, bad input, and a hypothesis state machine."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

import paged_ref
from paged_course.checks import assert_close
from paged_ref import KVCacheManager, OutOfBlocksError
from paged_ref.memory.manager import CacheStats, blocks_needed
from paged_ref.reference import paged_attention_reference


def snapshot(m: KVCacheManager):
    """Everything observable about a manager's state."""
    return (
        m.num_free_blocks,
        [m.allocator.is_free(b) for b in range(m.num_blocks)],
        {s: (m.block_table(s), m.seq_len(s)) for s in m.seq_ids},
    )


# ---- worked examples ---------------------------------------------------------------------


def test_add_sequence_takes_ceil_blocks_and_maps_slots():
    m = KVCacheManager(8, 4)
    m.add_sequence("a", 6)
    assert m.block_table("a") == [0, 1]
    assert m.seq_len("a") == 6
    assert m.slot_mapping("a") == [0, 1, 2, 3, 4, 5]
    assert m.slot_mapping("a", 2, 5) == [2, 3, 4]
    assert m.num_free_blocks == 6
    assert "a" in m and m.has_sequence("a") and not m.has_sequence("b")
    assert m.seq_ids == ["a"] and len(m) == 1


def test_append_slot_takes_a_block_only_at_a_block_boundary():
    m = KVCacheManager(8, 4)
    m.add_sequence("a", 3)  # block 0, one free slot left
    m.add_sequence("b", 4)  # block 1, full
    assert m.append_slot("a") == 3  # fills block 0
    assert m.num_free_blocks == 6
    assert m.append_slot("a") == 2 * 4 + 0  # length 4 -> new block 2
    assert m.append_slot("b") == 3 * 4 + 0  # length 4 -> new block 3
    assert m.block_table("a") == [0, 2] and m.block_table("b") == [1, 3]
    assert (m.seq_len("a"), m.seq_len("b")) == (5, 5)


def test_empty_sequence_takes_its_first_block_on_the_first_token():
    m = KVCacheManager(2, 4)
    m.add_sequence(7, 0)
    assert m.block_table(7) == [] and m.num_free_blocks == 2
    assert m.append_slot(7) == 0
    assert m.block_table(7) == [0]


def test_free_sequence_returns_every_block():
    m = KVCacheManager(4, 2)
    m.add_sequence("a", 5)
    m.free_sequence("a")
    assert m.num_free_blocks == 4 and m.seq_ids == []
    m.add_sequence("a", 8)  # the id can be reused and the whole pool is available
    assert sorted(m.block_table("a")) == [0, 1, 2, 3]


def test_block_table_is_a_copy():
    m = KVCacheManager(4, 2)
    m.add_sequence("a", 3)
    m.block_table("a").append(99)
    assert m.block_table("a") == [0, 1]


def test_stats_count_blocks_tokens_and_empty_slots():
    m = KVCacheManager(10, 4)
    assert m.stats().utilization == 1.0  # nothing reserved, nothing wasted
    m.add_sequence("a", 5)  # 2 blocks, 3 empty slots
    m.add_sequence("b", 8)  # 2 blocks, 0 empty
    m.add_sequence("c", 0)  # 0 blocks
    s = m.stats()
    assert s == CacheStats(num_blocks=10, block_size=4, blocks_used=4, blocks_free=6,
                           tokens_stored=13, slots_reserved_empty=3, num_sequences=3)
    assert s.slots_used == 16
    assert s.utilization == pytest.approx(13 / 16)
    with pytest.raises(AttributeError):
        s.blocks_used = 0  # frozen snapshot


def test_batch_tables_are_the_inputs_paged_attention_takes():
    m = KVCacheManager(16, 4)
    m.add_sequence("a", 9)
    m.add_sequence("b", 1)
    m.add_sequence("c", 0)
    tables, lens = m.batch_tables(["b", "a", "c"])
    assert tables.dtype == torch.int32 and lens.dtype == torch.int32
    assert tables.tolist() == [[3, -1, -1], [0, 1, 2], [-1, -1, -1]]
    assert lens.tolist() == [1, 9, 0]
    empty_tables, empty_lens = m.batch_tables([])
    assert tuple(empty_tables.shape) == (0, 1) and tuple(empty_lens.shape) == (0,)


def test_batch_tables_feed_paged_attention():
    gen = torch.Generator().manual_seed(0)
    m = KVCacheManager(12, 4)
    for seq_id, n in [("a", 7), ("b", 13), ("c", 1)]:
        m.add_sequence(seq_id, n)
    k_cache = torch.randn(12, 4, 2, 8, generator=gen)
    v_cache = torch.randn(12, 4, 2, 8, generator=gen)
    q = torch.randn(3, 4, 8, generator=gen)
    tables, lens = m.batch_tables(["a", "b", "c"])
    out = paged_ref.paged_attention(q, k_cache, v_cache, tables, lens, backend="torch")
    ref = paged_attention_reference(q, k_cache, v_cache, tables, lens)
    assert_close(out, ref)


def test_append_slots_is_one_all_or_nothing_decode_step():
    m = KVCacheManager(3, 2)
    m.add_sequence("a", 2)  # full block: needs a new one
    m.add_sequence("b", 1)  # room in its block
    assert m.append_slots(["a", "b"]) == [2 * 2 + 0, 1 * 2 + 1]
    m.add_sequence("c", 0)
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError, match="needs 2 new blocks but only 0"):
        m.append_slots(["b", "c"])  # "a" has room; "b" and "c" both need a block
    assert snapshot(m) == before
    with pytest.raises(ValueError, match="repeats"):
        m.append_slots(["a", "a"])
    assert snapshot(m) == before


# ---- errors ------------------------------------------------------------------------------


def test_add_sequence_is_all_or_nothing():
    m = KVCacheManager(4, 4)
    m.add_sequence("a", 9)  # 3 blocks
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError, match="needs 2 blocks for 5 tokens but only 1 of 4"):
        m.add_sequence("b", 5)
    assert snapshot(m) == before and "b" not in m


def test_append_slot_out_of_blocks_leaves_the_sequence_unchanged():
    m = KVCacheManager(1, 2)
    m.add_sequence("a", 2)
    before = snapshot(m)
    with pytest.raises(OutOfBlocksError):
        m.append_slot("a")
    assert snapshot(m) == before


@pytest.mark.parametrize(
    "method, args",
    [
        ("append_slot", ()),
        ("block_table", ()),
        ("seq_len", ()),
        ("free_sequence", ()),
        ("slot_mapping", ()),
    ],
)
@pytest.mark.parametrize("seq_id", ["ghost", 42, ("x", 1)])
def test_unknown_sequence_is_a_value_error_naming_it(method, args, seq_id):
    m = KVCacheManager(4, 2)
    m.add_sequence("a", 3)
    before = snapshot(m)
    with pytest.raises(ValueError, match="unknown sequence " + repr(seq_id).replace("(", r"\(")
                       .replace(")", r"\)")):
        getattr(m, method)(seq_id, *args)
    assert snapshot(m) == before


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.batch_tables(["a", "zzz"]), "unknown sequence 'zzz'"),
        (lambda m: m.append_slots(["a", "zzz"]), "unknown sequence 'zzz'"),
        (lambda m: m.add_sequence("a", 1), "sequence 'a' already exists"),
    ],
    ids=["batch_tables unknown id", "append_slots unknown id", "add_sequence duplicate id"],
)
def test_refused_batch_and_duplicate_calls_change_nothing(call, match):
    m = KVCacheManager(4, 2)
    m.add_sequence("a", 3)
    before = snapshot(m)
    with pytest.raises(ValueError, match=match):
        call(m)
    assert snapshot(m) == before


@pytest.mark.parametrize(
    "seq_id, num_tokens, error, text",
    [
        ("a", -1, ValueError, "num_tokens must be >= 0, got -1"),
        ("a", 2.0, TypeError, "num_tokens must be an int"),
        ("a", True, TypeError, "num_tokens must be an int"),
        (["a"], 1, TypeError, "seq_id must be hashable"),
    ],
)
def test_bad_add_sequence_arguments(seq_id, num_tokens, error, text):
    m = KVCacheManager(4, 2)
    with pytest.raises(error, match=text):
        m.add_sequence(seq_id, num_tokens)
    assert m.seq_ids == [] and m.num_free_blocks == 4


@pytest.mark.parametrize(
    "start, end, error, text",
    [
        (-1, None, ValueError, "start must be >= 0"),
        (0, 6, ValueError, "end=6, seq_len=5"),
        (4, 3, ValueError, "start=4, end=3"),
        (0.0, None, TypeError, "start must be an int"),
        (0, "5", TypeError, "end must be an int"),
    ],
)
def test_bad_slot_mapping_ranges(start, end, error, text):
    m = KVCacheManager(4, 2)
    m.add_sequence("a", 5)
    with pytest.raises(error, match=text):
        m.slot_mapping("a", start, end)


@pytest.mark.parametrize(
    "num_blocks, block_size, error, name",
    [(0, 4, ValueError, "num_blocks"), (4, -2, ValueError, "block_size"),
     ("4", 4, TypeError, "num_blocks")],
)
def test_bad_constructor_arguments(num_blocks, block_size, error, name):
    with pytest.raises(error, match=name):
        KVCacheManager(num_blocks, block_size)


# ---- state machine -----------------------------------------------------------------------


class ManagerMachine(RuleBasedStateMachine):
    """Random adds, appends, decode steps and frees against a model of lengths.

    Invariants after every step: every block is free or owned by exactly one sequence, never
    both; free + owned = num_blocks; each table holds ceil(len / block_size) blocks; all slots of
    all sequences are distinct and inside the pool; stats agree with the model.
    """

    seqs = Bundle("seqs")

    @initialize(num_blocks=st.integers(1, 16), block_size=st.integers(1, 5))
    def create(self, num_blocks, block_size):
        self.m = KVCacheManager(num_blocks, block_size)
        self.lens: dict[int, int] = {}
        self.next_id = 0

    def _fits(self, extra_blocks: int) -> bool:
        return extra_blocks <= self.m.num_free_blocks

    @rule(target=seqs, num_tokens=st.integers(0, 20))
    def add(self, num_tokens):
        seq_id = self.next_id
        self.next_id += 1
        if not self._fits(blocks_needed(num_tokens, self.m.block_size)):
            before = snapshot(self.m)
            with pytest.raises(OutOfBlocksError):
                self.m.add_sequence(seq_id, num_tokens)
            assert snapshot(self.m) == before, "a failed add_sequence leaked or changed state"
            return multiple()  # nothing joins the bundle
        self.m.add_sequence(seq_id, num_tokens)
        self.lens[seq_id] = num_tokens
        return seq_id

    @rule(seq_id=seqs)
    def append(self, seq_id):
        if seq_id not in self.lens:
            return
        n = self.lens[seq_id]
        needs_block = n % self.m.block_size == 0
        if needs_block and not self._fits(1):
            before = snapshot(self.m)
            with pytest.raises(OutOfBlocksError):
                self.m.append_slot(seq_id)
            assert snapshot(self.m) == before, "a failed append_slot changed state"
            return
        free_before = self.m.num_free_blocks
        slot = self.m.append_slot(seq_id)
        self.lens[seq_id] = n + 1
        assert self.m.num_free_blocks == free_before - needs_block
        assert slot == self.m.slot_mapping(seq_id, n)[0]

    @rule(data=st.data())
    def decode_step(self, data):
        live = sorted(self.lens)
        if not live:
            return
        step = data.draw(st.lists(st.sampled_from(live), unique=True, max_size=len(live)))
        needed = sum(self.lens[s] % self.m.block_size == 0 for s in step)
        if not self._fits(needed):
            before = snapshot(self.m)
            with pytest.raises(OutOfBlocksError):
                self.m.append_slots(step)
            assert snapshot(self.m) == before, "a failed decode step changed state"
            return
        slots = self.m.append_slots(step)
        for s, slot in zip(step, slots, strict=True):
            self.lens[s] += 1
            assert slot == self.m.slot_mapping(s)[-1]

    @rule(seq_id=consumes(seqs))
    def free(self, seq_id):
        if seq_id not in self.lens:
            return
        self.m.free_sequence(seq_id)
        del self.lens[seq_id]
        assert seq_id not in self.m

    @rule(seq_id=seqs, num_tokens=st.integers(0, 3))
    def duplicate_add(self, seq_id, num_tokens):
        if seq_id not in self.lens:
            return
        before = snapshot(self.m)
        with pytest.raises(ValueError, match=f"sequence {seq_id!r} already exists"):
            self.m.add_sequence(seq_id, num_tokens)
        assert snapshot(self.m) == before

    @invariant()
    def blocks_are_free_or_owned_by_exactly_one_sequence(self):
        owner: dict[int, int] = {}
        for s in self.m.seq_ids:
            for b in self.m.block_table(s):
                assert 0 <= b < self.m.num_blocks
                assert b not in owner, f"block {b} owned by {owner[b]} and {s}"
                assert not self.m.allocator.is_free(b), f"block {b} is owned by {s} AND free"
                owner[b] = s
        free = [b for b in range(self.m.num_blocks) if self.m.allocator.is_free(b)]
        assert len(free) == self.m.num_free_blocks
        assert len(owner) + len(free) == self.m.num_blocks, "a block is neither free nor owned"

    @invariant()
    def tables_match_lengths_and_slots_are_unique(self):
        assert sorted(self.m.seq_ids) == sorted(self.lens)
        all_slots: list[int] = []
        for s, n in self.lens.items():
            assert self.m.seq_len(s) == n
            assert len(self.m.block_table(s)) == math.ceil(n / self.m.block_size)
            slots = self.m.slot_mapping(s)
            assert len(slots) == n
            all_slots += slots
        assert len(set(all_slots)) == len(all_slots), "two tokens share a slot"
        assert all(0 <= x < self.m.num_blocks * self.m.block_size for x in all_slots)

    @invariant()
    def stats_agree_with_the_model(self):
        st_ = self.m.stats()
        assert st_.tokens_stored == sum(self.lens.values())
        assert st_.blocks_used + st_.blocks_free == st_.num_blocks
        assert st_.slots_reserved_empty == st_.blocks_used * st_.block_size - st_.tokens_stored
        # each sequence wastes less than one block, in its last block only
        assert 0 <= st_.slots_reserved_empty < max(1, st_.num_sequences) * st_.block_size
        assert st_.num_sequences == len(self.lens)


ManagerMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=30, deadline=None)
TestManagerMachine = ManagerMachine.TestCase


def test_padded_tables_are_the_tables_then_zeros():
    """The runner's tables: row i holds table i then zeros, rows past the tables (a CUDA graph's
    padding) are zeros, one column at least; int32 on the CPU."""
    from paged_ref.memory.tables import padded_tables

    got = padded_tables([[7, 3, 9], [], [5]], 5)
    assert got.dtype == torch.int32 and got.device.type == "cpu"
    assert got.tolist() == [[7, 3, 9], [0, 0, 0], [5, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert padded_tables([[]], 2).tolist() == [[0], [0]]
