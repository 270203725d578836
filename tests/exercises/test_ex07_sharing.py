"""Checks for lesson 07's exercises (solutions by default; ``--impl exercises`` for yours).

Each exercise is checked alone, so it can be checked as soon as the lesson asks for it: the
cache's other exercise methods are the worked solution's (``checked``), and its state is set
up by hand (``make_cache``). After every change, ``check_state`` verifies the bookkeeping:
each block is held, evictable or free, never two of these; reference counts equal the number
of tables that list a block.
"""

from __future__ import annotations

import random

import pytest

from paged_ref import OutOfBlocksError
from paged_course.checks import assert_equal
from tests.conftest import load_exercise, reference_exercise

SEEDS = range(4)
NAME = "ex07_sharing"
#: SharingCache's exercise methods, 7.1 to 7.8.
METHODS = ("fork", "release", "free_sequence", "append_slot", "hash_block", "lookup", "allocate",
           "share")


@pytest.fixture
def ex(request):
    return load_exercise(request.config, NAME)


def checked(ex, *mine: str) -> type:
    """``ex.SharingCache`` whose exercise methods are the worked solution's, except ``mine``:
    7.4's check (``append_slot``, which calls 7.7's ``allocate`` and 7.2's ``release``) passes
    as soon as 7.4 is right, before the learner has written 7.7."""
    unknown = set(mine) - set(METHODS)
    assert not unknown, f"not exercise methods: {unknown}"
    reference = vars(reference_exercise(NAME).SharingCache)
    given = {m: reference[m] for m in METHODS if m not in mine}
    return type("SharingCache", (ex.SharingCache,), given)


def make_cache(cls, num_blocks, block_size, tables=None, cached=None):
    """A ``cls`` (a ``SharingCache`` from :func:`checked`) holding ``tables`` (seq -> (table, length)) and ``cached`` blocks
    (block -> hash; those nobody holds become evictable, in the order given)."""
    c = cls(num_blocks, block_size)
    for seq, (table, length) in (tables or {}).items():
        c.tables[seq], c.lens[seq] = list(table), length
        for b in table:
            c.ref_counts[b] += 1
    for b, h in (cached or {}).items():
        c.hash_of[b], c.block_of[h] = h, b
    c.free_list.clear()
    for b in range(num_blocks):
        if c.ref_counts[b] == 0:
            if b in c.hash_of:
                c.evictable[b] = None
            else:
                c.free_list.append(b)
    return c


def check_state(c, where: str) -> None:
    """Every block is in exactly one state and reference counts match the tables."""
    n = len(c.ref_counts)
    holders = [0] * n
    for table in c.tables.values():
        for b in table:
            holders[b] += 1
    assert_equal(list(c.ref_counts), holders, name=f"{where}: ref_counts (vs holders in tables)")
    free, evictable = list(c.free_list), list(c.evictable)
    assert len(set(free)) == len(free), f"{where}: a block is twice in free_list: {free}"
    both = set(free) & set(evictable)
    assert not both, f"{where}: blocks {sorted(both)} are both free and evictable"
    held = {b for b in range(n) if holders[b]}
    assert not held & set(free), f"{where}: held blocks {sorted(held & set(free))} are free"
    assert not held & set(evictable), (
        f"{where}: held blocks {sorted(held & set(evictable))} are evictable (could be evicted)")
    assert_equal(len(held) + len(free) + len(evictable), n,
                 name=f"{where}: held + free + evictable blocks")
    assert_equal(c.num_free_blocks, len(free) + len(evictable), name=f"{where}: num_free_blocks")
    assert all(b in c.hash_of for b in evictable), f"{where}: an evictable block has no hash"
    assert_equal({h: b for b, h in c.hash_of.items()}, c.block_of,
                 name=f"{where}: block_of (the inverse of hash_of)")


# ---- 7.1-7.3 reference counts ----------------------------------------------------------------


def test_7_1_fork_shares_every_block(ex):
    c = make_cache(checked(ex, "fork"), 8, 4, {"p": ([5, 2, 7], 10)})
    c.fork("p", "c")
    assert_equal(c.tables["c"], [5, 2, 7], name="child's table")
    assert_equal(c.lens["c"], 10, name="child's length")
    assert_equal([c.ref_counts[b] for b in (5, 2, 7)], [2, 2, 2], name="ref counts after fork")
    assert_equal(c.num_free_blocks, 5, name="num_free_blocks (a fork takes no block)")
    c.tables["c"].append(0)
    assert_equal(c.tables["p"], [5, 2, 7], name="parent's table after the child's changed "
                 "(the child needs its own list)")


def test_7_2_release_last_holder_frees_or_keeps_cached(ex):
    c = make_cache(checked(ex, "release"), 6, 2, {"a": ([0, 1, 2], 6), "b": ([0], 2)}, cached={0: b"h0", 1: b"h1"})
    c.release(0)  # b's hold on 0: a still holds it
    del c.tables["b"], c.lens["b"]
    check_state(c, "after release(0) with another holder left")
    c.tables["a"] = []
    c.release(2)
    c.release(1)
    c.release(0)
    del c.tables["a"]
    check_state(c, "after releasing all of a")
    assert_equal(list(c.free_list)[-1], 2, name="uncached block 2 goes to the end of free_list")
    assert_equal(list(c.evictable), [1, 0], name="evictable (LRU first): cached blocks 1, 0")
    assert_equal(c.num_free_blocks, 6, name="num_free_blocks when nobody holds anything")


def test_7_3_free_sequence_keeps_blocks_a_fork_holds(ex):
    c = make_cache(checked(ex, "free_sequence"), 8, 2, {"p": ([3, 4, 6], 5), "c": ([3, 4, 1], 6)},
                   cached={3: b"h3", 4: b"h4"})
    c.free_sequence("c")
    check_state(c, "after free_sequence('c')")
    assert "c" not in c.tables and "c" not in c.lens, "free_sequence must forget the sequence"
    assert_equal([c.ref_counts[b] for b in (3, 4, 6)], [1, 1, 1], name="p's blocks' ref counts")
    c.free_sequence("p")
    check_state(c, "after free_sequence('p')")
    assert_equal(list(c.evictable), [4, 3], name="evictable: released last to first")


@pytest.mark.parametrize("seed", SEEDS)
def test_7_1_7_2_7_3_random_forks_and_frees(ex, seed):
    rng = random.Random(seed)
    c = make_cache(checked(ex, "fork", "release", "free_sequence"), 12, 2, {0: ([0, 1, 2], 5)}, cached={0: b"a", 1: b"b"})
    for step in range(30):
        if c.tables and (rng.random() < 0.4 or len(c.tables) > 5):
            c.free_sequence(rng.choice(sorted(c.tables)))
        elif c.tables:
            c.fork(rng.choice(sorted(c.tables)), 100 + step)
        check_state(c, f"step {step}")


# ---- 7.4 copy-on-write -------------------------------------------------------------------


def test_7_4_in_place_and_new_block(ex):
    c = make_cache(checked(ex, "append_slot"), 4, 2, {"a": ([3], 1)})
    assert_equal(c.append_slot("a"), 3 * 2 + 1, name="slot of token 1 (in place)")
    assert_equal(c.append_slot("a"), 0 * 2 + 0, name="slot of token 2 (a new block: 0)")
    assert_equal(c.copies, [], name="copies (nothing is shared)")
    check_state(c, "after two appends")


def test_7_4_write_into_a_shared_block_copies_it_first(ex):
    c = make_cache(checked(ex, "append_slot"), 6, 4, {"p": ([4, 5], 6), "c": ([4, 5], 6)})
    slot = c.append_slot("c")
    fresh = c.tables["c"][1]
    assert fresh != 5, "the writer wrote into block 5, which 'p' also holds"
    assert_equal(slot, fresh * 4 + 2, name="slot of the child's token 6")
    assert_equal(c.copies, [(5, fresh)], name="copies owed (src, dst)")
    assert_equal(c.tables["p"], [4, 5], name="parent's table (unchanged)")
    check_state(c, "after the copy-on-write")
    assert_equal(c.append_slot("p"), 5 * 4 + 2, name="parent's slot: now the only holder, "
                 "it writes in place")
    assert_equal(len(c.copies), 1, name="number of copies (the parent needed none)")


def test_7_4_full_shared_block_needs_no_copy(ex):
    c = make_cache(checked(ex, "append_slot"), 6, 2, {"p": ([1], 2), "c": ([1], 2)})
    assert_equal(c.append_slot("c"), 0, name="slot of token 2 (new block 0)")
    assert_equal(c.copies, [], name="copies (a full block is never written)")


def test_7_4_out_of_blocks_changes_nothing(ex):
    c = make_cache(checked(ex, "append_slot"), 2, 2, {"p": ([0], 1), "c": ([0], 1), "d": ([1], 2)})
    before = (dict(c.tables), dict(c.lens), list(c.ref_counts), list(c.copies))
    with pytest.raises(OutOfBlocksError):
        c.append_slot("c")
    assert_equal((dict(c.tables), dict(c.lens), list(c.ref_counts), list(c.copies)), before,
                 name="state after OutOfBlocksError")


@pytest.mark.parametrize("seed", SEEDS)
def test_7_4_random_forks_and_appends_keep_every_sequence_intact(ex, seed):
    """Simulated K/V: each slot holds a token; copies run before the writes of a step."""
    rng = random.Random(seed)
    bs = rng.randint(2, 4)
    c = make_cache(checked(ex, "append_slot"), 40, bs, {0: ([0], 1)})
    memory = {0: ["t0"] + [None] * (bs - 1)}
    tokens = {0: ["t0"]}
    for step in range(40):
        seq = rng.choice(sorted(c.tables))
        if rng.random() < 0.3 and len(c.tables) < 6:
            c.fork(seq, 100 + step)
            tokens[100 + step] = list(tokens[seq])
            continue
        slot = c.append_slot(seq)
        for src, dst in c.copies:
            memory[dst] = list(memory[src])
        c.copies.clear()
        block, offset = divmod(slot, bs)
        others = [s for s, t in c.tables.items() if s != seq and block in t]
        assert not others, f"step {step}: {seq} writes into block {block}, held by {others}"
        memory.setdefault(block, [None] * bs)[offset] = f"t{step}"
        tokens[seq].append(f"t{step}")
        for s, table in c.tables.items():
            got = [memory[table[p // bs]][p % bs] for p in range(c.lens[s])]
            assert_equal(got, tokens[s], name=f"step {step}: tokens read back for sequence {s}")
    check_state(c, "after random forks and appends")


# ---- 7.5-7.6 the prefix cache ----------------------------------------------------------------


def test_7_5_hash_block_chains_over_the_parent(ex):
    a = ex.hash_block(None, [1, 2])
    assert isinstance(a, bytes) and len(a) == 32, f"expected 32 bytes (sha256), got {a!r}"
    assert ex.hash_block(None, [1, 2]) == a, "the hash must be deterministic"
    assert ex.hash_block(None, [2, 1]) != a, "token order must change the hash"
    assert ex.hash_block(a, [3, 4]) != ex.hash_block(None, [3, 4]), (
        "same tokens after a different prefix must hash differently (include the parent)")
    assert ex.hash_block(a, [3, 4]) != ex.hash_block(ex.hash_block(None, [9, 9]), [3, 4]), (
        "the parent's hash must be part of the block's hash")
    assert ex.hash_block(None, [12, 3]) != ex.hash_block(None, [1, 23]), "token boundaries"


def _cache_prompt(c, tokens, first_block):
    """Register the full blocks of ``tokens`` as cached in blocks first_block, +1, ..."""
    h = None
    for j in range(len(tokens) // c.block_size):
        h = c.hash_block(h, tokens[j * c.block_size:(j + 1) * c.block_size])
        c.hash_of[first_block + j], c.block_of[h] = h, first_block + j


def test_7_6_lookup_finds_the_longest_cached_chain(ex):
    c = checked(ex, "lookup")(16, 2)
    _cache_prompt(c, [1, 2, 3, 4, 5, 6], first_block=0)  # blocks 0, 1, 2
    _cache_prompt(c, [7, 7, 3, 4], first_block=8)  # blocks 8, 9: [3, 4] after [7, 7]
    assert_equal(c.lookup([1, 2, 3, 4, 5, 6, 9]), [0, 1, 2], name="lookup of a longer prompt")
    assert_equal(c.lookup([1, 2, 3, 4, 9, 9, 9]), [0, 1], name="lookup stops at a miss")
    assert_equal(c.lookup([1, 2, 3, 4, 5, 6]), [0, 1],
                 name="lookup of exactly the cached prompt (leave >= 1 token to compute)")
    assert_equal(c.lookup([7, 7, 3, 4, 1]), [8, 9], name="lookup of the second prompt")
    assert_equal(c.lookup([9, 9, 3, 4, 5]), [], name="lookup with a new first block")
    assert_equal(c.lookup([1]), [], name="lookup of a one-token prompt")
    del c.block_of[c.hash_of.pop(1)]  # block 1 evicted; block 2 (after it) still cached
    assert_equal(c.lookup([1, 2, 3, 4, 5, 6, 9]), [0], name="lookup after the middle block "
                 "was evicted (a chain with a gap stops at the gap)")


def test_7_6_same_block_after_another_prefix_is_a_miss(ex):
    c = checked(ex, "lookup")(16, 2)
    _cache_prompt(c, [1, 2, 3, 4], first_block=0)  # [3, 4] cached after [1, 2]
    _cache_prompt(c, [5, 6], first_block=4)  # [5, 6] cached as a first block
    assert_equal(c.lookup([5, 6, 3, 4, 0]), [4], name="lookup: [3, 4] after [5, 6] is not "
                 "the cached [3, 4] (that one followed [1, 2])")


# ---- 7.7-7.8 eviction ------------------------------------------------------------------------


def test_7_7_allocate_free_blocks_before_evicting(ex):
    c = make_cache(checked(ex, "allocate"), 4, 2, {"a": ([1], 2)}, cached={2: b"x", 3: b"y"})  # 0 free; 2, 3 evictable
    assert_equal(c.allocate(), 0, name="first allocate (the free block)")
    assert_equal(c.allocate(), 2, name="second allocate (evicts the least recently used: 2)")
    assert b"x" not in c.block_of and 2 not in c.hash_of, "an evicted block must lose its hash"
    assert_equal(c.ref_counts[2], 1, name="ref count of the evicted, now allocated block")
    c.tables["z"], c.lens["z"] = [0, 2], 4
    check_state(c, "after two allocations")
    assert_equal(c.allocate(), 3, name="third allocate")
    c.tables["z"].append(3)
    with pytest.raises(OutOfBlocksError):
        c.allocate()
    check_state(c, "after OutOfBlocksError")


def test_7_8_share_revives_an_evictable_block(ex):
    c = make_cache(checked(ex, "share"), 3, 2, {"a": ([0], 2)}, cached={1: b"x", 2: b"y"})
    c.share(2)  # a hit on evictable block 2
    c.tables["b"], c.lens["b"] = [2], 2
    check_state(c, "after share(2) of an evictable block")
    c.share(0)
    c.tables["c"], c.lens["c"] = [0], 2
    check_state(c, "after share(0) of a held block")
    assert_equal(c.allocate(), 1, name="allocate (the only unheld block)")
    with pytest.raises(OutOfBlocksError):
        c.allocate()  # 0 and 2 are held: neither may be evicted


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mine", [("hash_block", "lookup"), ("allocate", "share")],
                         ids=["7_5_7_6", "7_7_7_8"])
def test_random_prompts_with_a_shared_start(ex, mine, seed):
    """Prompts that share a start come and go; hits are shared, nothing held is evicted.
    Run once with the learner's prefix cache (7.5, 7.6), once with their pool (7.7, 7.8)."""
    rng = random.Random(seed)
    c = checked(ex, *mine)(10, 2)
    system = [1, 2, 3, 4]
    prompts = {}
    for step in range(40):
        if prompts and (rng.random() < 0.45 or len(prompts) > 3):
            seq = rng.choice(sorted(prompts))
            c.free_sequence(seq)
            del prompts[seq]
        else:
            tokens = system[: rng.choice([0, 2, 4])] + [rng.randint(5, 7) for _ in range(3)]
            try:
                cached = c.add_sequence(step, tokens)
            except OutOfBlocksError:
                continue
            prompts[step] = tokens
            assert cached % 2 == 0 and cached < len(tokens), f"cached {cached} of {tokens}"
            for j in range(cached // 2):  # a hit's block holds the same prefix
                b = c.tables[step][j]
                for s, t in c.tables.items():
                    if s != step and j < len(t) and t[j] == b:
                        assert_equal(prompts[s][: 2 * (j + 1)], tokens[: 2 * (j + 1)],
                                     name=f"step {step}: prefix of prompt {s}, sharing block {b}")
        check_state(c, f"step {step}")
