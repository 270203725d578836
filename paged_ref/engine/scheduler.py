"""The scheduler: which requests compute which tokens in the next step (continuous batching).

As in vLLM v1's scheduler (and nano-vllm's), a step is a set of *chunks*: request ``r``
computes tokens ``start .. start + n - 1``. A decode is a chunk of one token; a prompt is one
chunk or several (chunked prefill); after a preemption by recompute, the prompt *and* the
tokens generated so far are one long prompt again. Every step:

1. **Running requests first**, oldest first: each gets ``min(tokens it still needs, budget
   left)`` tokens. Their new tokens need slots; when a block is needed and none is free, a
   running request is preempted (:func:`~paged_ref.engine.policy.choose_victim`: the latest
   arrival) and its blocks freed, until the slots fit -- or the request itself was the victim.
2. **Then waiting requests**, first come first served, while seats, token budget and free
   blocks last (:func:`~paged_ref.engine.policy.admit_count`); none is admitted in a step that
   preempted (the pool is short). With prefix caching a new request's leading full blocks may
   already be cached: it computes only the rest.

Slots are taken when a chunk is scheduled (``append_slot`` with the token id, which feeds the
prefix cache's hash) and the chunk is computed in the same step, so a block that the prefix
cache can return always holds computed K/V by the time anyone reads it.

Preemption modes: ``"recompute"`` frees the victim's blocks; it is admitted again later and
computes its tokens so far once more (with prefix caching, its full blocks may still be cached
on the device: those are hits, not recomputed). ``"swap"`` adds a host (CPU) tier of as many
blocks as the pool: cached blocks that are evicted spill there instead of being lost, and a
hit on them copies them back -- so a preempted request's full blocks come back by copy, and
only its last, partial block is recomputed.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from paged_ref.cache_math import blocks_needed
from paged_ref.engine import ops
from paged_ref.engine.policy import admit_count, choose_victim
from paged_ref.engine.request import Request, Status
from paged_ref.memory.allocator import OutOfBlocksError

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class Chunk:
    """Request ``request`` computes tokens ``start .. start + num_tokens - 1`` this step."""

    request: Request
    start: int
    num_tokens: int

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the request's last token (its logits give a new token)."""
        return self.end == self.request.num_tokens


@dataclass
class SchedulerOutput:
    """What one step runs, and what changed to make room for it."""

    chunks: list[Chunk] = field(default_factory=list)
    admitted: list[Request] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    block_ops: object = None  #: spills to / copies back from the host tier, copy-on-writes
    cached_tokens: int = 0  #: prompt tokens found in the prefix cache this step

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Continuous batching over a :class:`~paged_ref.KVCacheManager` (see the module doc).

    Args:
        num_blocks, block_size: the KV pool.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: tokens computed per step at most (the token budget).
        enable_prefix_caching: share cached prompt blocks between requests.
        preemption_mode: ``"recompute"`` or ``"swap"``.
        admit, choose_victim: the policy functions (see :mod:`paged_ref.engine.policy`).
    """

    def __init__(self, num_blocks: int, block_size: int, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 preemption_mode: str = "recompute", admit: Callable = admit_count,
                 choose_victim: Callable = choose_victim) -> None:
        if preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {preemption_mode!r}")
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1, got "
                             f"{max_num_seqs} and {max_num_batched_tokens}")
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        if preemption_mode == "swap" and not enable_prefix_caching:
            raise ValueError("preemption_mode='swap' needs enable_prefix_caching=True (a "
                             "preempted request's blocks come back as prefix-cache hits)")
        self.num_host_blocks = num_blocks if preemption_mode == "swap" else 0
        self.manager = ops.new_manager(num_blocks, block_size, enable_prefix_caching,
                                       self.num_host_blocks)
        self.admit = admit
        self.choose_victim = choose_victim
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        """Queue a new request (it holds nothing until admitted)."""
        request.status = Status.WAITING
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Pick the chunks of the next step, taking slots for them (see the module doc)."""
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_to_compute, budget)
            while not self._take_slots(req, n):
                victim = self.running[i + self.choose_victim(self.running[i:])]
                self._preempt(victim, out)
                if victim is req:
                    break
            else:
                out.chunks.append(Chunk(req, req.num_computed, n))
                budget -= n
                i += 1
        if not out.preempted:
            self._admit(budget, out)
        out.block_ops = ops.take_block_ops(self.manager)
        return out

    def update(self, out: SchedulerOutput, new_tokens: dict[int, int],
               stop_ids: frozenset[int]) -> list[Request]:
        """Record a finished step: chunks computed, sampled tokens appended, stops applied.

        ``new_tokens`` maps ``req_id`` to the token sampled for each chunk that ``samples``.
        Returns the requests that finished (their blocks are freed).
        """
        finished = []
        for chunk in out.chunks:
            req = chunk.request
            req.num_computed = chunk.end
            if not chunk.samples:
                continue
            token = new_tokens[req.req_id]
            req.output.append(token)
            if token in stop_ids or len(req.output) >= req.max_new_tokens:
                self.manager.free_sequence(req.req_id)
                self.running.remove(req)
                req.status = Status.FINISHED
                finished.append(req)
        return finished

    # ---- helpers ----------------------------------------------------------------------------

    def _take_slots(self, req: Request, n: int) -> bool:
        """Slots for ``req``'s next ``n`` tokens, or False (nothing taken) if blocks are short."""
        start = req.num_computed
        need = blocks_needed(start + n, self.block_size) - blocks_needed(start, self.block_size)
        if need > self.manager.num_free_blocks:
            return False
        for t in range(start, start + n):
            ops.append_token(self.manager, req.req_id, req.token_at(t))
        return True

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        seats = self.max_num_seqs - len(self.running)
        heads = [self.waiting[j] for j in range(min(seats, len(self.waiting)))]
        count = self.admit([r.num_tokens for r in heads], self.manager.num_free_blocks,
                           self.block_size, budget, seats)
        for req in heads[:count]:
            if budget <= 0:
                break
            end = min(req.num_tokens, budget)
            try:
                cached = ops.add_sequence(self.manager, req.req_id, req.tokens[:end])
            except OutOfBlocksError:
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            req.num_computed = cached
            self.running.append(req)
            out.admitted.append(req)
            out.cached_tokens += cached
            out.chunks.append(Chunk(req, cached, end - cached))
            budget -= end - cached

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Free ``victim``'s blocks and put it back at the head of the queue (recompute)."""
        self.manager.free_sequence(victim.req_id)
        self.running.remove(victim)
        victim.num_computed = 0
        victim.status = Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
