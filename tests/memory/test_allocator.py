"""BlockAllocator: unit tests, bad input, and a hypothesis state machine."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from paged_ref import BlockAllocator, OutOfBlocksError


def snapshot(a: BlockAllocator):
    return a.num_free_blocks, [a.is_free(i) for i in range(a.num_blocks)]


def test_allocates_lowest_ids_first_and_reuses_freed_blocks():
    a = BlockAllocator(4, 16)
    assert [a.allocate() for _ in range(3)] == [0, 1, 2]
    a.free(1)
    assert a.num_free_blocks == 2
    assert a.allocate() == 3  # never-used blocks first, then the freed one
    assert a.allocate() == 1
    assert a.num_free_blocks == 0


def test_sizes_are_reported():
    a = BlockAllocator(5, 8)
    assert (a.num_blocks, a.block_size, a.num_free_blocks, a.num_used_blocks) == (5, 8, 5, 0)
    a.allocate()
    assert (a.num_free_blocks, a.num_used_blocks) == (4, 1)
    assert "num_blocks=5" in repr(a)


def test_out_of_blocks_names_the_pool_size_and_changes_nothing():
    a = BlockAllocator(2, 4)
    a.allocate()
    a.allocate()
    before = snapshot(a)
    with pytest.raises(OutOfBlocksError, match="all 2 blocks"):
        a.allocate()
    assert snapshot(a) == before
    assert issubclass(OutOfBlocksError, RuntimeError)


def test_double_free_is_a_value_error_and_changes_nothing():
    a = BlockAllocator(3, 4)
    b = a.allocate()
    a.free(b)
    before = snapshot(a)
    with pytest.raises(ValueError, match=f"double free: block {b}"):
        a.free(b)
    assert snapshot(a) == before


def test_freeing_a_never_allocated_block_is_a_double_free():
    a = BlockAllocator(3, 4)
    with pytest.raises(ValueError, match="block 2 is already free"):
        a.free(2)


@pytest.mark.parametrize("block_id", [-1, 3, 100])
def test_unknown_block_id_is_a_value_error_naming_it(block_id):
    a = BlockAllocator(3, 4)
    a.allocate()
    before = snapshot(a)
    with pytest.raises(ValueError, match=f"unknown block_id {block_id}"):
        a.free(block_id)
    with pytest.raises(ValueError, match=f"unknown block_id {block_id}"):
        a.is_free(block_id)
    assert snapshot(a) == before


@pytest.mark.parametrize("block_id", [1.0, "0", None, True])
def test_non_int_block_id_is_a_type_error(block_id):
    a = BlockAllocator(3, 4)
    a.allocate()
    a.allocate()
    before = snapshot(a)
    with pytest.raises(TypeError, match="block_id must be an int"):
        a.free(block_id)
    assert snapshot(a) == before


@pytest.mark.parametrize(
    "num_blocks, block_size, error, name",
    [
        (0, 16, ValueError, "num_blocks"),
        (-3, 16, ValueError, "num_blocks"),
        (4, 0, ValueError, "block_size"),
        (4, -1, ValueError, "block_size"),
        (4.0, 16, TypeError, "num_blocks"),
        (4, "16", TypeError, "block_size"),
        (True, 16, TypeError, "num_blocks"),
    ],
)
def test_bad_constructor_arguments_name_the_argument(num_blocks, block_size, error, name):
    with pytest.raises(error, match=name):
        BlockAllocator(num_blocks, block_size)


class AllocatorMachine(RuleBasedStateMachine):
    """Random allocate/free sequences against a model: the blocks we hold and the free order."""

    @initialize(num_blocks=st.integers(1, 12))
    def create(self, num_blocks):
        self.a = BlockAllocator(num_blocks, 4)
        self.held: set[int] = set()
        self.free_order = deque(range(num_blocks))  # documented: lowest first, freed ones last

    @rule()
    def allocate(self):
        if not self.free_order:
            before = snapshot(self.a)
            with pytest.raises(OutOfBlocksError):
                self.a.allocate()
            assert snapshot(self.a) == before
            return
        b = self.a.allocate()
        assert b not in self.held, f"block {b} handed out twice"
        assert b == self.free_order.popleft()
        self.held.add(b)

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def free(self, data):
        b = data.draw(st.sampled_from(sorted(self.held)))
        self.a.free(b)
        self.held.remove(b)
        self.free_order.append(b)

    @rule(data=st.data())
    def bad_free(self, data):
        n = self.a.num_blocks
        b = data.draw(st.sampled_from(list(self.free_order) + [-1, n, n + 5]))
        before = snapshot(self.a)
        with pytest.raises(ValueError):
            self.a.free(b)
        assert snapshot(self.a) == before

    @invariant()
    def every_block_is_free_or_held_never_both(self):
        assert self.a.num_free_blocks + len(self.held) == self.a.num_blocks
        for i in range(self.a.num_blocks):
            assert self.a.is_free(i) == (i not in self.held), f"block {i}"


AllocatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None
)
TestAllocatorMachine = AllocatorMachine.TestCase


def test_numpy_integers_are_accepted_as_ids_and_sizes():
    np = pytest.importorskip("numpy")
    a = BlockAllocator(np.int64(3), np.int32(4))
    b = a.allocate()
    a.free(np.int64(b))
    assert a.is_free(np.int32(b)) and type(a.num_blocks) is int
