"""Prefix-aware admission (``scheduling_policy="prefix"``, :func:`policy.admission_order`).

The pure function against its spec written another way, on random queues; the aging bound as a
starvation test (a request with nothing cached, behind a constant stream of requests whose
prompts are cached, is admitted right after ``max_overtakes`` of them), on the function alone
and through the real scheduler; the scheduler's outputs unchanged by the order. Then the likely
mistakes are planted (shortest prefix first, aging ignored, the aged sorted by prefix too, an
off-by-one in the bound) and each check must fail.
"""

from __future__ import annotations

import random

import pytest

from paged_ref.cache_math import blocks_needed
from paged_ref.engine import policy as real_policy
from paged_ref.engine import scheduler as scheduler_module
from paged_ref.engine.request import Request
from paged_ref.engine.scheduler import Scheduler
from tests.engine.test_scheduler import expected, run
from tests.mutations.mutate import mutant_of

BS = 4


def spec_order(cached, overtaken, bound):
    """The order as the docstring reads: the aged in queue order, then the rest by cached
    tokens, most first, ties in queue order (a stable sort)."""
    aged = [i for i in range(len(cached)) if overtaken[i] >= bound]
    rest = [i for i in range(len(cached)) if overtaken[i] < bound]
    rest.sort(key=lambda i: -cached[i])
    return aged + rest


def check_matches_the_spec(policy):
    rng = random.Random(5)
    for _ in range(400):
        n = rng.randint(0, 12)
        cached = [rng.choice([0, 16, 32, rng.randrange(0, 400, 16)]) for _ in range(n)]
        overtaken = [rng.randint(0, 6) for _ in range(n)]
        bound = rng.randint(0, 6)
        got = policy.admission_order(cached, overtaken, bound)
        assert got == spec_order(cached, overtaken, bound), (cached, overtaken, bound, got)
    assert policy.admission_order([0, 48, 16, 48], [0, 0, 0, 0], 8) == [1, 3, 2, 0]
    assert policy.admission_order([0, 48, 16], [8, 0, 9], 8) == [0, 2, 1], "aged: queue order"


def check_starvation_bound(policy):
    """One seat a step; every step a new request with a long cached prefix arrives. The
    request with nothing cached (arrival 0) is admitted right after ``bound`` later ones."""
    rng = random.Random(11)
    for bound in (0, 1, 3, 8, 20):
        waiting = [(0, 0)]  # (arrival, cached tokens); overtaken counts beside
        overtaken = [0]
        for step in range(1, 10 * bound + 20):
            waiting.append((step, rng.randrange(64, 512, 16)))
            overtaken.append(0)
            first = policy.admission_order([c for _, c in waiting], overtaken, bound)[0]
            arrival, _ = waiting.pop(first)
            overtaken.pop(first)
            if arrival == 0:
                assert step == bound + 1, f"bound {bound}: admitted at step {step}"
                break
            overtaken = [k + (arrival > a) for k, (a, _) in zip(overtaken, waiting, strict=True)]
        else:
            raise AssertionError(f"bound {bound}: the uncached request starved")


def check_scheduler_bound(policy, monkeypatch):
    """The same through the real scheduler: one seat, each request done in its admission
    step; the victim (a prompt nothing shares) is admitted after exactly ``bound`` requests
    that arrived after it and hit the warm prefix."""
    monkeypatch.setattr(scheduler_module, "policy", policy)
    rng = random.Random(3)
    prefix = [rng.randint(1, 99) for _ in range(6 * BS)]
    for bound in (2, 5):
        s = Scheduler(64, BS, max_num_seqs=1, scheduling_policy="prefix", max_overtakes=bound)
        ids = iter(range(10**6))
        run(s, [Request(next(ids), prefix + [7], 1)])  # warms the cache
        victim = Request(next(ids), [rng.randint(1, 99) for _ in range(5 * BS)], 1)
        s.add(victim)
        order = []
        for _ in range(3 * bound + 5):
            s.add(Request(next(ids), prefix + [rng.randint(1, 99) for _ in range(3)], 1))
            out = s.schedule()
            order += out.admitted
            s.update(out, {c.request.req_id: 5 for c in out.chunks if c.samples})
            if victim in order:
                break
        assert victim in order, f"bound {bound}: the uncached request starved"
        assert order.index(victim) == bound, f"bound {bound}: admitted {order.index(victim)}th"
        assert all(r.num_computed > 0 or r is victim for r in order), "hits were not hits"


def check_scheduler_prefers_the_cached(policy, monkeypatch):
    """With one seat, the later request whose prompt is cached goes before the earlier one
    whose prompt is not (and first come, first served does the opposite)."""
    monkeypatch.setattr(scheduler_module, "policy", policy)
    rng = random.Random(9)
    prefix = [rng.randint(1, 99) for _ in range(4 * BS)]
    firsts = {}
    for name in ("fcfs", "prefix"):
        s = Scheduler(64, BS, max_num_seqs=1, scheduling_policy=name)
        run(s, [Request(0, prefix + [1, 2], 1)])
        cold, warm = Request(1, [rng.randint(1, 99) for _ in range(9)], 1), Request(
            2, prefix + [3], 1)
        s.add(cold)
        s.add(warm)
        firsts[name] = s.schedule().admitted
    assert firsts["fcfs"][0].req_id == 1
    assert firsts["prefix"][0].req_id == 2 and firsts["prefix"][0].num_computed == 4 * BS


CHECKS = [check_matches_the_spec, check_starvation_bound]
SCHEDULER_CHECKS = [check_scheduler_bound, check_scheduler_prefers_the_cached]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_admission_order(check):
    check(real_policy)


@pytest.mark.parametrize("check", SCHEDULER_CHECKS, ids=lambda c: c.__name__)
def test_scheduler_with_the_prefix_policy(check, monkeypatch):
    check(real_policy, monkeypatch)


def check_invariants(scheduler: Scheduler, out) -> None:
    """Chunks consistent with the tables; a block two running requests hold is a cached (full,
    hashed) one: prompts share prefixes here, never a block someone writes."""
    m = scheduler.manager
    cached = {c.block_id for c in m.cached_blocks()}
    used = [b for r in scheduler.running for b in m.block_table(r.req_id)]
    assert {b for b in used if used.count(b) > 1} <= cached, "a shared block that is not cached"
    for c in out.chunks:
        assert m.seq_len(c.request.req_id) == c.end
        assert len(m.block_table(c.request.req_id)) == blocks_needed(c.end, m.block_size)


@pytest.mark.parametrize("seed", range(4))
def test_prefix_policy_changes_the_order_not_the_tokens(seed):
    rng = random.Random(seed)
    systems = [[rng.randint(1, 99) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    reqs = [Request(i, rng.choice(systems) + [rng.randint(1, 99) for _ in range(
        rng.randint(1, 10))], rng.randint(1, 8)) for i in range(30)]
    s = Scheduler(24, BS, max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=24,
                  scheduling_policy="prefix", max_overtakes=rng.randint(0, 4))
    steps = run(s, reqs, check=check_invariants)
    assert all(r.output == expected(r) for r in reqs)
    assert sum(o.cached_tokens for o in steps) > 0, "the prompts share prefixes: some hit"
    assert not s.waiting and not s.running and s.manager.num_free_blocks == 24


def test_fcfs_is_the_default_and_bad_values_are_refused():
    assert Scheduler(8, BS).scheduling_policy == "fcfs"
    with pytest.raises(ValueError, match="scheduling_policy"):
        Scheduler(8, BS, scheduling_policy="lpm")
    with pytest.raises(ValueError, match="max_overtakes"):
        Scheduler(8, BS, scheduling_policy="prefix", max_overtakes=-1)
    with pytest.raises(TypeError, match="max_overtakes"):
        Scheduler(8, BS, scheduling_policy="prefix", max_overtakes=2.5)


MUTATIONS = [
    ("shortest prefix first", [("0 if aged else -cached_tokens[i]",
                                "0 if aged else cached_tokens[i]")]),
    ("aging ignored", [("aged = overtaken[i] >= max_overtakes", "aged = False")]),
    ("the aged sorted by prefix too", [("0 if aged else -cached_tokens[i]",
                                        "-cached_tokens[i]")]),
    ("aged one overtake late", [("aged = overtaken[i] >= max_overtakes",
                                 "aged = overtaken[i] > max_overtakes")]),
    ("ties to the later arrival", [("return (not aged, 0 if aged else -cached_tokens[i], i)",
                                    "return (not aged, 0 if aged else -cached_tokens[i], -i)")]),
]


@pytest.mark.parametrize("description, edits", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_planted_mistake_is_caught(description, edits, tmp_path, monkeypatch):
    mutant = mutant_of(real_policy, edits, tmp_path, monkeypatch)
    failed = 0
    for check in CHECKS + SCHEDULER_CHECKS:
        with monkeypatch.context() as m:
            try:
                check(mutant, m) if check in SCHEDULER_CHECKS else check(mutant)
            except AssertionError:
                failed += 1
    assert failed, f"no check caught {description!r}"


@pytest.mark.parametrize("seed", range(3))
def test_no_aging_slack_is_first_come_first_served(seed):
    """``max_overtakes=0``: every waiting request is aged, so the prefix policy's steps are
    FCFS's, chunk for chunk (and FCFS, the default, is what the scheduler always did)."""
    rng = random.Random(seed)
    systems = [[rng.randint(1, 99) for _ in range(rng.randint(3, 12))] for _ in range(3)]
    prompts = [(rng.choice(systems) + [rng.randint(1, 99) for _ in range(rng.randint(1, 9))],
                rng.randint(1, 6)) for _ in range(25)]
    shapes = {}
    for name, kw in (("fcfs", {}), ("prefix", {"scheduling_policy": "prefix",
                                                "max_overtakes": 0})):
        s = Scheduler(20, BS, max_num_seqs=4, max_num_batched_tokens=20, **kw)
        steps = run(s, [Request(i, list(p), n) for i, (p, n) in enumerate(prompts)])
        shapes[name] = [[(c.request.req_id, c.start, c.num_tokens) for c in o.chunks]
                        for o in steps]
    assert shapes["fcfs"] == shapes["prefix"]
