"""One request as it moves through the engine (waiting -> running -> finished), its clock, and
what the engine reports: per request and step, per step, per ``generate`` call. The engine asks
one question of a request: how many of its tokens still need their K/V computed? A prompt needs
all (prefill, maybe in chunks), a running request one (decode), a preempted one all again."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from paged_ref.sampling.params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  #: in the queue, holds no blocks
    RUNNING = "running"  #: holds blocks; scheduled every step while the token budget allows
    FINISHED = "finished"  #: stopped (``finish_reason``); holds nothing


@dataclass
class RequestMetrics:
    """A request's clock, ``time.perf_counter()`` seconds, and its latencies (None until known):
    ``ttft`` arrival -> first token; ``tpot`` mean time between the later tokens; ``e2e``
    arrival -> finish; ``normalized_latency`` e2e per output token (the PagedAttention paper's)."""

    arrival: float
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)  #: when each output token came
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival

    @property
    def normalized_latency(self) -> float | None:
        n = len(self.token_times)
        return self.e2e / n if n and self.e2e is not None else None


@dataclass(frozen=True)
class RequestOutput:
    """One request's news from a step: ``new_token_ids`` generated this step,
    ``output_token_ids`` all so far; ``finish_reason`` once ``finished``: ``"stop"`` (EOS or a
    stop token, kept in the output) or ``"length"`` (``max_tokens``)."""

    request_id: int
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics


@dataclass(frozen=True)
class StepEvent:
    """One step of ``generate``; requests named by their index in its ``prompts``. ran:
    ``(request, first token, tokens computed)`` per chunk; new_tokens: request -> token;
    block_tables / seq_lens / num_free_blocks (free or evictable): after the step."""

    step: int
    ran: list[tuple[int, int, int]]
    admitted: list[int]
    preempted: list[int]
    finished: list[int]
    new_tokens: dict[int, int]
    block_tables: dict[int, list[int]]
    seq_lens: dict[int, int]
    num_free_blocks: int
    num_blocks: int
    block_size: int
    cached_tokens: int
    seconds: float

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step (the batch size in tokens)."""
        return sum(n for _, _, n in self.ran)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for _, _, n in self.ran)


@dataclass
class RunStats:
    """Totals of the last ``generate`` call (times in seconds)."""

    steps: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0  #: prompt + recomputed + decode tokens run through the model
    cached_tokens: int = 0  #: prompt tokens served by the prefix cache instead
    output_tokens: int = 0
    preemptions: int = 0
    max_running: int = 0  #: most requests holding blocks at once
    seconds: float = 0.0
    ttft_s: list[float] = field(default_factory=list)  #: time to first token per request
    metrics: list[RequestMetrics | None] = field(default_factory=list)  #: per request

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


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
