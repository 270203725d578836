"""Checks for lesson 09's exercises (solutions by default; ``--impl exercises`` for yours).

9.1 is checked against a brute-force reading of its spec on random queues; 9.2 on shuffled
candidates. Both are also run inside the real scheduler (a fake model, tight pools), where a
wrong choice shows up as a request that never finishes or a step over its budget. Mutation
tests plant likely mistakes into the solution and check that these tests catch each one.
"""

from __future__ import annotations

import inspect
import random
import textwrap

import pytest

from paged_ref.cache_math import blocks_needed
from paged_course.checks import assert_equal
from paged_ref.engine.request import Request
from paged_ref.engine.scheduler import Scheduler
from tests.conftest import load_exercise

SEEDS = range(6)


@pytest.fixture
def ex(request):
    return load_exercise(request.config, "ex09_scheduler")


def spec_admit(lens, free, bs, budget, seats):
    """Exercise 9.1 written as directly as the spec reads."""
    n = 0
    while n < len(lens) and n < seats and budget > 0:
        chunk = min(lens[n], budget)
        if blocks_needed(chunk, bs) > free:
            break
        free, budget, n = free - blocks_needed(chunk, bs), budget - chunk, n + 1
    return n


# ---- 9.1 admit_count -------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_9_1_admit_count_matches_the_spec(ex, seed):
    rng = random.Random(seed)
    for _ in range(200):
        lens = [rng.randint(1, 60) for _ in range(rng.randint(0, 8))]
        args = (lens, rng.randint(0, 20), rng.choice([1, 4, 16]), rng.randint(0, 120),
                rng.randint(0, 6))
        assert_equal(ex.admit_count(*args), spec_admit(*args),
                     name=f"admit_count{args}")


def test_9_1_admit_count_is_first_come_first_served(ex):
    # the second request does not fit; the third would, but must not overtake it
    assert_equal(ex.admit_count([8, 40, 1], 4, 4, 100, 10), 1, name="admit_count, FCFS")


def test_9_1_admit_count_chunks_the_last_prompt(ex):
    # budget 20: 12 tokens, then an 8-token chunk of the 50 (2 blocks), then the budget is spent
    assert_equal(ex.admit_count([12, 50, 3], 5, 4, 20, 10), 2, name="admit_count, chunked")
    assert_equal(ex.admit_count([12, 50, 3], 4, 4, 20, 10), 1, name="admit_count, no blocks")


def test_9_1_admit_count_edges(ex):
    assert_equal(ex.admit_count([], 10, 4, 10, 3), 0, name="empty queue")
    assert_equal(ex.admit_count([3, 3], 10, 4, 0, 3), 0, name="no budget")
    assert_equal(ex.admit_count([3, 3], 10, 4, 10, 0), 0, name="no seats")
    assert_equal(ex.admit_count([4, 4], 2, 4, 10, 3), 2, name="exactly enough blocks")


# ---- 9.2 choose_victim -----------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_9_2_choose_victim_picks_the_latest_arrival(ex, seed):
    rng = random.Random(seed)
    ids = rng.sample(range(100), rng.randint(1, 9))
    cands = [Request(i, [1] * rng.randint(1, 30), 4) for i in ids]
    got = ex.choose_victim(cands)
    assert_equal(got, ids.index(max(ids)), name=f"choose_victim for req_ids {ids}")


def test_9_2_choose_victim_needs_a_candidate(ex):
    with pytest.raises(ValueError):
        ex.choose_victim([])


# ---- both, inside the real scheduler ---------------------------------------------------


def fake_token(req, position):
    return (sum(req.prompt) * 31 + position * 7) % 50 + 1


@pytest.mark.parametrize("seed", range(3))
def test_9_policies_drive_the_scheduler(ex, seed):
    rng = random.Random(seed)
    reqs = [Request(i, [rng.randint(1, 99) for _ in range(rng.randint(1, 30))],
                    rng.randint(1, 10)) for i in range(8)]
    s = Scheduler(10, 4, max_num_seqs=5, max_num_batched_tokens=24,
                  enable_prefix_caching=False, admit=ex.admit_count,
                  choose_victim=ex.choose_victim)
    for r in reqs:
        s.add(r)
    for _ in range(2000):
        if not s.has_work():
            break
        out = s.schedule()
        assert out.num_tokens <= 24, "a step ran more tokens than its budget"
        assert len(s.running) <= 5, "more requests run than max_num_seqs"
        new = {c.request.req_id: fake_token(c.request, c.end) for c in out.chunks if c.samples}
        s.update(out, new, frozenset())
    assert not s.has_work(), "requests never finished (livelock or lost requests)"
    for r in reqs:
        n = len(r.prompt)
        assert_equal(r.output, [fake_token(r, n + k) for k in range(r.max_new_tokens)],
                     name=f"tokens of request {r.req_id}")


# ---- mutation tests: each planted mistake must be caught ---------------------------------

MUTATIONS = {
    "admit_count": [
        ("free_blocks:\n            break", "free_blocks:\n            continue"),
        ("chunk = min(n, token_budget)", "chunk = n"),
        ("free_blocks -= need", "pass"),
        ("token_budget -= chunk", "pass"),
        ("admitted == seats", "admitted > seats"),
        ("need > free_blocks", "need >= free_blocks"),
    ],
    "choose_victim": [
        ("max(range", "min(range"),
        ("candidates[i].req_id", "len(candidates[i].prompt)"),
    ],
}


def mutate(fn, old: str, new: str):
    head, body = textwrap.dedent(inspect.getsource(fn)).split("# BEGIN SOLUTION")
    assert old in body, f"mutation target {old!r} not in {fn.__name__}'s solution"
    namespace = dict(fn.__globals__)
    exec(head + "# BEGIN SOLUTION" + body.replace(old, new, 1), namespace)
    return namespace[fn.__name__]


@pytest.mark.parametrize("name,old,new", [(n, o, w) for n, ms in MUTATIONS.items()
                                          for o, w in ms])
def test_mutations_are_caught(request, name, old, new):
    if request.config.getoption("--impl") != "solutions":
        pytest.skip("mutation tests plant mistakes into the solutions")
    import solutions.ex09_scheduler as sol

    class Mutant:
        admit_count = staticmethod(sol.admit_count)
        choose_victim = staticmethod(sol.choose_victim)

    setattr(Mutant, name, staticmethod(mutate(getattr(sol, name), old, new)))
    checks = [test_9_1_admit_count_matches_the_spec,
              test_9_1_admit_count_is_first_come_first_served,
              test_9_1_admit_count_chunks_the_last_prompt, test_9_1_admit_count_edges]
    if name == "choose_victim":
        checks = [test_9_2_choose_victim_picks_the_latest_arrival]
    caught = False
    for check in checks:
        try:
            if "seed" in inspect.signature(check).parameters:
                for seed in SEEDS:
                    check(Mutant, seed)
            else:
                check(Mutant)
        except (AssertionError, Exception):
            caught = True
            break
    assert caught, f"the tests did not catch the mutation {old!r} -> {new!r} in {name}"
