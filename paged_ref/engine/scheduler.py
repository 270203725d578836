"""The scheduler: which requests compute which tokens in the next step (continuous batching).

As in vLLM v1's scheduler (and nano-vllm's), a step is a set of *chunks*: request ``r``
computes tokens ``start .. start + n - 1``. A decode is a chunk of one token; a prompt is one
chunk or several (chunked prefill); after a preemption by recompute, the prompt *and* the
tokens generated so far are one long prompt again. Every step:

1. **Running requests first**, oldest first: each gets ``min(tokens it still needs, budget
   left)`` tokens (decodes with a block free for each: all at once). When their slots need a
   block and none is free, a running request is preempted (``choose_victim``), blocks freed.
2. **Then waiting requests**, first come first served (or, with ``scheduling_policy=
   "prefix"``, longest cached prefix first: :func:`~paged_ref.engine.policy.admission_order`),
   while seats, token budget and free blocks last (:func:`~paged_ref.engine.policy.
   admit_count`); none in a step that preempted.
   With prefix caching a new request's leading full blocks may be cached: it computes the rest.

Slots are taken when a chunk is scheduled (``append_slot`` with the token id: the prefix
cache's hash) and computed in the same step; if it fails, :meth:`Scheduler.rollback` aborts
every request it scheduled, and any whose blocks run ahead of its computed tokens (no hash is
left over K/V never written).

``"recompute"`` preemption frees the victim's blocks (prefix-cache hits are not recomputed);
``"swap"`` adds a host tier as large as the pool, where evicted cached blocks spill and from
where a hit copies them back (``num_host_blocks`` sizes it, in either mode); a ``disk_tier``
under it takes what it drops, read ahead for the waiting requests (``prefetch``). A reservation
policy (``policy.reserved_tokens``) admits a request only when all its blocks are free.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import islice

from paged_ref.cache_math import blocks_needed
from paged_ref.engine import policy
from paged_ref.engine.policy import RESERVATIONS, admit_count, choose_victim, reserved_tokens
from paged_ref.engine.request import Request, Status
from paged_ref.memory.allocator import OutOfBlocksError, check_int
from paged_ref.memory.manager import BlockOps, KVCacheManager
from paged_ref.memory.tiers import host_tier_blocks

PREEMPTION_MODES = ("recompute", "swap")


@dataclass(frozen=True)
class Chunk:
    """Request ``request`` computes tokens ``start .. start + num_tokens - 1`` this step; their
    K/V go to cache slots ``slots`` (taken when the chunk was scheduled)."""

    request: Request
    start: int
    num_tokens: int
    slots: list[int] = field(default_factory=list, repr=False)

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
    block_ops: BlockOps | None = None  #: host-tier spills / copies back, copy-on-writes
    cached_tokens: int = 0  #: prompt tokens found in the prefix cache this step
    #: multi-step decoding: per chunk (each a decode), the decode passes it runs (empty: one)
    steps: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.steps) if self.steps else sum(c.num_tokens for c in self.chunks)


class Scheduler:
    """Continuous batching over a :class:`~paged_ref.KVCacheManager` (see the module doc).

    Args:
        num_blocks, block_size: the KV pool.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: tokens computed per step at most (the token budget).
        enable_prefix_caching: share cached prompt blocks between requests.
        preemption_mode: ``"recompute"`` or ``"swap"``.
        num_host_blocks, disk_tier: the tiers under the pool (``paged_ref.memory.tiers``):
            host blocks (None: the pool's with ``"swap"``, else 0), a ``DiskTier`` or None.
        admit, choose_victim: the policy functions (see :mod:`paged_ref.engine.policy`).
        reservation: one of :data:`~paged_ref.engine.policy.RESERVATIONS`.
        max_model_len: the longest request (what ``"reserve_max"`` reserves); default the pool.
        scheduling_policy, max_overtakes: ``"fcfs"`` or ``"prefix"`` (with its aging bound),
            see :func:`~paged_ref.engine.policy.admission_order`.

    Raises:
        TypeError / ValueError: an argument of the wrong type or out of range.
    """

    def __init__(self, num_blocks: int, block_size: int, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, enable_prefix_caching: bool = True,
                 preemption_mode: str = "recompute", admit: Callable = admit_count,
                 choose_victim: Callable = choose_victim, reservation: str = "paged",
                 max_model_len: int | None = None, scheduling_policy: str = "fcfs",
                 max_overtakes: int = 8, num_host_blocks: int | None = None,
                 disk_tier=None) -> None:
        for name, value, allowed in (("preemption_mode", preemption_mode, PREEMPTION_MODES),
                                     ("reservation", reservation, RESERVATIONS),
                                     ("scheduling_policy", scheduling_policy,
                                      policy.SCHEDULING_POLICIES)):
            if value not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
        if preemption_mode == "swap" and not enable_prefix_caching:
            raise ValueError("preemption_mode='swap' needs enable_prefix_caching=True (a "
                             "preempted request's blocks come back as prefix-cache hits)")
        self.block_size = check_int("block_size", block_size, minimum=1)
        self.max_num_seqs = check_int("max_num_seqs", max_num_seqs, minimum=1)
        self.max_num_batched_tokens = check_int("max_num_batched_tokens",
                                                max_num_batched_tokens, minimum=1)
        self.preemption_mode, self.reservation = preemption_mode, reservation
        self.scheduling_policy = scheduling_policy
        self.max_overtakes = check_int("max_overtakes", max_overtakes)
        self.num_host_blocks = host_tier_blocks(num_blocks, preemption_mode, num_host_blocks)
        self.manager = KVCacheManager(num_blocks, block_size,
                                      enable_prefix_caching=enable_prefix_caching,
                                      num_host_blocks=self.num_host_blocks, disk_tier=disk_tier)
        self.disk_tier = disk_tier
        self.max_model_len = max_model_len or num_blocks * block_size
        self.admit, self.choose_victim = admit, choose_victim
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

    def schedule(self, num_steps: int = 1) -> SchedulerOutput:
        """Pick the chunks of the next step, taking slots for them (see the module doc). If
        anything raises meanwhile (a policy function, the manager), :meth:`rollback` first.
        ``num_steps > 1``: a step where every chunk is a decode and nobody was admitted or
        preempted runs up to that many decode passes (:meth:`_lookahead`)."""
        out, budget = SchedulerOutput(), self.max_num_batched_tokens
        try:
            i = self._schedule_decodes(out, budget)  # (most steps: every running request)
            budget -= i
            while i < len(self.running) and budget > 0:
                req = self.running[i]
                n = min(req.num_to_compute, budget)
                while (slots := self._take_slots(req, n)) is None:
                    victim = self.running[i + self.choose_victim(self.running[i:])]
                    self._preempt(victim, out)
                    if victim is req:
                        break
                else:
                    out.chunks.append(Chunk(req, req.num_computed, n, slots))
                    budget -= n
                    i += 1
            if not out.preempted:
                self._admit(budget, out)
            if num_steps > 1 and not out.admitted and not out.preempted:
                self._lookahead(out, num_steps)
            if self.disk_tier is not None:  # start reading the next admissions' disk hits
                for req in islice(self.waiting, self.max_num_seqs):
                    self.manager.prefetch(req.tokens, req.block_hashes)
        except BaseException:
            self.rollback()
            raise
        out.block_ops = self.manager.take_block_ops()
        return out

    def update(self, out: SchedulerOutput, new_tokens: dict[int, int],
               stop_ids: frozenset[int] = frozenset()) -> list[Request]:
        """Record a finished step: chunks computed, sampled tokens appended, stops applied.

        ``new_tokens`` maps ``req_id`` to the token sampled for each chunk that ``samples``, or
        to a list of ``(request, token)``: the sequences that go on from its blocks -- itself,
        and new requests forked from it (:meth:`fork`: parallel samples at their first token, a
        beam kept twice); one missing from its own list is dropped (a beam not kept: freed,
        ``"dropped"``). A request stops after a token in ``stop_ids`` or its own ``stop_ids``
        (``"stop"``), or at ``max_new_tokens`` (``"length"``). Returns the requests that
        finished (freed). A multi-step decode (``out.steps``): each ``req_id`` maps to the
        tokens of its passes, in order; those after a stop are cut from that list, in place
        (what the engine delivers; their K/V went to blocks freed with the request), the
        others' K/V are in (``KVCacheManager.extend``).
        """
        finished = []
        for chunk in out.chunks:
            req = chunk.request
            req.num_computed = chunk.end
            if not chunk.samples:
                continue
            got = new_tokens[req.req_id]
            if isinstance(got, int) or out.steps:  # (most: one token, or its passes', no fork)
                went_on = [(req, got)]
            else:
                went_on = got
                for child, _ in reversed(went_on):  # (reversed: forks run in order after req)
                    if child is not req:
                        self.fork(req, child)
                if all(child is not req for child, _ in went_on):
                    self._finish(req, "dropped")
                    finished.append(req)
            for r, tokens in went_on:
                tokens = tokens if out.steps else [tokens]
                stop = next((j for j, t in enumerate(tokens)
                             if t in r.stop_ids or t in stop_ids), None)
                if stop is not None:
                    del tokens[stop + 1:]
                if out.steps:
                    self.manager.extend(r.req_id, tokens[:-1])  # (the inputs of passes 2, ...)
                    r.num_computed += len(tokens) - 1
                r.output += tokens
                if stop is not None or len(r.output) >= r.max_new_tokens:
                    self._finish(r, "length" if stop is None else "stop")
                    finished.append(r)
        return finished

    def fork(self, parent: Request, child: Request) -> None:
        """Start ``child`` (a new request with ``parent``'s tokens) on ``parent``'s blocks
        (``KVCacheManager.fork``: shared, copied on write), running right after ``parent``."""
        self.manager.fork(parent.req_id, child.req_id)
        child.num_computed, child.status = parent.num_computed, Status.RUNNING
        self.running.insert(self.running.index(parent) + 1, child)

    def abort(self, req: Request) -> None:
        """Drop ``req``, waiting or running, with all it holds (its blocks -- hashes past its
        computed tokens dropped -- and any reservation); its ``finish_reason`` is "abort"."""
        if req.status is Status.WAITING:
            self.waiting.remove(req)
            req.status, req.finish_reason = Status.FINISHED, "abort"
        elif req.status is Status.RUNNING:
            self._finish(req, "abort", num_computed=req.num_computed)

    def rollback(self, out: SchedulerOutput | None = None) -> list[Request]:
        """After a failed step: abort (and return) the running requests whose blocks run ahead
        of their computed tokens, and, given the step's ``out``, every other request it
        scheduled (an :meth:`update` that failed half-way recorded some chunks: those requests
        hold a token their caller never got). The others are as before."""
        # NOTE: a chunk recorded by a half-done update has its K/V written (num_computed ==
        # seq_len): aborting it keeps its hashes, but it must not run on a token ahead.
        scheduled = {id(c.request) for c in out.chunks} if out is not None else set()
        stale = [r for r in self.running if id(r) in scheduled
                 or self.manager.seq_len(r.req_id) != r.num_computed]
        for r in stale:
            self.abort(r)
        return stale

    # ---- helpers ----------------------------------------------------------------------------

    def _schedule_decodes(self, out: SchedulerOutput, budget: int) -> int:
        """The leading running decodes (no reservation) as one ``append_slots`` step if the pool
        has the blocks they need (else none: the per-request path preempts). Returns how many."""
        limit, n = min(len(self.running), budget), 0
        while n < limit and not self.running[n].reserved and self.running[n].num_to_compute == 1:
            n += 1
        reqs = self.running[:n]
        try:
            slots = self.manager.append_slots([r.req_id for r in reqs],
                                              [r.token_at(r.num_computed) for r in reqs])
        except OutOfBlocksError:  # (nothing taken)
            return 0
        out.chunks += [Chunk(r, r.num_computed, 1, [s]) for r, s in zip(reqs, slots, strict=True)]
        return n

    def _lookahead(self, out: SchedulerOutput, num_steps: int) -> None:
        """If every chunk is a decode: take the blocks (``KVCacheManager.lookahead``) for up to
        ``num_steps`` tokens each (fewer: what ``max_new_tokens`` leaves), a reservation paying
        for its own, and set ``out.steps``; if the pool is short, nothing (one pass)."""
        if not out.chunks or any(c.num_tokens != 1 or not c.samples for c in out.chunks):
            return
        reqs, bs = [c.request for c in out.chunks], self.block_size
        steps = [min(num_steps, r.max_new_tokens - len(r.output)) for r in reqs]
        need = [blocks_needed(r.num_computed + n, bs) - blocks_needed(r.num_computed + 1, bs)
                for r, n in zip(reqs, steps, strict=True)]
        paid = [min(n, r.reserved) for r, n in zip(reqs, need, strict=True)]
        if max(steps) == 1 or sum(need) - sum(paid) > self.manager.num_free_blocks:
            return
        for r, blocks in zip(reqs, paid, strict=True):
            if blocks:
                self._reserve(r, r.reserved - blocks)
        self.manager.lookahead([r.req_id for r in reqs], [n - 1 for n in steps])
        out.steps = steps

    def _take_slots(self, req: Request, n: int) -> list[int] | None:
        """Slots for ``req``'s next ``n`` tokens, or None (nothing taken) if blocks are short."""
        start, bs, m = req.num_computed, self.block_size, self.manager
        need = blocks_needed(start + n, bs) - blocks_needed(start, bs)
        if n and start % bs and m.ref_count(m.last_block(req.req_id)) > 1:
            need += 1  # (its last block is shared -- forked samples, beams: copied on write)
        left = req.reserved - need
        if need and req.reserved:  # its reservation pays: those blocks go back to be taken
            self._reserve(req, 0)
        elif need > self.manager.num_free_blocks:
            return None
        slots = [m.append_slot(req.req_id, req.token_at(t)) for t in range(start, start + n)]
        if left > 0 and not req.reserved:
            self._reserve(req, left)
        return slots

    def _reserve(self, req: Request, blocks: int) -> None:
        """Make ``req``'s reservation ``blocks`` blocks, held by a sequence of their own."""
        key = ("reserved", req.req_id)
        if req.reserved:
            self.manager.free_sequence(key)
            req.reserved = 0
        if blocks:
            self.manager.add_sequence(key, blocks * self.block_size)
            req.reserved = blocks

    def _admit(self, budget: int, out: SchedulerOutput) -> None:
        m, seats = self.manager, max(0, self.max_num_seqs - len(self.running))  # (forks: over)
        order = range(len(self.waiting)) if self.scheduling_policy == "fcfs" else (
            policy.admission_order([m.num_cached_tokens(r.prompt, r.block_hashes) for r in
                                    self.waiting], [r.overtaken for r in self.waiting],
                                   self.max_overtakes))
        heads = [self.waiting[j] for j in order[:seats]]
        count = self.admit([r.num_tokens for r in heads], m.num_free_blocks, self.block_size,
                           budget, seats)
        for req in heads[:count]:
            end = min(req.num_tokens, budget)
            hold = blocks_needed(reserved_tokens(self.reservation, len(req.prompt),
                                                 req.max_new_tokens, self.max_model_len),
                                 self.block_size)
            if budget <= 0 or hold > m.num_free_blocks:  # (the whole reservation or nothing)
                break
            try:
                cached = m.add_sequence(req.req_id, token_ids=req.tokens[:end])
            except OutOfBlocksError:
                break
            self.waiting.remove(req)
            req.status, req.num_computed = Status.RUNNING, cached
            self.running.append(req)
            self._reserve(req, max(0, hold - len(m.block_table(req.req_id))))
            out.admitted.append(req)
            out.cached_tokens += cached
            out.chunks.append(Chunk(req, cached, end - cached, m.slot_mapping(req.req_id, cached)))
            budget -= end - cached
        if self.scheduling_policy == "prefix" and out.admitted:  # (the aging bound's count)
            for r in self.waiting:
                r.overtaken += sum(a.req_id > r.req_id for a in out.admitted)

    def _finish(self, req: Request, reason: str, num_computed: int | None = None) -> None:
        self.manager.free_sequence(req.req_id, num_computed=num_computed)
        self._reserve(req, 0)
        self.running.remove(req)
        req.status, req.finish_reason = Status.FINISHED, reason

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        """Free ``victim``'s blocks and put it back at the head of the queue (recompute)."""
        self.manager.free_sequence(victim.req_id)
        self.running.remove(victim)
        victim.num_computed, victim.status = 0, Status.WAITING
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)
