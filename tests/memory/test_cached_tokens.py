"""``KVCacheManager.num_cached_tokens``: how many leading prompt tokens ``add_sequence`` would
share now, asked without side effects (what the prefix-aware scheduler orders by).

On random runs of prompts that share prefixes (adds, appends, frees, evictions, a host tier or
none), at random moments: the answer equals what ``add_sequence`` then returns, asking changes
nothing observable (free blocks, tables, cached entries and their eviction order, the hit
counters, owed moves), and a kept memo of hashes gives the same answers as none. Then the
likely mistakes are planted (no cap at ``len - 1``, blocks hashed without their parent, the
host tier ignored, cached blocks counted past a gap) and a check must fail.
"""

from __future__ import annotations

import random

import pytest

from paged_ref import KVCacheManager, OutOfBlocksError
from paged_ref.memory import allocator as allocator_module
from paged_ref.memory import manager as manager_module
from paged_ref.memory import prefix_cache as prefix_module
from paged_ref.memory.prefix_cache import hash_block_tokens
from tests.mutations.mutate import mutant_of


def observable(m: KVCacheManager):
    """All a query could disturb."""
    return (m.num_free_blocks, {s: (m.block_table(s), m.seq_len(s)) for s in m.seq_ids},
            m.cached_blocks(), m.allocator.evictable_blocks(), m.stats(),
            list(m._copies), m._owed_targets())


def prompts_sharing(rng: random.Random, bs: int) -> list[list[int]]:
    """A few stems (some a whole number of blocks long) and prompts that extend them."""
    stems = [[rng.randint(0, 50) for _ in range(rng.choice([bs, 2 * bs, 3 * bs + 1, 5]))]
             for _ in range(3)]
    out = []
    for _ in range(12):
        p = list(rng.choice(stems))
        if rng.random() < 0.7:
            p += [rng.randint(0, 50) for _ in range(rng.randint(0, 2 * bs))]
        out.append(p)
    return out


def check_answers_are_add_sequences(manager_cls, seeds=range(12)):
    for seed in seeds:
        rng = random.Random(seed)
        bs = rng.choice([2, 4])
        m = manager_cls(rng.randint(6, 14), bs, enable_prefix_caching=True,
                        num_host_blocks=rng.choice([0, 0, 4]))
        prompts, memos, live, next_id = prompts_sharing(rng, bs), {}, [], 0
        for _ in range(120):
            op = rng.random()
            if op < 0.45:  # ask, then add: the answer is the hit
                i = rng.randrange(len(prompts))
                before = observable(m)
                plain = m.num_cached_tokens(prompts[i])
                memo = m.num_cached_tokens(prompts[i], memos.setdefault(i, []))
                assert observable(m) == before, f"seed {seed}: asking changed the manager"
                assert plain == memo, f"seed {seed}: the memo changed the answer"
                try:
                    got = m.add_sequence(next_id, token_ids=prompts[i])
                except OutOfBlocksError:
                    continue
                assert got == plain, f"seed {seed}: asked {plain}, add_sequence shared {got}"
                live.append(next_id)
                next_id += 1
            elif op < 0.75 and live:
                s = rng.choice(live)
                try:
                    m.append_slot(s, rng.randint(0, 50))
                except OutOfBlocksError:
                    pass
            elif live:
                m.free_sequence(live.pop(rng.randrange(len(live))))
            m.take_block_ops()  # (the step's moves handed out, as the engine does)


def check_host_hits_count(manager_cls):
    """A prefix spilled to the host tier is cached too: add_sequence copies it back."""
    m = manager_cls(4, 2, enable_prefix_caching=True, num_host_blocks=4)
    rng = random.Random(1)
    prompt = [rng.randint(0, 50) for _ in range(7)]  # 3 full blocks
    m.add_sequence("a", token_ids=prompt)
    m.free_sequence("a")
    m.add_sequence("b", token_ids=[rng.randint(51, 99) for _ in range(8)])  # evicts all 4
    m.take_block_ops()
    assert m.cached_prefix_blocks(prompt) == [], "the prefix left the device"
    m.free_sequence("b")
    assert m.num_cached_tokens(prompt) == 6 == m.add_sequence("c", token_ids=prompt)


def check_edges(manager_cls):
    rng = random.Random(2)
    prompt = [rng.randint(0, 50) for _ in range(8)]
    off = manager_cls(8, 4)
    off.add_sequence("a", token_ids=prompt)
    assert off.num_cached_tokens(prompt) == 0, "prefix caching off: nothing is cached"
    m = manager_cls(8, 4, enable_prefix_caching=True)
    assert m.num_cached_tokens([]) == 0 and m.num_cached_tokens(prompt) == 0
    m.add_sequence("a", token_ids=prompt)
    assert m.num_cached_tokens(prompt) == 4, "at least one token is left to compute"
    assert m.num_cached_tokens(prompt + [1]) == 8
    assert m.num_cached_tokens(prompt[:4] + [99] + prompt[5:] + [1]) == 4
    memo: list[bytes] = []
    assert m.num_cached_tokens(prompt + [1], memo) == 8 and len(memo) == 2
    assert memo[1] == hash_block_tokens(memo[0], prompt[4:])


def check_cached_run(alloc_module):
    a = alloc_module.BlockAllocator(6, 2)
    hashes = [bytes([i]) * 32 for i in range(4)]
    for i in (0, 2, 3):
        a.cache_block(a.allocate(), hashes[i])
    assert a.cached_run(hashes) == 1, "a run stops at the first block not cached"
    assert a.cached_run(hashes[2:]) == 2 and a.cached_run([]) == 0


MANAGER_CHECKS = [check_answers_are_add_sequences, check_host_hits_count, check_edges]


@pytest.mark.parametrize("check", MANAGER_CHECKS, ids=lambda c: c.__name__)
def test_num_cached_tokens(check):
    check(KVCacheManager)


def test_cached_run():
    check_cached_run(allocator_module)


PREFIX_MUTATIONS = [
    ("no cap: a whole cached prompt counts all its tokens",
     [("limit = (len(tokens) - 1) // bs if tokens else 0", "limit = len(tokens) // bs")]),
    ("blocks hashed without their parent",
     [("hash_block_tokens(hashes[-1] if n else None,\n", "hash_block_tokens(None,\n")]),
    ("the host tier ignored",
     [("self.allocator.cached_run(hashes[n:limit]) if host is None",
       "self.allocator.cached_run(hashes[n:limit]) if True")]),
    ("the memo read past what it covers",
     [("            if n == len(hashes):\n", "            if n >= len(hashes) - 1:\n")]),
]


@pytest.mark.parametrize("description, edits", PREFIX_MUTATIONS,
                         ids=[m[0] for m in PREFIX_MUTATIONS])
def test_planted_mistake_in_the_query_is_caught(description, edits, tmp_path, monkeypatch):
    mutant = mutant_of(prefix_module, edits, tmp_path, monkeypatch)
    monkeypatch.setattr(manager_module, "PrefixCache", mutant.PrefixCache)
    failed = 0
    for check in MANAGER_CHECKS:
        try:
            check(KVCacheManager)
        except (AssertionError, IndexError):
            failed += 1
    assert failed, f"no check caught {description!r}"


def test_planted_gap_in_the_run_is_caught(tmp_path, monkeypatch):
    mutant = mutant_of(allocator_module, [(
        "return len(list(itertools.takewhile(self._block_of.__contains__, hashes)))",
        "return sum(h in self._block_of for h in hashes)")], tmp_path, monkeypatch)
    with pytest.raises(AssertionError):
        check_cached_run(mutant)
