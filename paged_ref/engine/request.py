"""One request as it moves through the engine (waiting -> running -> finished); what the engine
reports is in :mod:`paged_ref.outputs`. The engine asks one question of a request: how many of
its tokens still need their K/V computed? A prompt needs all (prefill, maybe in chunks), a
running request one (decode), a preempted one all again."""

from __future__ import annotations

import enum
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
    reservation policy holds for it (:mod:`paged_ref.engine.policy`)."""

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
