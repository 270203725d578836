"""The scheduler's decisions, as small pure functions (lesson 09's exercises and the baselines).

* :func:`admit_count` -- admission under a block budget: how many waiting requests, taken
  first come first served from the head of the queue, start this step.
* :func:`choose_victim` -- preemption: when a running request needs a block and none is free,
  which running request gives its blocks up.
* :func:`reserved_tokens` -- the PagedAttention paper's Orca baselines (§6.2): how many tokens'
  blocks a request holds from admission to finish when the engine reserves instead of paging.
* :func:`admission_order` -- ``scheduling_policy="prefix"``: which waiting requests admission
  tries first (SGLang's longest-prefix-first, with an aging bound).

:class:`paged_ref.engine.scheduler.Scheduler` calls these (or the learner's versions, passed in
as ``admit=`` / ``choose_victim=``). ``solutions/ex09_scheduler.py`` holds the first two.
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_ref.cache_math import blocks_needed

#: ``Engine(reservation=...)``: paging, or reserve the maximum, a power of two, the truth.
RESERVATIONS = ("paged", "reserve_max", "reserve_pow2", "reserve_oracle")
#: ``Engine(scheduling_policy=...)``: admit in arrival order, or longest cached prefix first.
SCHEDULING_POLICIES = ("fcfs", "prefix")


def admit_count(waiting_lens: Sequence[int], free_blocks: int, block_size: int,
                token_budget: int, seats: int) -> int:
    """How many requests from the head of the waiting queue start this step.

    Args:
        waiting_lens: tokens each waiting request must compute (its prompt), queue order.
        free_blocks: blocks the pool can hand out now.
        block_size: tokens per block.
        token_budget: tokens this step may still compute (the rest of the step's budget).
        seats: how many more requests may run at once.

    Walk the queue in order. Request ``i`` computes ``chunk = min(waiting_lens[i], budget
    left)`` tokens this step (chunked prefill: a long prompt gets what is left of the budget)
    and needs ``blocks_needed(chunk, block_size)`` blocks for them. Admit it if a seat is left,
    the budget left is positive and its blocks are free; then take its blocks and its chunk
    from what is left. Stop at the first request that does not fit: first come first served
    never lets a later request overtake an earlier one.
    """
    admitted = 0
    for n in waiting_lens:
        if admitted == seats or token_budget <= 0:
            break
        chunk = min(n, token_budget)
        need = blocks_needed(chunk, block_size)
        if need > free_blocks:
            break
        free_blocks -= need
        token_budget -= chunk
        admitted += 1
    return admitted


def choose_victim(candidates: Sequence) -> int:
    """Index in ``candidates`` of the running request to preempt.

    ``candidates`` are running requests (objects with ``req_id``: lower ids arrived earlier),
    all of them at least as late in the queue as the one that needs a block. Preempt the one
    that arrived last: it has waited least, and under first come first served the earliest
    request must keep making progress (so some request always finishes).
    """
    if not candidates:
        raise ValueError("choose_victim needs at least one candidate")
    return max(range(len(candidates)), key=lambda i: candidates[i].req_id)


def reserved_tokens(policy: str, prompt_len: int, output_len: int, max_model_len: int) -> int:
    """Tokens whose blocks a request reserves at admission under ``policy`` (RESERVATIONS).

    ``output_len`` is its true output length (``max_tokens``; the load generator sets it with
    ``ignore_eos``). Returns 0 for ``"paged"`` (blocks on demand); ``max_model_len`` for
    ``"reserve_max"`` (Orca Max); prompt + the next power of two >= output for
    ``"reserve_pow2"`` (Orca Pow2); prompt + output for ``"reserve_oracle"`` (Orca Oracle);
    never more than ``max_model_len``.
    """
    if policy == "paged":
        return 0
    if policy == "reserve_max":
        return max_model_len
    out = 1 << (output_len - 1).bit_length() if policy == "reserve_pow2" else output_len
    return min(prompt_len + out, max_model_len)


def admission_order(cached_tokens: Sequence[int], overtaken: Sequence[int],
                    max_overtakes: int) -> list[int]:
    """The order (indices into the waiting queue) in which admission tries waiting requests.

    Args:
        cached_tokens: per waiting request (queue order: arrival, preempted ones first), its
            leading prompt tokens the prefix cache holds now.
        overtaken: per waiting request, the later arrivals admitted while it waited.
        max_overtakes: the aging bound (>= 0).

    The *aged* (overtaken ``max_overtakes`` times) go first, in queue order: admission stops
    at the first request that does not fit, so the oldest aged one gets the next free blocks.
    The rest follow by cached tokens, most first (SGLang's longest-prefix-first: cheap to
    admit, and admitting it keeps its prefix hot), ties in queue order.
    """
    def key(i: int) -> tuple[bool, int, int]:
        aged = overtaken[i] >= max_overtakes
        return (not aged, 0 if aged else -cached_tokens[i], i)

    return sorted(range(len(cached_tokens)), key=key)
