"""Checks for lesson 02's exercises (solutions by default; ``--impl exercises`` for yours).

Every test draws fresh random cases from a fixed seed and reports what differs, expected vs got.
"""

from __future__ import annotations

import random

import pytest

from paged_ref import OutOfBlocksError
from paged_course.checks import assert_equal
from tests.conftest import load_exercise

SEEDS = range(5)


@pytest.fixture
def ex(request):
    return load_exercise(request.config, "ex02_block_allocator")


class ShuffledAllocator:
    """A stand-in allocator for 2.4: hands out distinct block ids in a random order."""

    def __init__(self, rng: random.Random, num_blocks: int):
        self.ids = list(range(num_blocks))
        rng.shuffle(self.ids)
        self.calls = 0

    def allocate(self) -> int:
        if not self.ids:
            raise OutOfBlocksError("test allocator is empty")
        self.calls += 1
        return self.ids.pop()


def expected_slot(table: list[int], pos: int, block_size: int) -> int:
    return table[pos // block_size] * block_size + pos % block_size


# ---- 2.1 allocate ------------------------------------------------------------------------


@pytest.mark.parametrize("num_blocks", [1, 3, 8])
def test_2_1_allocate_hands_out_every_block_once(ex, num_blocks):
    a = ex.SimpleBlockAllocator(num_blocks)
    got = [a.allocate() for _ in range(num_blocks)]
    assert_equal(sorted(got), list(range(num_blocks)), name="sorted ids from allocate()")
    assert_equal(a.num_free_blocks, 0, name="num_free_blocks after taking every block")


def assert_in_step(a, when: str) -> None:
    """The allocator's two views of the free blocks agree: every id in both or in neither."""
    assert_equal(sorted(a._free_set), sorted(a._free_list),
                 name=f"free block ids: _free_set vs _free_list {when}")


@pytest.mark.parametrize("num_blocks", [1, 4])
def test_2_1_allocate_keeps_the_free_set_in_step(ex, num_blocks):
    a = ex.SimpleBlockAllocator(num_blocks)
    for i in range(num_blocks):
        block = a.allocate()
        assert block not in a._free_set, (
            f"allocate() returned block {block} but left it in _free_set: free() would then "
            f"call it 'already free' and a later allocate() could hand it out twice"
        )
        assert_in_step(a, f"after allocate() number {i + 1}")


def test_2_1_allocate_raises_out_of_blocks_when_empty(ex):
    a = ex.SimpleBlockAllocator(2)
    a.allocate()
    a.allocate()
    with pytest.raises(OutOfBlocksError) as info:
        a.allocate()
    assert "2" in str(info.value), f"the message should give the pool size: {info.value!r}"
    assert_equal(a.num_free_blocks, 0, name="num_free_blocks after OutOfBlocksError")


# ---- 2.2 free ----------------------------------------------------------------------------


def take(a, block_ids) -> None:
    """Mark ``block_ids`` in use through the given state, so 2.2 is checked without 2.1."""
    for b in block_ids:
        a._free_list.remove(b)
        a._free_set.remove(b)


def test_2_2_free_gives_blocks_back(ex):
    a = ex.SimpleBlockAllocator(5)
    take(a, [1, 3, 4])
    a.free(3)
    assert_equal(a.num_free_blocks, 3, name="num_free_blocks after free(3) with 2 blocks held")
    a.free(1)
    assert_equal(a.num_free_blocks, 4, name="num_free_blocks after free(1)")
    assert_equal(sorted(a._free_set), [0, 1, 2, 3], name="free block ids (_free_set)")
    assert_equal(sorted(a._free_list), [0, 1, 2, 3], name="free block ids (_free_list)")


@pytest.mark.parametrize("block_id", [0, 2])
def test_2_2_double_free_raises_and_changes_nothing(ex, block_id):
    a = ex.SimpleBlockAllocator(3)
    take(a, [1])
    with pytest.raises(ValueError):
        a.free(block_id)  # never handed out: already free
    assert_equal(a.num_free_blocks, 2, name=f"num_free_blocks after a rejected free({block_id})")
    assert_equal(sorted(a._free_list), [0, 2], name="free block ids after a rejected free")


@pytest.mark.parametrize("block_id", [-1, 3, 10])
def test_2_2_unknown_block_raises_and_changes_nothing(ex, block_id):
    a = ex.SimpleBlockAllocator(3)
    take(a, [0])
    with pytest.raises(ValueError):
        a.free(block_id)
    assert_equal(a.num_free_blocks, 2, name=f"num_free_blocks after free({block_id})")


@pytest.mark.parametrize("seed", SEEDS)
def test_2_1_and_2_2_allocate_and_free_in_random_order(ex, seed):
    """Random allocate/free calls against a model: the set of blocks we hold."""
    rng = random.Random(seed)
    num_blocks = rng.randint(1, 10)
    a = ex.SimpleBlockAllocator(num_blocks)
    held: set[int] = set()
    for step in range(40):
        if held and rng.random() < 0.45:
            block = rng.choice(sorted(held))
            a.free(block)
            held.remove(block)
        elif len(held) < num_blocks:
            block = a.allocate()
            assert 0 <= block < num_blocks, f"step {step}: block id {block} out of range"
            assert block not in held, (
                f"step {step}: allocate() returned block {block}, which is still in use "
                f"(held: {sorted(held)})"
            )
            held.add(block)
        else:
            with pytest.raises(OutOfBlocksError):
                a.allocate()
        assert_equal(a.num_free_blocks, num_blocks - len(held),
                     name=f"num_free_blocks after step {step}")
        assert_in_step(a, f"after step {step}")


# ---- 2.3 blocks_needed -------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_2_3_blocks_needed(ex, seed):
    rng = random.Random(seed)
    cases = [(0, 16), (1, 16), (16, 16), (17, 16), (5, 1)]
    cases += [(rng.randint(0, 500), rng.randint(1, 64)) for _ in range(50)]
    cases += [(2**60 + 1, 2**30)]  # float rounding would give the wrong answer here
    got = [ex.blocks_needed(n, bs) for n, bs in cases]
    expected = [-(-n // bs) for n, bs in cases]
    for (n, bs), g, e in zip(cases, got, expected, strict=True):
        assert_equal(g, e, name=f"blocks_needed({n}, {bs})")


# ---- 2.4 append_slot ---------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_2_4_append_slot_grows_a_sequence_token_by_token(ex, seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 16])
    alloc = ShuffledAllocator(rng, num_blocks=64)
    table: list[int] = []
    for pos in range(rng.randint(1, 40)):
        calls_before, table_before = alloc.calls, list(table)
        slot = ex.append_slot(table, pos, block_size, alloc)
        new_block = pos % block_size == 0
        assert_equal(alloc.calls - calls_before, int(new_block),
                     name=f"allocate() calls for the token at position {pos} "
                          f"(block_size {block_size})")
        assert_equal(table[: len(table_before)], table_before,
                     name=f"existing block table entries after position {pos}")
        assert_equal(len(table), -(-(pos + 1) // block_size),
                     name=f"len(block_table) after position {pos}")
        assert_equal(slot, expected_slot(table, pos, block_size),
                     name=f"slot of the token at position {pos} (block table {table})")


def test_2_4_append_slot_leaves_the_table_alone_when_out_of_blocks(ex):
    alloc = ShuffledAllocator(random.Random(0), num_blocks=1)
    table = [alloc.allocate()]
    with pytest.raises(OutOfBlocksError):
        ex.append_slot(table, 4, 4, alloc)
    assert_equal(len(table), 1, name="len(block_table) after OutOfBlocksError")


# ---- 2.5 slot_mapping --------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_2_5_slot_mapping(ex, seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 3, 4, 16])
    num_blocks = rng.randint(1, 8)
    table = rng.sample(range(100), num_blocks)  # shuffled physical blocks
    positions = [rng.randrange(num_blocks * block_size) for _ in range(rng.randint(0, 30))]
    got = ex.slot_mapping(table, positions, block_size)
    expected = [expected_slot(table, p, block_size) for p in positions]
    assert_equal(list(got), expected,
                 name=f"slot_mapping({table}, positions, {block_size})")


def test_2_5_slot_mapping_worked_example(ex):
    assert_equal(ex.slot_mapping([5, 2], [0, 1, 4, 6], 4), [20, 21, 8, 10],
                 name="slot_mapping([5, 2], [0, 1, 4, 6], 4)")
