"""What the engine reports (vLLM's ``outputs``): per request (:class:`RequestOutput`, its clock
:class:`RequestMetrics`), per step (:class:`StepEvent`) and per ``generate`` call
(:class:`RunStats`). Times are seconds on the engine's clock (``time.perf_counter``)."""

from __future__ import annotations

from dataclasses import dataclass, field


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
class CompletionOutput:
    """One completion of a request (vLLM's): sample ``index`` of a request with ``n`` samples,
    or the ``index``-th best hypothesis of a beam search (``score``: its length-penalised
    log-probability, transformers' ``sequences_scores``; None when sampling)."""

    index: int
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    score: float | None = None


@dataclass(frozen=True)
class RequestOutput:
    """One request's news from a step: ``new_token_ids`` generated this step,
    ``output_token_ids`` all so far; ``finish_reason`` once ``finished``: ``"stop"`` (EOS or a
    stop token, kept in the output) or ``"length"`` (``max_tokens``). ``outputs``: every
    completion (one; a request with ``n > 1``: its ``n`` samples; a beam search: its beams,
    best first); the fields before it are ``outputs[0]``'s, but ``finished`` is the request's
    (all its completions finished)."""

    request_id: int
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics
    outputs: list[CompletionOutput] = field(default_factory=list)


@dataclass(frozen=True)
class StepEvent:
    """One step of ``generate``; requests named by their index in its ``prompts``. ran:
    ``(request, first token, tokens computed)`` per chunk; new_tokens: request -> token (a
    list: a multi-step decode's, ``passes`` > 1); block_tables / seq_lens / num_free_blocks
    (free or evictable): after the step."""

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
    passes: int = 1  #: decode passes (> 1: a multi-step decode, ``num_scheduler_steps``)

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step (the batch size in tokens)."""
        return sum(n for _, _, n in self.ran)

    @property
    def is_decode(self) -> bool:
        return self.passes > 1 or all(n == 1 for _, _, n in self.ran)


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
