"""The scheduler with a fake model (no transformers, no tensors): fast, many configurations.

The fake model's next token is a fixed function of the request and the position, so the
tokens a request generates must not depend on how it was scheduled: chunked, preempted,
recomputed, batched with others or alone.
"""

import random

import pytest

from paged_ref.cache_math import blocks_needed
from paged_ref.engine.policy import admit_count, choose_victim
from paged_ref.engine.request import Request, Status
from paged_ref.engine.scheduler import Scheduler

EOS = 0


def fake_token(req: Request, position: int) -> int:
    """The 'model': a token in 1..50 from the request's prompt and the position."""
    return (sum(req.prompt) * 31 + position * 7) % 50 + 1


def run(scheduler: Scheduler, requests, *, check=None, max_steps=10_000):
    """Drive ``scheduler`` to the end; return the steps' outputs."""
    for r in requests:
        scheduler.add(r)
    steps = []
    while scheduler.has_work():
        out = scheduler.schedule()
        assert out.num_tokens <= scheduler.max_num_batched_tokens
        assert out.chunks, "a step with work must run something"
        if check:
            check(scheduler, out)
        new = {c.request.req_id: fake_token(c.request, c.end) for c in out.chunks if c.samples}
        scheduler.update(out, new, frozenset([EOS]))
        steps.append(out)
        assert len(steps) < max_steps, "no progress"
    return steps


def make_requests(seed, n, max_prompt=40, max_new=12):
    rng = random.Random(seed)
    return [Request(i, [rng.randint(1, 99) for _ in range(rng.randint(1, max_prompt))],
                    rng.randint(1, max_new)) for i in range(n)]


def expected(req: Request) -> list[int]:
    n = len(req.prompt)
    return [fake_token(req, n + k) for k in range(req.max_new_tokens)]


def check_invariants(scheduler: Scheduler, out) -> None:
    m = scheduler.manager
    used = [b for r in scheduler.running for b in m.block_table(r.req_id)]
    assert len(used) == len(set(used)), "two running requests share a block"
    for c in out.chunks:
        assert m.seq_len(c.request.req_id) == c.end
        assert len(m.block_table(c.request.req_id)) == blocks_needed(c.end, m.block_size)
    ids = [c.request.req_id for c in out.chunks]
    assert len(ids) == len(set(ids))


@pytest.mark.parametrize("num_blocks,block_size,budget,max_seqs", [
    (400, 16, 2048, 256),  # everything fits
    (12, 4, 64, 8),  # tight pool: preemption
    (9, 8, 16, 4),  # chunked prefill (budget below the prompt lengths) and preemption
    (60, 1, 7, 3),  # block size 1, odd budget
])
@pytest.mark.parametrize("caching,mode", [(False, "recompute"), (True, "recompute"),
                                          (True, "swap")])
def test_every_request_gets_its_tokens(num_blocks, block_size, budget, max_seqs, caching, mode):
    requests = make_requests(seed=num_blocks, n=10)
    s = Scheduler(num_blocks, block_size, max_num_seqs=max_seqs,
                  max_num_batched_tokens=budget, enable_prefix_caching=caching,
                  preemption_mode=mode)
    steps = run(s, requests, check=None if caching else check_invariants)
    for r in requests:
        assert r.status is Status.FINISHED
        assert r.output == expected(r)[: len(r.output)]
        assert len(r.output) == r.max_new_tokens
    assert s.manager.num_free_blocks == num_blocks
    if num_blocks == 12:
        assert sum(len(o.preempted) for o in steps) > 0
    if budget == 16:
        assert any(c.start == 0 and c.num_tokens < len(c.request.prompt)
                   for o in steps for c in o.chunks)


def test_request_that_fits_only_alone_completes():
    big = Request(0, list(range(1, 30)), 8)  # 36 tokens held at most: all 9 blocks of 4
    small = [Request(i, [5, 6, 7], 6) for i in range(1, 4)]
    s = Scheduler(9, 4, enable_prefix_caching=False)
    run(s, [small[0], big, *small[1:]], check=check_invariants)
    assert big.output == expected(big)
    assert all(r.output == expected(r) for r in small)


def test_first_come_first_served_admission():
    s = Scheduler(6, 4, max_num_batched_tokens=100, enable_prefix_caching=False)
    a, b, c = Request(0, [1] * 16, 2), Request(1, [2] * 12, 2), Request(2, [3] * 2, 2)
    for r in (a, b, c):
        s.add(r)
    out = s.schedule()
    # a takes 4 blocks; b needs 3 > 2 free; c would fit but must not overtake b
    assert [ch.request for ch in out.chunks] == [a]


def test_stop_on_eos():
    s = Scheduler(20, 4, enable_prefix_caching=False)
    r = Request(0, [3, 4], 10)
    s.add(r)
    out = s.schedule()
    s.update(out, {0: 9}, frozenset([EOS]))
    out = s.schedule()
    s.update(out, {0: EOS}, frozenset([EOS]))
    assert r.output == [9, EOS] and r.status is Status.FINISHED and not s.has_work()


def test_policies():
    assert admit_count([5, 5, 5], free_blocks=3, block_size=4, token_budget=100, seats=10) == 1
    assert admit_count([5, 3, 9], free_blocks=10, block_size=4, token_budget=9, seats=10) == 3
    assert admit_count([5, 3], free_blocks=10, block_size=4, token_budget=100, seats=1) == 1
    reqs = [Request(i, [1], 1) for i in (3, 9, 4)]
    assert choose_victim(reqs) == 1
    with pytest.raises(ValueError):
        choose_victim([])


def test_bad_arguments():
    with pytest.raises(ValueError, match="preemption_mode"):
        Scheduler(4, 4, preemption_mode="drop")
    with pytest.raises(ValueError, match="max_num_seqs"):
        Scheduler(4, 4, max_num_seqs=0)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        Scheduler(4, 4, preemption_mode="swap", enable_prefix_caching=False)


def test_swap_brings_preempted_blocks_back_from_the_host_tier():
    requests = make_requests(seed=3, n=10, max_prompt=30, max_new=20)
    s = Scheduler(12, 4, max_num_batched_tokens=64, preemption_mode="swap")
    steps = run(s, requests)
    assert sum(len(o.preempted) for o in steps) > 0
    assert sum(len(o.block_ops.swap_in) for o in steps) > 0
    assert all(r.output == expected(r) for r in requests)



def test_forks_past_max_num_seqs_admit_nobody():
    """Forked samples may run past ``max_num_seqs`` (a request's samples start together):
    then no seat is left and nobody is admitted (a negative count of seats once admitted all
    but the last of the queue)."""
    s = Scheduler(64, 4, max_num_seqs=2)
    a, b = Request(0, [1, 2, 3], 4), Request(1, [4, 5, 6], 4)
    s.add(a)
    s.add(b)
    out = s.schedule()  # both admitted; then a third request forked from the first
    s.update(out, {c.request.req_id: fake_token(c.request, c.end) for c in out.chunks})
    s.fork(a, Request(2, list(a.prompt), 4))
    assert len(s.running) == 3
    waiting = [Request(i, [7, i, 9], 4) for i in range(3, 7)]
    for r in waiting:
        s.add(r)
    out = s.schedule()
    assert out.admitted == [] and all(r.status is Status.WAITING for r in waiting)
