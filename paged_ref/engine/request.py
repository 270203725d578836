"""One request's state as it moves through the engine: waiting -> running -> finished.

A request is a list of token ids (prompt, then the tokens generated so far). The engine only
ever asks one question of it: how many of its tokens still need their K/V computed? A prompt
needs all of them (prefill, maybe in chunks); a running request needs one, the token it just
sampled (decode); a request preempted by recompute needs its prompt and its output again.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from numbers import Integral

import numpy as np
import torch

from paged_ref.engine.sampling_params import SamplingParams
from paged_ref.memory.allocator import check_int


class Status(enum.Enum):
    WAITING = "waiting"  #: in the queue, holds no blocks
    RUNNING = "running"  #: holds blocks; scheduled every step while the token budget allows
    FINISHED = "finished"  #: stopped (``finish_reason``); holds nothing


@dataclass
class RequestMetrics:
    """A request's clock (``time.perf_counter()`` seconds) and the latencies it gives."""

    arrival: float
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)  #: when each output token came
    finished: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival -> first output token, seconds."""
        return self.token_times[0] - self.arrival if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first (their mean spacing), seconds."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e(self) -> float | None:
        """End-to-end latency: arrival -> finish, seconds."""
        return None if self.finished is None else self.finished - self.arrival

    @property
    def normalized_latency(self) -> float | None:
        """End-to-end latency per output token (the PagedAttention paper's metric), s/token."""
        n = len(self.token_times)
        return self.e2e / n if n and self.e2e is not None else None


@dataclass(frozen=True)
class RequestOutput:
    """What one step did for one request (what :meth:`Engine.step` returns).

    request_id: the id ``add_request`` returned; new_token_ids: tokens generated this step;
    output_token_ids: every token generated so far; finished / finish_reason: ``"stop"`` (EOS
    or a stop token, kept in the output) or ``"length"`` (``max_tokens``) once it is done.
    """

    request_id: int
    new_token_ids: list[int]
    output_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    metrics: RequestMetrics


@dataclass(eq=False)
class Request:
    """A generation request. ``req_id`` is also its ``seq_id`` in the block manager (arrival
    order); ``num_computed``: leading tokens whose K/V are in the cache; ``reserved``: blocks
    held up front by a reservation policy (see :mod:`paged_ref.engine.policy`)."""

    req_id: int
    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams | None = None
    stop_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
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


def as_token_ids(name: str, value, *, scalar: bool = False, minimum: int | None = 0) -> list[int]:
    """``value`` as a list of token ids.

    Args:
        name: the argument, for messages.
        value: a list / tuple of ints (NumPy ints too), or a 1-D integer torch tensor or NumPy
            array; with ``scalar``, also one int, NumPy int or 0-d integer tensor / array.
        minimum: the smallest id allowed (None: no bound).

    Raises:
        TypeError: a string, a float (also a float tensor), a tensor of another rank.
        ValueError: an id below ``minimum``.
    """
    if isinstance(value, (torch.Tensor, np.ndarray)):
        floats = (value.dtype.is_floating_point or value.dtype.is_complex
                  or value.dtype == torch.bool) if isinstance(value, torch.Tensor) else \
            not np.issubdtype(value.dtype, np.integer)
        if floats:
            raise TypeError(f"{name} must hold integer token ids, got dtype {value.dtype}")
        if value.ndim not in ((0, 1) if scalar else (1,)):
            raise TypeError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        value = value.tolist()
    if scalar and isinstance(value, Integral) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"{name} must be a list of token ids, got {type(value).__name__}"
                        + (" (encode text with the tokenizer first)" if isinstance(
                            value, str) else ""))
    return [check_int(f"{name}[{j}]", t, minimum=minimum) for j, t in enumerate(value)]
