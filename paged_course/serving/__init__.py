"""Serving under load (lesson 12): arrivals, a driver against a clock, latency against rate.

    from paged_course import serving
    trace = serving.make_trace("ShareGPT-like", n=200, rate_rps=2.0, seed=0)
    result = serving.run(engine, trace, serving.WallClock())          # GPU, real time
    result = serving.run(engine, trace, serving.SimulatedClock(cost))  # CPU, simulated time
    serving.summarize(result)   # mean normalized latency, p50/p99 TTFT / TPOT, throughput

Modules, one job each: ``workload`` (Poisson arrivals, ShareGPT-like / Alpaca-like lengths,
traces and their file format), ``driver`` (the clocks, the run loop, per-request records and
their summary), ``cost_model`` (a step's seconds from its shape; the non-negative fit),
``runners`` (runner wrappers that report each step's shape; the CPU simulation engine),
``sweep`` (curves over rates, the latency bound, the sustained rate, the paper's numbers),
``plot`` (the pictures).
"""

from paged_course.serving.cost_model import PRIOR_H200, CostModel, StepShape, fit, fit_error
from paged_course.serving.driver import (
    RequestRecord,
    RunResult,
    SimulatedClock,
    StepRecord,
    WallClock,
    run,
    summarize,
)
from paged_course.serving.runners import (
    NullRunner,
    TimedRunner,
    instrument,
    simulation_engine,
)
from paged_course.serving.sweep import (
    BOUND_FACTOR,
    PAPER,
    POLICIES,
    capacity_rps,
    held_at_once,
    latency_bound,
    rate_grid,
    records,
    sustained_rate,
    sweep_policy,
)
from paged_course.serving.workload import (
    Trace,
    TraceRequest,
    length_table,
    load_trace,
    make_trace,
    poisson_arrivals,
    save_trace,
)

__all__ = ["BOUND_FACTOR", "PAPER", "POLICIES", "PRIOR_H200", "CostModel", "NullRunner",
           "RequestRecord", "RunResult", "SimulatedClock", "StepRecord", "StepShape",
           "TimedRunner", "Trace", "TraceRequest", "WallClock", "capacity_rps", "fit",
           "fit_error", "held_at_once", "instrument", "latency_bound", "length_table",
           "load_trace", "make_trace", "poisson_arrivals", "rate_grid", "records", "run",
           "save_trace", "simulation_engine", "summarize", "sustained_rate", "sweep_policy"]
