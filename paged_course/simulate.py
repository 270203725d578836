"""How much KV-cache memory holds real tokens? A small serving simulation for lesson 01.

Units: lengths in **tokens**, memory in **bytes** (or in token *slots*: one slot holds the keys
and values of one token in every layer, :func:`model_bytes_per_token` bytes).

Four ways to reserve KV memory for a request with a prompt of ``p`` tokens that will generate
``o`` tokens (final length ``L = p + o``), as in the PagedAttention paper (Kwon et al., SOSP
2023, §6.1 and Fig. 2):

``"max"``     contiguous, ``max_len`` slots per request (Orca (Max)): the final length is unknown.
``"pow2"``    contiguous, ``p + next_pow2(o)`` slots (Orca (Pow2)): over-reserves the output
              by less than 2x, e.g. 25 output tokens reserve 32 slots.
``"oracle"``  contiguous, exactly ``L`` slots (Orca (Oracle)): the output length is known in
              advance, which no real server knows.
``"paged"``   on demand, ``ceil(l / block_size)`` blocks for the ``l`` tokens stored so far
              (vLLM). A new block is taken only when the last one is full.

:func:`simulate` runs requests through a memory pool step by step (one decode step = one new
token per running request) and measures, at every step while requests are waiting (the pool is
the bottleneck), where the pool's slots go:

* ``tokens``    hold the K/V of a token that exists now (prompt or generated so far);
* ``future``    reserved for tokens the request has not generated yet (``L - l``);
* ``rounding``  reserved beyond the final length: ``max_len - L``, ``next_pow2(o) - o``, or the
              empty slots of the last, half-filled block (internal fragmentation);
* ``free``      not reserved by anyone, but too small for the next request in the queue.

The paper's Fig. 2 reports the same split, averaged over a serving run of OPT-13B on ShareGPT:
20.4 / 26.8 / 38.2 % of KV memory holding token states for Orca Max / Pow2 / Oracle and 96.3 %
for vLLM (:data:`PAPER_TOKEN_SHARE`). The model here is simpler: one token per request per step,
prefill in the admission step, first-come-first-served admission, and a pool counted in slots
(so contiguous strategies suffer no address-space fragmentation, which flatters them).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from paged_ref.cache_math import cdiv, kv_bytes_per_token

STRATEGIES = ("max", "pow2", "oracle", "paged")

#: Share of KV-cache memory holding token states, PagedAttention paper (Kwon et al. 2023),
#: Fig. 2 (OPT-13B, ShareGPT, averaged over the serving run). In percent.
PAPER_TOKEN_SHARE = {"max": 20.4, "pow2": 26.8, "oracle": 38.2, "paged": 96.3}

#: Labels used in tables and plots.
STRATEGY_LABELS = {
    "max": "contiguous, max length (Orca Max)",
    "pow2": "contiguous, power of two (Orca Pow2)",
    "oracle": "contiguous, exact length (Orca Oracle)",
    "paged": "paged, on demand (vLLM)",
}


@dataclass(frozen=True)
class ModelShape:
    """The attention shape that sets the KV-cache size of a decoder-only model."""

    name: str
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int


#: Published shapes (config.json of each model). Llama-2-7B uses multi-head attention (as many
#: K/V heads as query heads); the others use grouped-query attention with 8 K/V heads.
MODELS = {
    "Llama-2-7B": ModelShape("Llama-2-7B", 32, 32, 32, 128),
    "Llama-3-8B": ModelShape("Llama-3-8B", 32, 32, 8, 128),
    "Mistral-7B": ModelShape("Mistral-7B", 32, 32, 8, 128),
    "Llama-3-70B": ModelShape("Llama-3-70B", 80, 64, 8, 128),
}


def model_bytes_per_token(model: ModelShape, dtype="bfloat16") -> int:
    """KV bytes of one token of ``model`` (:func:`paged_ref.cache_math.kv_bytes_per_token`);
    ``dtype`` a name (``"bfloat16"``) or bytes per value (1 for FP8/INT8)."""
    return kv_bytes_per_token(num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
                              head_dim=model.head_dim, dtype=dtype)


def model_table(dtype="bfloat16", seq_len: int = 4096) -> list[dict]:
    """One row per model in :data:`MODELS`: KV bytes per token and per ``seq_len``-token request."""
    rows = []
    for m in MODELS.values():
        per_token = model_bytes_per_token(m, dtype)
        rows.append({
            "model": m.name,
            "layers": m.num_layers,
            "q_heads": m.num_q_heads,
            "kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim,
            "kib_per_token": per_token / 1024,
            f"gib_per_{seq_len}_tokens": per_token * seq_len / 2**30,
        })
    return rows


@dataclass(frozen=True)
class Requests:
    """Synthetic requests: ``prompt[i]`` and ``output[i]`` tokens (numpy int64 arrays)."""

    prompt: np.ndarray
    output: np.ndarray
    max_len: int

    def __len__(self) -> int:
        return len(self.prompt)

    @property
    def total(self) -> np.ndarray:
        """Final length ``prompt + output`` of each request, in tokens."""
        return self.prompt + self.output


def _lognormal(rng: np.random.Generator, mean: float, sigma: float, n: int) -> np.ndarray:
    # exp(N(mu, sigma^2)) has mean exp(mu + sigma^2 / 2); pick mu to hit the requested mean.
    mu = math.log(mean) - sigma**2 / 2
    return np.maximum(1, np.rint(rng.lognormal(mu, sigma, n))).astype(np.int64)


def sample_requests(n: int, seed: int = 0, prompt_mean: float = 161, output_mean: float = 338,
                    max_len: int = 2048, sigma: float = 1.0) -> Requests:
    """``n`` requests with right-skewed (lognormal) lengths, deterministic for a given ``seed``.

    The means default to ShareGPT's as reported in the PagedAttention paper (161 prompt and 338
    output tokens). ``sigma`` is the spread of the log-length (1.0: a long tail, the median is
    about 60 % of the mean). Lengths are at least 1; the prompt is clipped to ``max_len - 1``
    and the output so that ``prompt + output <= max_len`` (clipping lowers the means a little).
    """
    if n < 1 or max_len < 2:
        raise ValueError(f"need n >= 1 and max_len >= 2, got n={n}, max_len={max_len}")
    rng = np.random.default_rng(seed)
    prompt = np.minimum(_lognormal(rng, prompt_mean, sigma, n), max_len - 1)
    output = np.minimum(_lognormal(rng, output_mean, sigma, n), max_len - prompt)
    return Requests(prompt=prompt, output=output, max_len=max_len)


def _next_pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


def reserved_slots(strategy: str, prompt: int, output: int, max_len: int) -> int:
    """Slots a contiguous strategy reserves when it admits a request (``"paged"``: none ahead)."""
    if strategy == "max":
        return max_len
    if strategy == "pow2":
        return min(prompt + _next_pow2(output), max_len)
    if strategy == "oracle":
        return prompt + output
    raise ValueError(f"strategy must be one of {STRATEGIES[:3]} here, got {strategy!r}")


@dataclass
class SimResult:
    """What :func:`simulate` measured. Shares are fractions of the pool, averaged over steps."""

    strategy: str
    capacity_slots: int
    block_size: int
    steps: int                    # decode steps until every request finished
    saturated_steps: int          # steps with at least one request waiting (the averaged ones)
    share: dict[str, float] = field(default_factory=dict)  # tokens / future / rounding / free
    mean_running: float = 0.0     # requests in the batch, averaged over the saturated steps
    preemptions: int = 0          # paged only: requests sent back to the queue (recompute)

    @property
    def token_share(self) -> float:
        """Fraction of the KV pool holding real tokens (the paper's "token states")."""
        return self.share["tokens"]

    @property
    def tokens_per_reserved(self) -> float:
        """Fraction of *reserved* slots (pool minus free) holding real tokens."""
        return self.share["tokens"] / max(1e-12, 1.0 - self.share["free"])


def simulate(strategy: str, requests: Requests, capacity_slots: int, block_size: int = 16,
             watermark: float = 0.01) -> SimResult:
    """Serve ``requests`` (all queued at time 0) from a pool of ``capacity_slots`` token slots.

    Each step: admit queued requests first-come-first-served while their reservation fits (the
    prompt is written at admission), measure the pool, then every running request writes one
    token; a request that reaches its final length leaves and frees its memory.

    Contiguous strategies reserve :func:`reserved_slots` at admission and never grow. ``"paged"``
    admits a request when its prompt's blocks fit with ``watermark`` of the blocks kept free (as
    vLLM does), takes a block when the last one is full, and when none is free preempts the
    most recently admitted request (its blocks are freed; it goes back to the head of the queue
    and later recomputes the tokens it had, as vLLM's recompute preemption does).

    Shares are averaged over the steps in which at least one request is waiting, i.e. while the
    memory pool limits the batch. ``capacity_slots`` must hold at least one ``max_len`` request.
    """
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    if capacity_slots < requests.max_len:
        raise ValueError(f"capacity_slots={capacity_slots} cannot hold one request of "
                         f"max_len={requests.max_len} tokens")
    paged = strategy == "paged"
    B = block_size if paged else 1          # allocation unit in slots
    capacity = capacity_slots // B          # in units (blocks for paged, slots otherwise)
    keep_free = int(watermark * capacity) if paged else 0
    prompt = requests.prompt.tolist()
    final = requests.total.tolist()
    max_len = requests.max_len

    def units_for(i: int, length: int) -> int:
        if paged:
            return cdiv(length, B)
        return reserved_slots(strategy, prompt[i], final[i] - prompt[i], max_len)

    queue = deque((i, prompt[i]) for i in range(len(prompt)))  # (request, tokens to (re)load)
    running: list[list[int]] = []           # [request, tokens stored, units held]
    free = capacity
    sums = {"tokens": 0.0, "future": 0.0, "rounding": 0.0, "free": 0.0}
    running_sum = 0
    steps = saturated = preemptions = 0
    while queue or running:
        while queue:                        # admission, first come first served
            i, length = queue[0]
            need = units_for(i, length)
            if need > free - (keep_free if running else 0):
                break
            queue.popleft()
            running.append([i, length, need])
            free -= need
        if not running:
            raise RuntimeError("a request does not fit in an empty pool")  # guarded above
        steps += 1
        if queue:                           # measure while memory is the bottleneck
            saturated += 1
            stored = sum(r[1] for r in running)
            held = sum(r[2] for r in running) * B
            future = 0 if paged else sum(final[r[0]] - r[1] for r in running)
            pool = capacity * B
            sums["tokens"] += stored / pool
            sums["future"] += future / pool
            sums["rounding"] += (held - stored - future) / pool
            sums["free"] += (pool - held) / pool
            running_sum += len(running)
        # decode: one new token per running request, oldest first
        k = 0
        while k < len(running):
            r = running[k]
            if paged and r[1] % B == 0:     # the last block is full: take a new one
                while free == 0 and running[-1] is not r:
                    victim = running.pop()  # preempt the newest request (recompute later)
                    free += victim[2]
                    queue.appendleft((victim[0], victim[1]))
                    preemptions += 1
                if free == 0:               # r is the newest itself: r waits instead
                    running.pop()
                    free += r[2]
                    queue.appendleft((r[0], r[1]))
                    preemptions += 1
                    break
                free -= 1
                r[2] += 1
            r[1] += 1
            k += 1
        still = []
        for r in running:
            if r[1] >= final[r[0]]:
                free += r[2]
            else:
                still.append(r)
        running = still
    n = max(1, saturated)
    return SimResult(
        strategy=strategy,
        capacity_slots=capacity * B,
        block_size=block_size,
        steps=steps,
        saturated_steps=saturated,
        share={k: v / n for k, v in sums.items()},
        mean_running=running_sum / n,
        preemptions=preemptions,
    )


def compare_strategies(requests: Requests, capacity_slots: int, block_size: int = 16,
                       strategies=STRATEGIES) -> dict[str, SimResult]:
    """:func:`simulate` for each strategy on the same requests and pool."""
    return {s: simulate(s, requests, capacity_slots, block_size) for s in strategies}


def requests_that_fit(memory_bytes: float, strategy: str, requests: Requests, *,
                      bytes_per_token: int, block_size: int = 16) -> float:
    """How many requests run at once in ``memory_bytes`` of KV cache with ``strategy``.

    The batch size the pool sustains: the mean number of running requests over the steps in
    which others are waiting (:func:`simulate` with ``memory_bytes // bytes_per_token`` slots).
    E.g. 40e9 bytes of KV for Llama-3-8B in bf16 (131072 bytes per token) is 305,175 slots.
    """
    slots = int(memory_bytes // bytes_per_token)
    return simulate(strategy, requests, slots, block_size).mean_running
