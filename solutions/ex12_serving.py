"""Lesson 12: serving under load -- what a reservation costs, and how much load a system takes.

Before paging, a serving system gave each request one contiguous region of the KV cache,
reserved when the request was admitted and held until it finished. How much it reserved is the
whole difference between the PagedAttention paper's baselines (Kwon et al., SOSP 2023, §6.1):
Orca (Max) reserves the model's longest sequence, Orca (Pow2) the prompt plus the next power of
two of the output length, Orca (Oracle) exactly the prompt plus the output it will produce
(which no real system knows in advance). Paging reserves nothing ahead: blocks come as tokens do.

Exercises:
    12.1  reserved_blocks  blocks a request takes at admission under each policy
    12.2  sustained_rate   the highest request rate a system serves within a latency bound
    12.3  admission_order  prefix-aware admission: longest cached prefix first, with aging

``paged_ref.engine.policy.reserved_tokens`` is what the engine's scheduler uses for 12.1;
``paged_course.serving.sweep.sustained_rate`` is the finished 12.2;
``paged_ref.engine.policy.admission_order`` is the engine's 12.3
(``Engine(scheduling_policy="prefix")``).
"""

from __future__ import annotations

from collections.abc import Sequence

from paged_ref.cache_math import blocks_needed  # noqa: F401  (you need it in 12.1)

POLICIES = ("paged", "reserve_max", "reserve_pow2", "reserve_oracle")


def reserved_blocks(policy: str, prompt_len: int, output_len: int, max_model_len: int,
                    block_size: int) -> int:
    """Exercise 12.1: the blocks a request takes from the pool when it is admitted.

    Args:
        policy: one of ``POLICIES``.
        prompt_len: its prompt's tokens (>= 1).
        output_len: the tokens it will generate (>= 1; the benchmark knows it: every request
            runs to its true length).
        max_model_len: the longest request the engine serves (prompt + output), tokens.
        block_size: tokens per block.

    Returns:
        ``"paged"``: the blocks of its prompt only (the rest come one block at a time as it
        decodes). ``"reserve_max"``: the blocks of ``max_model_len`` tokens.
        ``"reserve_pow2"``: the blocks of prompt + the smallest power of two >= ``output_len``.
        ``"reserve_oracle"``: the blocks of prompt + output. A reservation is never more than
        ``max_model_len`` tokens.

    Raises:
        ValueError: an unknown policy.

    Example:
        >>> [reserved_blocks(p, 20, 100, 1024, 16) for p in POLICIES]
        [2, 64, 10, 8]

    (paged: 20 tokens in 2 blocks; max: 1024 / 16; pow2: 20 + 128 = 148 tokens, 10 blocks;
    oracle: 120 tokens, 8 blocks.)

    Hints:
        * ``blocks_needed(n, block_size)`` is ``ceil(n / block_size)``.
        * The next power of two >= n: ``1 << (n - 1).bit_length()`` (1 for n = 1).
    """
    # BEGIN SOLUTION
    if policy == "paged":
        tokens = prompt_len
    elif policy == "reserve_max":
        tokens = max_model_len
    elif policy == "reserve_pow2":
        tokens = prompt_len + (1 << (output_len - 1).bit_length())
    elif policy == "reserve_oracle":
        tokens = prompt_len + output_len
    else:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    return blocks_needed(min(tokens, max_model_len), block_size)
    # END SOLUTION


def sustained_rate(rates: Sequence[float], latencies: Sequence[float],
                   bound: float) -> float | None:
    """Exercise 12.2: the highest request rate whose latency stays within ``bound``.

    Args:
        rates: request rates of a sweep (requests/s), increasing.
        latencies: the mean normalized latency measured at each rate (s/token), same length.
        bound: the latency a service promises (s/token).

    Walk up the rates. At the first rate whose latency is above ``bound`` (a latency equal to
    it is within), join that point and the one before it with a straight line and return the
    rate where the line crosses ``bound``. If the lowest rate is already above, return None;
    if no rate is above, return the highest rate (the system sustains at least that much).
    Only the first crossing counts: past it the queue grows without end, and a lower latency
    at a higher rate is noise.

    Example:
        >>> sustained_rate([1, 2, 3, 4], [1.0, 1.5, 3.0, 9.0], bound=2.0)  # 2 + 0.5 / 1.5
        2.3333333333333335

    Hints:
        * ``zip(rates, rates[1:])`` walks neighbouring pairs.
        * Between ``(r0, l0)`` and ``(r1, l1)`` the line reaches ``bound`` at
          ``r0 + (bound - l0) / (l1 - l0) * (r1 - r0)``.
    """
    # BEGIN SOLUTION
    if latencies[0] > bound:
        return None
    for r0, r1, l0, l1 in zip(rates, rates[1:], latencies, latencies[1:], strict=False):
        if l1 > bound:
            return r0 + (bound - l0) / (l1 - l0) * (r1 - r0)
    return rates[-1]
    # END SOLUTION


def admission_order(cached_tokens: Sequence[int], overtaken: Sequence[int],
                    max_overtakes: int) -> list[int]:
    """Exercise 12.3: the order in which admission tries the waiting requests.

    First come, first served admits from the head of the queue whatever the prefix cache
    holds. SGLang's longest-prefix-first tries first the request with the most prompt tokens
    already cached: it costs little to admit (only the rest of its prompt is computed), and
    admitting it while its prefix is hot keeps that prefix from being evicted. Alone, it can
    starve a request nothing is cached for, behind a steady stream of requests that hit.
    The aging bound: a request that ``max_overtakes`` later arrivals have overtaken goes first.

    Args:
        cached_tokens: per waiting request, in queue order (arrival order), the leading
            tokens of its prompt the prefix cache holds now.
        overtaken: per waiting request, how many requests that arrived after it were admitted
            while it waited.
        max_overtakes: the aging bound (>= 0).

    Returns:
        Indices into the queue: first the *aged* requests (``overtaken >= max_overtakes``),
        in queue order; then the others, most cached tokens first, ties in queue order.

    Example:
        >>> admission_order([0, 48, 16, 48], [0, 0, 0, 0], max_overtakes=8)
        [1, 3, 2, 0]
        >>> admission_order([0, 48, 16], [8, 0, 9], max_overtakes=8)   # 0 and 2 are aged
        [0, 2, 1]

    Hints:
        * ``sorted`` is stable, and a key may be a tuple: ``(not aged, ...)`` puts the aged
          (``False``) first.
        * Sort by ``-cached`` for "most first"; end the key with the index for the ties.
    """
    # BEGIN SOLUTION
    def key(i: int) -> tuple[bool, int, int]:
        aged = overtaken[i] >= max_overtakes
        return (not aged, 0 if aged else -cached_tokens[i], i)

    return sorted(range(len(cached_tokens)), key=key)
    # END SOLUTION
