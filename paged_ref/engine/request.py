"""One request as it moves through the engine (waiting -> running -> finished); what the engine
reports is in :mod:`paged_ref.outputs`. The engine asks one question of a request: how many of
its tokens still need their K/V computed? A prompt needs all (prefill, maybe in chunks), a
running request one (decode), a preempted one all again."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from paged_ref.outputs import RequestMetrics

if TYPE_CHECKING:
    from paged_ref.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  #: in the queue, holds no blocks
    RUNNING = "running"  #: holds blocks; scheduled every step while the token budget allows
    FINISHED = "finished"  #: stopped (``finish_reason``); holds nothing


@dataclass(eq=False)
class Request:
    """A generation request. ``req_id`` is also its ``seq_id`` in the block manager (arrival
    order); ``num_computed``: leading tokens whose K/V are in the cache; ``reserved``: blocks a
    reservation policy holds for it (:mod:`paged_ref.engine.policy`). A request with ``n > 1``
    samples is sample 0; samples 1..n-1 (ids ``req_id + i``) are requests of their own, forked
    from it at its first token: each runs (and is preempted) as any request does."""

    req_id: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams | None = None
    stop_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None  #: ``"stop"``, ``"length"`` or ``"abort"``
    num_preemptions: int = 0
    reserved: int = 0
    overtaken: int = 0  #: later arrivals admitted while it waited (``admission_order``)
    block_hashes: list[bytes] = field(default_factory=list)  #: its prompt's, as far as computed
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(0.0))
    generator: torch.Generator | None = None  #: a seeded request's own
    #: parallel sampling (``n > 1``) / beam search: the request this one was forked from
    parent: Request | None = None
    samples: list[Request] = field(default_factory=list)  #: ``n > 1``: samples 1..n-1

    @property
    def group(self) -> list[Request]:
        """This request and its other samples (all of a request with ``n > 1``, sample order)."""
        return [self, *self.samples]

    def samplers(self, generator: Callable[[int | None], torch.Generator | None]) -> list[Request]:
        """Who draws a token from this request's next logits: itself; at the first token of a
        request with ``n > 1``, also its samples 1..n-1 (new requests, ids ``req_id + i``,
        ``generator(params.sample_seed(i))`` each; :func:`fork_samples` forks them)."""
        n = self.params.n if self.params else 1
        if n == 1 or self.samples or self.parent is not None:
            return [self]
        return [self] + [Request(self.req_id + i, self.prompt, self.max_new_tokens, self.params,
                                 self.stop_ids, parent=self,
                                 generator=generator(self.params.sample_seed(i)))
                         for i in range(1, n)]

    @property
    def tokens(self) -> list[int]:
        """Prompt then output: every token whose K/V the cache may need."""
        return self.prompt + self.output

    def token_at(self, i: int) -> int:
        """Token ``i`` of prompt + output (without building the joined list)."""
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_to_compute(self) -> int:
        """Tokens whose K/V are still missing: the prompt (prefill) or 1 (decode)."""
        return self.num_tokens - self.num_computed


def fork_samples(reqs: list[Request], tokens: list[int]) -> dict[int, list]:
    """``Scheduler.update``'s ``new_tokens`` for the step's sampled requests ``reqs`` (from
    :meth:`Request.samplers`) and their ``tokens``: ``[(request, token)]`` each, but a new
    sample (one not started) joins its head's list, to be forked from it."""
    new: dict[int, list] = {}
    for r, t in zip(reqs, tokens, strict=True):
        owner = r.parent if r.status is Status.WAITING else r  # (a new sample: its head's)
        new.setdefault(owner.req_id, []).append((r, t))
        if owner is not r:
            owner.samples.append(r)
    return new
