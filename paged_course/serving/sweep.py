"""Latency against request rate per reservation policy, and the sustained rate (the paper's
Fig. 12 and its headline).

The **latency bound** of a dataset is ``BOUND_FACTOR`` (2) x its *unloaded* latency, the mean
normalized latency at the lowest rate of the sweep, taken as the minimum over the policies (at a
low rate a request hardly waits and every policy serves it alike): one bound for every policy
of that dataset. The **sustained rate** of a policy is the highest rate whose mean normalized
latency stays within the bound: walking up the rates, the first point above it and the point
before it are joined by a straight line, and the rate where that line crosses the bound is the
answer (None if even the lowest rate is above it; the highest rate, marked as a lower bound, if
no point is). A truncated point (a run stopped before its requests finished) counts as above,
and the point before it is the answer (its latency, of the finished requests only, is too low to
interpolate against).

:data:`PAPER` quotes what the paper found for the same comparison.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable, Sequence

from paged_course.serving.cost_model import CostModel, StepShape
from paged_course.serving.driver import RunResult, SimulatedClock, run, summarize
from paged_course.serving.workload import Trace
from paged_course.simulate import reserved_slots
from paged_ref.cache_math import blocks_needed

POLICIES = ("paged", "reserve_max", "reserve_pow2", "reserve_oracle")
#: The latency bound, as a multiple of the unloaded mean normalized latency.
BOUND_FACTOR = 2.0
#: Kwon et al., "Efficient Memory Management for Large Language Model Serving with
#: PagedAttention", SOSP 2023, §6.2 (Fig. 12: OPT-13B on one A100, 66B on four, 175B on eight;
#: ShareGPT and Alpaca lengths, Poisson arrivals; Orca re-implemented by the authors).
PAPER = {
    "ShareGPT": "vLLM can sustain 1.7x-2.7x higher request rates compared to Orca (Oracle) and "
                "2.7x-8x compared to Orca (Max), while maintaining similar latencies",
    "FasterTransformer": "Compared to FasterTransformer, vLLM can sustain up to 22x higher "
                         "request rates",
    "Alpaca": "a similar trend to the ShareGPT dataset. One exception is Fig. 12 (f), where "
              "vLLM's advantage over Orca (Oracle) and Orca (Pow2) is less pronounced",
    "batched": "for OPT-13B vLLM processes 2.2x more requests at the same time than Orca "
               "(Oracle) and 4.3x more requests than Orca (Max)",
}
#: The paper's sustained-rate ratios on ShareGPT, (lowest, highest) over its three models.
PAPER_RATIO_SHAREGPT = {"reserve_oracle": (1.7, 2.7), "reserve_max": (2.7, 8.0)}


def _above(point: dict, bound: float) -> bool:
    lat = point["mean_normalized_latency_s"]
    return bool(point.get("truncated")) or not (lat <= bound)  # (NaN counts as above)


def sustained_rate(curve: Sequence[dict], bound: float) -> tuple[float | None, bool]:
    """``(rate, is_lower_bound)``: the highest rate (requests/s) whose mean normalized latency
    stays within ``bound`` s/token, interpolated (see the module doc).

    Args:
        curve: points with ``rate_rps`` and ``mean_normalized_latency_s`` (any order).
        bound: the latency bound, s/token.

    Returns:
        ``(None, False)`` if the lowest rate is already above ``bound``; ``(highest rate, True)``
        if no point is (the sustained rate is at least that).
    """
    if not curve:
        raise ValueError("curve is empty")
    pts = sorted(curve, key=lambda p: p["rate_rps"])
    if _above(pts[0], bound):
        return None, False
    for lo, hi in zip(pts, pts[1:], strict=False):
        if _above(hi, bound):
            r0, r1 = lo["rate_rps"], hi["rate_rps"]
            l0, l1 = lo["mean_normalized_latency_s"], hi["mean_normalized_latency_s"]
            if hi.get("truncated") or not math.isfinite(l1) or l1 <= l0:
                return r0, False  # (nothing to interpolate against: the last point within)
            return r0 + (bound - l0) / (l1 - l0) * (r1 - r0), False
    return pts[-1]["rate_rps"], True


def latency_bound(curves: Iterable[Sequence[dict]], factor: float = BOUND_FACTOR) -> float:
    """``factor`` x the lowest mean normalized latency among the curves' lowest-rate points."""
    firsts = [min(c, key=lambda p: p["rate_rps"])["mean_normalized_latency_s"] for c in curves]
    if not firsts:
        raise ValueError("no curves")
    return factor * min(firsts)


def held_at_once(policy: str, trace: Trace, num_blocks: int, block_size: int,
                 max_num_seqs: int = 256) -> float:
    """About how many of ``trace``'s requests fit in the pool at once under ``policy``: the
    pool over the mean blocks one request holds -- its reservation, or for ``"paged"`` its
    prompt plus half its output (what it holds on average while it decodes) -- at most
    ``max_num_seqs``. A first guess for where each policy's knee lies."""
    held = []
    for r in trace.requests:
        if policy == "paged":
            held.append(blocks_needed(r.prompt_len + r.output_len // 2, block_size))
        else:  # lesson 01's reservations: "max", "pow2", "oracle"
            tokens = reserved_slots(policy.removeprefix("reserve_"), r.prompt_len,
                                    r.output_len, trace.max_len)
            held.append(blocks_needed(tokens, block_size))
    return min(max_num_seqs, num_blocks / (sum(held) / len(held)))


def capacity_rps(policy: str, trace: Trace, num_blocks: int, block_size: int,
                 step_seconds: Callable[[int], float], max_num_seqs: int = 256) -> float:
    """Requests/s the pool can serve under ``policy`` at saturation, roughly: ``C`` requests
    at once (:func:`held_at_once`), each taking its mean output length of steps of
    ``step_seconds(C)`` seconds."""
    held = held_at_once(policy, trace, num_blocks, block_size, max_num_seqs)
    mean_out = sum(r.output_len for r in trace.requests) / len(trace.requests)
    return held / (mean_out * step_seconds(max(1, round(held))))


def decode_step_seconds(cost: CostModel, trace: Trace) -> Callable[[int], float]:
    """``b -> cost`` of a decode step of ``b`` requests, each at ``trace``'s mean context
    (prompt + half the output): what :func:`capacity_rps` takes as ``step_seconds``."""
    ctx = sum(r.prompt_len + r.output_len / 2 for r in trace.requests) / len(trace.requests)
    return lambda b: cost(StepShape(b, b, int(b * ctx)))


def rate_grid(capacity: float, factors: Sequence[float] = (0.3, 0.6, 0.85, 1.05, 1.3),
              digits: int = 3) -> list[float]:
    """Rates around a knee: ``capacity`` x ``factors``, rounded to ``digits`` significant digits."""
    return [float(f"{capacity * f:.{digits}g}") for f in factors]


def requests_for(rate_rps: float, span_s: float, available: int, min_requests: int = 1) -> int:
    """Requests that arrive over ``span_s`` seconds at ``rate_rps`` (rounded up), clamped to
    ``[min_requests, available]``."""
    if not span_s > 0:
        raise ValueError(f"span_s must be > 0, got {span_s}")
    return max(1, min(available, max(min_requests, math.ceil(rate_rps * span_s))))


def sweep_policy(make_engine: Callable[[], object], trace: Trace, rates: Sequence[float],
                 clock_factory: Callable[[], object], *, max_seconds: float | None = None,
                 progress: Callable[[str], None] | None = None,
                 keep: list[RunResult] | None = None, span_s: float | None = None,
                 min_requests: int = 1) -> list[dict]:
    """One curve: ``trace`` at each of ``rates`` on one engine (``make_engine()``, built once
    and reused: it is idle between runs), each against a fresh ``clock_factory()``. Returns the
    :func:`~paged_course.serving.driver.summarize` points in rate order; ``keep`` (a list)
    collects the runs themselves.

    ``span_s``: size each point in seconds of arrivals, not in requests -- its first
    ``rate x span_s`` requests of ``trace`` (at least ``min_requests``, at most all), so that
    a high rate still arrives over ``span_s`` seconds rather than as one burst that the
    engine drains, which measures the burst, not the rate. None: every point has all of
    ``trace``."""
    engine, points = make_engine(), []
    for rate in sorted(rates):
        n = len(trace) if span_s is None else requests_for(rate, span_s, len(trace),
                                                             min_requests)
        result = run(engine, trace.head(n).at_rate(rate), clock_factory(),
                     max_seconds=max_seconds)
        points.append(summarize(result))
        if keep is not None:
            keep.append(result)
        if progress is not None:
            p = points[-1]
            progress(f"  rate {rate:8.3g} req/s: normalized latency "
                     f"{p['mean_normalized_latency_s'] * 1e3:8.2f} ms/token, p99 TTFT "
                     f"{p['p99_ttft_s']:7.3f} s, {p['mean_running']:5.1f} running"
                     + (" (truncated)" if p["truncated"] else ""))
    return points


def sweep_to_knee(make_engine: Callable[[], object], trace: Trace, first_rate: float,
                  clock_factory: Callable[[], object], *, unloaded_s: float,
                  growth: float = 1.6, max_points: int = 7, factor: float = BOUND_FACTOR,
                  deadline: float | None = None, **run_kw) -> list[dict]:
    """One curve found rather than planned (a GPU's knees are not known in advance): rates
    from ``first_rate`` up, ``growth`` x each time, until a point is above ``factor`` x the
    first point's mean normalized latency (or truncated) -- the knee crossed, so the sustained
    rate at any bound up to that one lies between two measured points.

    The first point must be unloaded: while its latency is above 1.5 x ``unloaded_s`` (the
    latency alone, e.g. the cost model's decode step at batch 1, s/token), the start moves
    down by ``growth ** 2`` (at most twice). Stops early at ``max_points`` points, or before a
    point once ``deadline`` (``time.perf_counter()`` s) has passed. Returns the
    :func:`~paged_course.serving.driver.summarize` points in rate order; ``run_kw``:
    :func:`sweep_policy`'s options (``span_s``, ``max_seconds``, ``progress``, ...)."""
    if not (first_rate > 0 and growth > 1 and unloaded_s > 0):
        raise ValueError(f"need first_rate > 0, growth > 1, unloaded_s > 0; got {first_rate}, "
                         f"{growth}, {unloaded_s}")
    points: list[dict] = []

    def measure(rate: float) -> dict:
        points.extend(sweep_policy(make_engine, trace, [rate], clock_factory, **run_kw))
        return points[-1]

    rate, first = first_rate, measure(first_rate)
    for _ in range(2):
        if not _above(first, 1.5 * unloaded_s):
            break
        rate /= growth**2
        first = measure(rate)
    bound = factor * first["mean_normalized_latency_s"]
    while len(points) < max_points:
        within = [p["rate_rps"] for p in points if not _above(p, bound)]
        above = [p["rate_rps"] for p in points if _above(p, bound)]
        if not within or (above and max(within) * growth >= min(above) * 0.99):
            break  # (the crossing lies between two points at most ``growth`` apart)
        if deadline is not None and time.perf_counter() > deadline:
            break
        measure(max(within) * growth)
    return sorted(points, key=lambda p: p["rate_rps"])


def records(curves: dict[str, list[dict]], dataset: str,
            factor: float = BOUND_FACTOR) -> list[dict]:
    """The result records of one dataset: per policy ``{"policy", "dataset",
    "sustained_rate_rps", "sustained_is_lower_bound", "latency_bound_s", "curve"}``, the
    bound shared (:func:`latency_bound`), plus ``"x_reserve_max"`` / ``"x_reserve_oracle"``:
    paged's sustained rate over that policy's (None where either is unknown)."""
    bound = latency_bound(curves.values(), factor)
    out, rate = [], {}
    for policy, curve in curves.items():
        rate[policy], lower = sustained_rate(curve, bound)
        out.append({"policy": policy, "dataset": dataset, "sustained_rate_rps": rate[policy],
                    "sustained_is_lower_bound": lower, "latency_bound_s": bound,
                    "bound_factor": factor, "curve": curve})
    for rec in out:
        for other in ("reserve_max", "reserve_oracle"):
            if rec["policy"] == "paged" and rate.get(other) and rate["paged"] is not None:
                rec[f"x_{other}"] = rate["paged"] / rate[other]
    return out


def simulated_curves(trace: Trace, cost: CostModel, *, num_blocks: int, block_size: int = 16,
                     factors: Sequence[float] = (0.3, 0.6, 0.85, 1.05, 1.3),
                     policies: Sequence[str] = POLICIES,
                     progress: Callable[[str], None] | None = None
                     ) -> tuple[dict[str, list[dict]], dict[str, list[RunResult]]]:
    """Every policy's curve in simulated time: the real scheduler and block manager
    (:func:`~paged_course.serving.runners.simulation_engine`, ``num_blocks`` blocks,
    ``max_model_len = trace.max_len``), each step lasting ``cost`` seconds, at ``factors`` x
    the policy's :func:`capacity_rps`. Returns ``(curves, runs)``, both keyed by policy."""
    from paged_course.serving.runners import simulation_engine

    curves, runs = {}, {}
    for policy in policies:
        cap = capacity_rps(policy, trace, num_blocks, block_size,
                           decode_step_seconds(cost, trace))
        if progress is not None:
            progress(f"{trace.dataset} {policy} (simulated, {len(trace)} requests):")
        runs[policy] = []
        curves[policy] = sweep_policy(
            lambda p=policy: simulation_engine(p, num_blocks=num_blocks, block_size=block_size,
                                               max_model_len=trace.max_len),
            trace, rate_grid(cap, factors), lambda: SimulatedClock(cost), progress=progress,
            keep=runs[policy])
    return curves, runs
