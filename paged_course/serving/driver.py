"""Run an online engine against a clock: requests join as they arrive, latencies on that clock.

    result = run(engine, trace, WallClock())                      # a GPU: real time
    result = run(engine, trace, SimulatedClock(cost_model))        # a CPU: simulated time
    summarize(result)   # mean normalized latency, p50/p99 TTFT and TPOT, throughput

The driver loop: add every request whose arrival time has come (``engine.add_request``, with
``max_tokens`` = its true output length and ``ignore_eos``), run one ``engine.step()``, stamp
each token it returned with the clock's time after the step; when nothing is in flight, wait
for the next arrival. Times are the *driver's*: a request's latency starts at its arrival in
the trace -- if it arrived while a step was running, it waited for that step too.

:class:`WallClock` is real time (``time.perf_counter``): waiting sleeps. :class:`SimulatedClock`
never sleeps: waiting jumps to the next arrival, and each step advances it by the cost model's
seconds for what the step computed (:class:`~paged_course.serving.cost_model.StepShape`, which
the engine's runner reports: see :mod:`paged_course.serving.runners`). On a CPU the scheduler
and the block manager are the real ones; only the time is simulated.

The engine needs ``add_request(prompt_ids, params, *, arrival_time)``, ``step() -> outputs``
(each with ``request_id``, ``new_token_ids``, ``finished``), ``abort(request_id)`` and
``has_unfinished_requests()``: :class:`paged_ref.engine.Engine`'s online calls.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from paged_course.serving.cost_model import CostModel, StepShape
from paged_course.serving.workload import Trace

#: Consecutive steps that compute nothing before the driver gives up (an engine that cannot
#: admit its head request would otherwise spin forever).
MAX_IDLE_STEPS = 1000


class WallClock:
    """Real time, seconds since :meth:`start`; :meth:`wait_until` sleeps."""

    simulated = False

    def start(self) -> None:
        self.t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self.t0

    def wait_until(self, t: float) -> None:
        time.sleep(max(0.0, t - self.now()))

    def advance(self, shape: StepShape) -> None:
        """A step ran; real time has moved by itself."""

    def engine_time(self, t: float) -> float | None:
        """Clock time ``t`` as the engine's ``arrival_time`` (``time.perf_counter`` seconds)."""
        return self.t0 + t


class SimulatedClock:
    """Simulated time: each step lasts ``cost_model(shape)`` seconds; waiting jumps."""

    simulated = True

    def __init__(self, cost_model: CostModel | Callable[[StepShape], float]) -> None:
        if not callable(cost_model):
            raise TypeError(f"cost_model must be a CostModel (or shape -> seconds), got "
                            f"{type(cost_model).__name__}")
        self.cost_model = cost_model

    def start(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t

    def wait_until(self, t: float) -> None:
        self.t = max(self.t, t)

    def advance(self, shape: StepShape) -> None:
        self.t += float(self.cost_model(shape))

    def engine_time(self, t: float) -> float | None:
        return None  # (the engine's own perf_counter stamps mean nothing in simulated time)


@dataclass
class RequestRecord:
    """One request on the driver's clock (s): arrival (the trace's), when the driver handed it
    to the engine, each output token, finish."""

    index: int  #: position in the trace
    arrival_s: float
    added_s: float
    prompt_len: int
    output_len: int
    token_times: list[float] = field(default_factory=list)
    finished_s: float | None = None

    @property
    def ttft(self) -> float | None:
        """Time to first token: arrival -> first output token (s)."""
        return self.token_times[0] - self.arrival_s if self.token_times else None

    @property
    def tpot(self) -> float | None:
        """Time per output token after the first: their mean spacing (s)."""
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def e2e(self) -> float | None:
        """End-to-end latency: arrival -> finish (s)."""
        return None if self.finished_s is None else self.finished_s - self.arrival_s

    @property
    def normalized_latency(self) -> float | None:
        """End-to-end latency / output tokens (s/token): the PagedAttention paper's metric."""
        n = len(self.token_times)
        return self.e2e / n if n and self.e2e is not None else None


@dataclass(frozen=True)
class StepRecord:
    """One step on the driver's clock: start, end (s), what it computed, requests in flight."""

    start_s: float
    end_s: float
    shape: StepShape
    in_flight: int  #: requests added and not finished when the step started

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


@dataclass
class RunResult:
    """Everything a run recorded; :func:`summarize` turns it into the curve's numbers."""

    trace: Trace
    requests: list[RequestRecord]
    steps: list[StepRecord]
    simulated: bool
    truncated: bool = False  #: stopped at ``max_seconds`` with requests unfinished (aborted)


def default_params(output_len: int):
    """``SamplingParams(max_tokens=output_len, ignore_eos=True)``: greedy, the true length."""
    from paged_ref.engine import SamplingParams

    return SamplingParams(max_tokens=output_len, ignore_eos=True)


def step_shape(engine) -> StepShape:
    """What the last step computed, as the engine's runner reported it (the runners of
    :mod:`paged_course.serving.runners` keep it); ``StepShape()`` if nothing ran."""
    take = getattr(getattr(engine, "runner", None), "take_shape", None)
    if take is None:
        raise TypeError("the engine's runner does not report step shapes: wrap it first "
                        "(paged_course.serving.runners.instrument(engine))")
    return take() or StepShape()


def run(engine, trace: Trace, clock, *, vocab_size: int | None = None,
        params: Callable[[int], object] = default_params,
        max_seconds: float | None = None) -> RunResult:
    """Serve ``trace`` on ``engine`` against ``clock`` (see the module doc).

    Args:
        engine: an online engine (idle: nothing unfinished).
        trace: the requests, in arrival order.
        clock: :class:`WallClock` or :class:`SimulatedClock`.
        vocab_size: prompt ids are drawn below it (default ``engine.vocab_size``).
        params: output length -> the request's sampling params.
        max_seconds: stop at this clock time; the unfinished requests are aborted and the
            result is marked ``truncated`` (a guard for overloaded points on a GPU).

    Raises:
        RuntimeError: the engine has unfinished requests, or it ran ``MAX_IDLE_STEPS`` steps
            in a row that computed nothing.
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("run needs an idle engine: finish or abort its requests first")
    vocab = vocab_size or engine.vocab_size
    records: dict[int, RequestRecord] = {}
    steps: list[StepRecord] = []
    in_flight: set[int] = set()  # ids added and not finished
    reqs, i, idle, truncated = trace.requests, 0, 0, False
    clock.start()
    while True:
        now = clock.now()
        while i < len(reqs) and reqs[i].arrival_s <= now:
            r = reqs[i]
            rid = engine.add_request(trace.prompt_ids(i, vocab), params(r.output_len),
                                     arrival_time=clock.engine_time(r.arrival_s))
            records[rid] = RequestRecord(i, r.arrival_s, now, r.prompt_len, r.output_len)
            in_flight.add(rid)
            i += 1
        if max_seconds is not None and now >= max_seconds and (in_flight or i < len(reqs)):
            for rid in sorted(in_flight):
                engine.abort(rid)
            truncated = True
            break
        if not engine.has_unfinished_requests():
            if i == len(reqs):
                break
            clock.wait_until(reqs[i].arrival_s)
            continue
        flying = len(in_flight)
        outputs = engine.step()
        shape = step_shape(engine)
        clock.advance(shape)
        end = clock.now()
        steps.append(StepRecord(now, end, shape, flying))
        idle = 0 if shape.tokens else idle + 1
        if idle >= MAX_IDLE_STEPS:
            raise RuntimeError(f"{idle} steps in a row computed nothing with "
                               f"{len(in_flight)} requests in flight")
        for out in outputs:
            rec = records[out.request_id]
            rec.token_times.extend([end] * len(out.new_token_ids))
            if out.finished:
                rec.finished_s = end
                in_flight.discard(out.request_id)
    return RunResult(trace, sorted(records.values(), key=lambda r: r.index), steps,
                     bool(clock.simulated), truncated)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else math.nan


def summarize(result: RunResult) -> dict:
    """The curve's numbers for one run (s, tokens/s):

    ``mean_normalized_latency_s`` (mean over finished requests of e2e / output tokens),
    ``p50/p99_ttft_s``, ``p50/p99_tpot_s`` (requests with >= 2 tokens), ``mean_e2e_s``,
    ``throughput_tok_s`` (output tokens of finished requests / (last finish - first arrival)),
    ``mean_running`` (requests per step, weighted by the steps' durations), ``max_running``,
    ``finished``, ``requests``, ``truncated``, ``rate_rps``, ``steps``.
    """
    done = [r for r in result.requests if r.finished_s is not None]
    ttft = [r.ttft for r in result.requests if r.ttft is not None]
    tpot = [r.tpot for r in result.requests if r.tpot is not None]
    tokens = sum(len(r.token_times) for r in done)
    span = (max(r.finished_s for r in done) - min(r.arrival_s for r in done)) if done else 0.0
    busy = sum(s.seconds for s in result.steps)
    return {
        "rate_rps": result.trace.rate_rps,
        "mean_normalized_latency_s": (float(np.mean([r.normalized_latency for r in done]))
                                      if done else math.nan),
        "p50_ttft_s": _pct(ttft, 50), "p99_ttft_s": _pct(ttft, 99),
        "p50_tpot_s": _pct(tpot, 50), "p99_tpot_s": _pct(tpot, 99),
        "mean_e2e_s": float(np.mean([r.e2e for r in done])) if done else math.nan,
        "throughput_tok_s": tokens / span if span > 0 else math.nan,
        "mean_running": (sum(s.shape.seqs * s.seconds for s in result.steps) / busy
                         if busy > 0 else 0.0),
        "max_running": max((s.shape.seqs for s in result.steps), default=0),
        "finished": len(done), "requests": len(result.trace), "truncated": result.truncated,
        "steps": len(result.steps),
    }
