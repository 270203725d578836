# Your exercises for lesson 9: replace each `raise NotImplementedError(...)`.
# The lesson notebook's check cells (or `make test-exercises EX=ex09`) test this file.
# Generated from solutions/ex09_scheduler.py by tools/make_exercises.py.
"""Lesson 09: the two decisions of a serving engine's scheduler.

Every step, the scheduler of a continuous-batching engine (vLLM, SGLang, this course's
``paged_ref.engine``) first lets the running requests compute their next tokens, then starts
waiting requests while the step's token budget, the free blocks and the seats last. When a
running request needs a new block and none is free, another running request is *preempted*:
its blocks are freed and it goes back to the head of the queue, to be recomputed later.

Exercises:
    9.1  admit_count     how many waiting requests start this step (admission under a budget)
    9.2  choose_victim   which running request to preempt

``paged_ref.engine.policy`` holds the finished versions; the notebook plugs yours into the
real scheduler: ``Engine(...).scheduler.admit = admit_count`` (and ``choose_victim``).
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_ref.cache_math import blocks_needed  # noqa: F401  (you need it in 9.1)


def admit_count(waiting_lens: Sequence[int], free_blocks: int, block_size: int,
                token_budget: int, seats: int) -> int:
    """Exercise 9.1: how many requests from the head of the waiting queue start this step.

    Args:
        waiting_lens: tokens each waiting request must compute (its prompt), queue order.
        free_blocks: blocks the pool can hand out now.
        block_size: tokens per block.
        token_budget: tokens this step may still compute.
        seats: how many more requests may run at once.

    Walk the queue in order. Request ``i`` would compute ``chunk = min(waiting_lens[i],
    budget left)`` tokens this step (chunked prefill: a long prompt gets what is left of the
    budget) and needs ``blocks_needed(chunk, block_size)`` blocks for them. Admit it when a
    seat is left, the budget left is positive and its blocks are free; then subtract its
    blocks and its chunk. Stop at the first request that does not fit: first come, first
    served never lets a later request overtake an earlier one.

    Example:
        >>> admit_count([10, 30, 2], free_blocks=4, block_size=8, token_budget=64, seats=8)
        1
        >>> admit_count([10, 30, 2], free_blocks=9, block_size=8, token_budget=16, seats=8)
        2

    (First: 10 tokens take 2 blocks, 30 need 4 > 2 left, and 2 must not overtake them.
    Second: 10 tokens, then a 6-token chunk of the 30; the budget is spent.)

    Hints:
        * Three stop conditions (seats, budget, blocks), checked before each request.
        * ``blocks_needed(n, block_size)`` is ``ceil(n / block_size)``.
    """
    raise NotImplementedError("Exercise 9.1: admit_count")


def choose_victim(candidates: Sequence) -> int:
    """Exercise 9.2: the index in ``candidates`` of the running request to preempt.

    ``candidates`` are running requests (objects with a ``req_id``; a lower id arrived
    earlier). Preempt the one that arrived **last**: it has waited least, and under first come,
    first served the earliest request must keep making progress, so that some request always
    finishes and frees its blocks (preempting the oldest can make two requests evict each
    other forever). Raise ``ValueError`` when there is no candidate.

    Example:
        >>> class R: ...
        >>> a, b, c = R(), R(), R()
        >>> a.req_id, b.req_id, c.req_id = 3, 9, 4
        >>> choose_victim([a, b, c])
        1

    Hints:
        * ``max(range(len(xs)), key=...)`` gives the index of the largest item.
    """
    raise NotImplementedError("Exercise 9.2: choose_victim")
