"""paged_course.serving: Poisson arrivals, traces, the driver's latencies on a fake engine with
known step times, the cost-model fit, the sustained rate, and (with the online engine) the real
scheduler under a binding pool.

The ``check_*`` functions take the module they test, so that
``tests/course/test_serving_mutations.py`` runs the same checks on modules with planted
mistakes and shows each one is caught.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from paged_course.serving import cost_model, driver, sweep, workload
from paged_course.serving.cost_model import CostModel, StepShape
from paged_course.serving.workload import Trace, TraceRequest
from tests.course.serving_fakes import FakeEngine


def hand_trace() -> Trace:
    """Three requests: one at 0, one arriving mid-step, one after an idle gap."""
    reqs = (TraceRequest(0.0, 5, 3), TraceRequest(0.015, 4, 2), TraceRequest(0.5, 2, 1))
    return Trace(reqs, "hand", 1.0, 0, 64)


TEN_MS = CostModel(a=0.01)


def fake_run(drv, trace=None, cost=TEN_MS, **kw):
    return drv.run(FakeEngine(**kw), trace or hand_trace(), drv.SimulatedClock(cost),
                   params=lambda n: n)


# ---- arrivals and traces ------------------------------------------------------------------


def check_poisson(wl):
    """Gaps of mean 1 / rate, exponential (coefficient of variation 1, P(gap > mean) = 1/e)."""
    for rate in (0.5, 3.0, 40.0):
        t = wl.poisson_arrivals(20_000, rate, seed=3)
        gaps = np.diff(np.concatenate([[0.0], t]))
        assert (gaps >= 0).all()
        assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
        assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.04)
        assert (gaps > 1 / rate).mean() == pytest.approx(math.exp(-1), abs=0.015)
    counts = np.bincount(wl.poisson_arrivals(20_000, 5.0, seed=4).astype(int))[:-1]
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.15)  # Poisson counts


def check_rates_scale_one_trace(wl):
    """Traces of one seed at two rates: the same requests, every gap scaled."""
    a, b = wl.make_trace("ShareGPT-like", 50, 2.0, seed=5), wl.make_trace("ShareGPT-like", 50,
                                                                          8.0, seed=5)
    assert [(r.prompt_len, r.output_len) for r in a.requests] == \
        [(r.prompt_len, r.output_len) for r in b.requests]
    np.testing.assert_allclose([r.arrival_s / 4 for r in a.requests],
                               [r.arrival_s for r in b.requests])
    c = a.at_rate(8.0)
    np.testing.assert_allclose([r.arrival_s for r in c.requests],
                               [r.arrival_s for r in b.requests])
    assert c.rate_rps == 8.0


def test_arrivals_are_poisson():
    check_poisson(workload)


def test_one_seed_one_trace_at_every_rate():
    check_rates_scale_one_trace(workload)


def test_seeds_reproduce_and_differ():
    a = workload.make_trace("Alpaca-like", 30, 1.0, seed=1)
    assert a == workload.make_trace("Alpaca-like", 30, 1.0, seed=1)
    assert a != workload.make_trace("Alpaca-like", 30, 1.0, seed=2)
    assert a.prompt_ids(4, 1000) == a.prompt_ids(4, 1000) != a.prompt_ids(5, 1000)
    ids = a.prompt_ids(4, 1000)
    assert len(ids) == a.requests[4].prompt_len and min(ids) >= 3 and max(ids) < 1000


@pytest.mark.parametrize("name", list(workload.LENGTHS))
def test_lengths_have_the_papers_means(name):
    """Without clipping, the sampled means are the paper's (within 4 %)."""
    trace = workload.make_trace(name, 20_000, 1.0, seed=0, max_len=10**9)
    p_mean, o_mean = workload.LENGTHS[name]
    assert np.mean([r.prompt_len for r in trace.requests]) == pytest.approx(p_mean, rel=0.04)
    assert np.mean([r.output_len for r in trace.requests]) == pytest.approx(o_mean, rel=0.04)
    clipped = workload.make_trace(name, 2000, 1.0, seed=0, max_len=256)
    assert all(r.prompt_len + r.output_len <= 256 for r in clipped.requests)
    assert {row["dataset"] for row in workload.length_table(2000)} == set(workload.LENGTHS)


def test_trace_round_trip(tmp_path):
    trace = workload.make_trace("ShareGPT-like", 40, 3.5, seed=9, max_len=512)
    path = workload.save_trace(trace, tmp_path / "t.jsonl")
    assert workload.load_trace(path) == trace
    assert path.read_text().count("\n") == 41


def test_bad_traces_and_rates(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"format": "other"}\n')
    with pytest.raises(ValueError, match="not a paged-course-trace"):
        workload.load_trace(bad)
    path = workload.save_trace(hand_trace(), tmp_path / "h.jsonl")
    lines = path.read_text().splitlines()
    path.write_text("\n".join([lines[0], lines[2], lines[1]]))
    with pytest.raises(ValueError, match="must not decrease"):
        workload.load_trace(path)
    for rate in (0, -1.0, math.inf):
        with pytest.raises(ValueError, match="rate_rps"):
            workload.poisson_arrivals(3, rate)
    with pytest.raises(TypeError, match="rate_rps"):
        workload.make_trace("Alpaca-like", 3, "fast")
    with pytest.raises(ValueError, match="name must be one of"):
        workload.make_trace("LMSYS", 3, 1.0)


# ---- the driver on a fake engine ----------------------------------------------------------


def check_hand_latencies(drv):
    """The hand-worked timeline (10 ms steps): see the comments."""
    res = fake_run(drv)
    r0, r1, r2 = res.requests
    # r0: steps [0, .01], [.01, .02], [.02, .03]; r1 arrives at .015 during step 2, joins step 3
    assert r0.token_times == pytest.approx([0.01, 0.02, 0.03])
    assert r1.token_times == pytest.approx([0.03, 0.04])
    assert r2.token_times == pytest.approx([0.51])  # after the idle gap: waits for its arrival
    assert [r0.ttft, r1.ttft, r2.ttft] == pytest.approx([0.01, 0.015, 0.01])  # from arrival
    assert [r0.tpot, r1.tpot] == pytest.approx([0.01, 0.01]) and r2.tpot is None
    assert [r0.e2e, r1.e2e, r2.e2e] == pytest.approx([0.03, 0.025, 0.01])
    assert [r.normalized_latency for r in res.requests] == pytest.approx([0.01, 0.0125, 0.01])
    s = drv.summarize(res)
    assert s["mean_normalized_latency_s"] == pytest.approx((0.01 + 0.0125 + 0.01) / 3)
    assert s["throughput_tok_s"] == pytest.approx(6 / 0.51)
    assert s["p50_ttft_s"] == pytest.approx(0.01) and s["p50_tpot_s"] == pytest.approx(0.01)
    assert (s["finished"], s["steps"], s["max_running"], s["truncated"]) == (3, 5, 2, False)


def check_clock_follows_the_cost_model(drv):
    """Simulated time advances by a + b * tokens + c * seqs + d * kv_tokens per step."""
    rng = random.Random(0)
    reqs = tuple(TraceRequest(0.002 * i, rng.randint(1, 30), rng.randint(1, 12))
                 for i in range(12))
    cost = CostModel(a=1e-3, b=2e-5, c=3e-4, d=1e-6)
    res = fake_run(drv, Trace(reqs, "r", 1.0, 0, 64), cost, max_running=4)
    for prev, s in zip(res.steps, res.steps[1:], strict=False):
        assert s.end_s - s.start_s == pytest.approx(cost(s.shape))
        assert s.start_s >= prev.end_s - 1e-12
    assert max(s.shape.seqs for s in res.steps) == 4
    for r in res.requests:
        assert len(r.token_times) == r.output_len and r.finished_s == r.token_times[-1]
        assert r.ttft >= cost.a


def test_driver_latencies_by_hand():
    check_hand_latencies(driver)


def test_simulated_clock_follows_the_cost_model():
    check_clock_follows_the_cost_model(driver)


def test_wall_clock_waits_for_arrivals():
    class Sleepy(FakeEngine):
        def step(self):
            import time

            time.sleep(0.002)
            return super().step()

    engine, clock = Sleepy(), driver.WallClock()
    trace = Trace((TraceRequest(0.05, 3, 4), TraceRequest(0.06, 2, 2)), "w", 1.0, 0, 64)
    res = driver.run(engine, trace, clock, params=lambda n: n)
    r0, r1 = res.requests
    assert r0.token_times[0] >= 0.05 + 0.002 and r0.ttft >= 0.002
    assert r0.e2e >= 4 * 0.002 and r1.finished_s is not None and not res.simulated
    assert engine.arrival_times[0] - clock.t0 == pytest.approx(0.05)  # the engine's clock too


def test_max_seconds_truncates_and_aborts():
    reqs = tuple(TraceRequest(0.001 * i, 3, 50) for i in range(20))
    engine = FakeEngine(max_running=2)
    res = driver.run(engine, Trace(reqs, "o", 1.0, 0, 64), driver.SimulatedClock(
        CostModel(a=0.01)), params=lambda n: n, max_seconds=0.3)
    assert res.truncated and engine.aborted and not engine.has_unfinished_requests()
    s = driver.summarize(res)
    assert s["truncated"] and s["finished"] < s["requests"]


def test_driver_refuses_a_busy_engine_and_an_uninstrumented_one():
    engine = FakeEngine()
    engine.add_request([3], 1)
    with pytest.raises(RuntimeError, match="idle engine"):
        driver.run(engine, hand_trace(), driver.SimulatedClock(CostModel(a=1)),
                   params=lambda n: n)
    engine = FakeEngine()
    del engine.runner
    with pytest.raises(TypeError, match="instrument"):
        driver.run(engine, hand_trace(), driver.SimulatedClock(CostModel(a=1)),
                   params=lambda n: n)
    with pytest.raises(TypeError, match="cost_model"):
        driver.SimulatedClock(3.0)


# ---- the cost model -----------------------------------------------------------------------


def random_steps(rng, n=300):
    rows = []
    for _ in range(n):
        seqs = rng.randint(1, 256)
        prefill = rng.random() < 0.2
        tokens = seqs + (rng.randint(16, 2000) if prefill else 0)
        rows.append((tokens, seqs, seqs * rng.randint(20, 1500)))
    return rows


def check_fit_recovers(cm):
    rng = random.Random(11)
    true = (2e-3, 3e-6, 1.5e-5, 8e-9)
    shapes = random_steps(rng)
    rows = [(t, s, k, true[0] + true[1] * t + true[2] * s + true[3] * k) for t, s, k in shapes]
    got = cm.fit(rows)
    assert (got.a, got.b, got.c, got.d) == pytest.approx(true, rel=1e-6)
    # a term the steps do not need stays at 0, never negative, with noise
    noisy = [(t, s, k, max(0.0, 1e-3 + 4e-6 * t + rng.gauss(0, 5e-5))) for t, s, k in shapes]
    got = cm.fit(noisy)
    assert min(got.a, got.b, got.c, got.d) >= 0
    assert got.b == pytest.approx(4e-6, rel=0.05) and got.a == pytest.approx(1e-3, rel=0.1)
    assert cm.fit_error(got, noisy)["r2"] > 0.95


def test_fit_recovers_planted_coefficients():
    check_fit_recovers(cost_model)


def test_fit_and_model_reject_bad_input():
    with pytest.raises(ValueError, match="rows"):
        cost_model.fit([])
    with pytest.raises(ValueError, match="rows"):
        cost_model.fit([(1, 2, 3)])
    with pytest.raises(ValueError, match=">= 0"):
        cost_model.fit([(1, 2, 3, -1.0)])
    with pytest.raises(ValueError, match="CostModel.c"):
        CostModel(a=1.0, c=-1e-6)
    m = CostModel(1e-3, 2e-6, 3e-6, 4e-9)
    assert CostModel.from_dict(m.to_dict()) == m
    assert m(StepShape(10, 2, 100)) == pytest.approx(1e-3 + 2e-5 + 6e-6 + 4e-7)


# ---- the sustained rate -------------------------------------------------------------------


def pts(*pairs, truncated=()):
    return [{"rate_rps": r, "mean_normalized_latency_s": lat, "truncated": r in truncated}
            for r, lat in pairs]


def check_sustained(sw):
    curve = pts((3, 3.0), (1, 1.0), (2, 1.5), (4, 9.0))  # (any order)
    assert sw.sustained_rate(curve, 2.0) == (pytest.approx(2 + 0.5 / 1.5), False)
    assert sw.sustained_rate(curve, 0.5) == (None, False)
    assert sw.sustained_rate(curve, 10.0) == (4, True)
    assert sw.sustained_rate(pts((1, 2.0), (2, 3.0)), 2.0) == (1, False)  # at the bound: within
    assert sw.sustained_rate(pts((1, 1.0), (2, 1.2), truncated=(2,)), 2.0) == (1, False)
    assert sw.sustained_rate(pts((1, 1.0), (2, math.nan)), 2.0) == (1, False)
    # the first crossing counts, even if a later point dips back under the bound
    assert sw.sustained_rate(pts((1, 1.0), (2, 3.0), (3, 1.5)), 2.0)[0] == pytest.approx(1.5)
    curves = {"paged": pts((1, 1.0), (2, 1.2), (4, 5.0)), "reserve_max": pts((0.5, 1.1),
                                                                             (1, 4.0))}
    assert sw.latency_bound(curves.values()) == pytest.approx(2.0)
    recs = {r["policy"]: r for r in sw.records(curves, "d")}
    assert recs["paged"]["sustained_rate_rps"] == pytest.approx(2 + 0.8 / 3.8 * 2)
    assert recs["reserve_max"]["sustained_rate_rps"] == pytest.approx(0.5 + 0.9 / 2.9 * 0.5)
    assert recs["paged"]["x_reserve_max"] == pytest.approx(
        recs["paged"]["sustained_rate_rps"] / recs["reserve_max"]["sustained_rate_rps"])


def test_sustained_rate_interpolates():
    check_sustained(sweep)


def test_rate_grid_and_capacity():
    trace = workload.make_trace("ShareGPT-like", 200, 1.0, seed=0, max_len=1024)
    held = {p: sweep.held_at_once(p, trace, 512, 16) for p in sweep.POLICIES}
    assert held["reserve_max"] == pytest.approx(8)  # 512 blocks / 64 per request
    assert held["reserve_max"] < held["reserve_pow2"] < held["reserve_oracle"] < held["paged"]
    caps = {p: sweep.capacity_rps(p, trace, 512, 16, lambda b: 1e-3) for p in sweep.POLICIES}
    assert caps["paged"] / caps["reserve_max"] == pytest.approx(held["paged"] / 8, rel=0.02)
    assert sweep.rate_grid(10.0) == [3.0, 6.0, 8.5, 10.5, 13.0]


# ---- the real scheduler, simulated --------------------------------------------------------


def online_engine_or_skip():
    pytest.importorskip("transformers")
    from paged_ref.engine import engine as engine_module

    if not hasattr(engine_module.Engine, "add_request"):
        pytest.skip("paged_ref.engine has no online API here")


def test_paged_holds_more_than_reserve_max_when_memory_binds():
    """Same trace, same pool (64 blocks of 16 = 1,024 tokens, max_model_len 256: reserve_max
    holds 4): paging runs more requests at once and waits less."""
    online_engine_or_skip()
    from paged_course.serving.runners import simulation_engine

    trace = workload.make_trace("Alpaca-like", 60, 200.0, seed=2, max_len=256)
    got = {}
    for policy in ("paged", "reserve_max", "reserve_oracle"):
        engine = simulation_engine(policy, num_blocks=64, block_size=16, max_model_len=256)
        res = driver.run(engine, trace, driver.SimulatedClock(CostModel(a=5e-3, c=1e-4)))
        assert all(len(r.token_times) == r.output_len for r in res.requests)
        got[policy] = driver.summarize(res)
    assert got["reserve_max"]["max_running"] <= 4
    assert got["paged"]["mean_running"] > 2 * got["reserve_max"]["mean_running"]
    assert got["paged"]["mean_running"] > got["reserve_oracle"]["mean_running"]
    assert (got["paged"]["mean_normalized_latency_s"]
            < got["reserve_max"]["mean_normalized_latency_s"])


# ---- runner wrappers, the committed cost model, the pictures ------------------------------


def test_runner_wrappers_report_shapes_and_delegate():
    from types import SimpleNamespace

    import torch

    from paged_course.serving.runners import NullRunner, TimedRunner, instrument

    inner = SimpleNamespace(cache="the cache", device=torch.device("cpu"),
                            execute=lambda step, sampling=None: [5] * len(step.sample_rows))
    engine = SimpleNamespace(runner=inner)
    step = SimpleNamespace(input_ids=[4, 8, 9, 1, 2], seq_lens=[3, 40], sample_rows=[0, 1])
    instrument(engine, null=True)
    assert isinstance(engine.runner, NullRunner) and engine.runner.cache == "the cache"
    assert engine.runner.execute(step) == [0, 0]
    assert engine.runner.take_shape() == StepShape(5, 2, 43)
    assert engine.runner.take_shape() is None  # (once)
    instrument(engine)  # unwraps the null runner first
    assert isinstance(engine.runner, TimedRunner) and engine.runner.inner is inner
    assert engine.runner.execute(step) == [5, 5]
    (shape, seconds), = engine.runner.times
    assert shape == StepShape(5, 2, 43) and seconds >= 0
    multi_step = SimpleNamespace(runner=inner, num_scheduler_steps=8)
    with pytest.raises(ValueError, match="num_scheduler_steps must be 1"):
        instrument(multi_step)  # (its execute_steps would go untimed, unsimulated)
    assert multi_step.runner is inner


def test_committed_cost_model_or_the_prior(tmp_path, monkeypatch):
    import json

    from paged_course import results

    monkeypatch.setattr(results, "RESULTS", tmp_path)
    assert cost_model.committed()[0] == cost_model.PRIOR_H200
    assert "no committed serving run" in cost_model.committed()[1]
    (tmp_path / "h200").mkdir()
    fitted = {"a": 2e-3, "b": 1e-6, "c": 3e-6, "d": 4e-9, "steps": 812, "r2": 0.9}
    (tmp_path / "h200" / "serving.json").write_text(json.dumps({
        "gpu": "NVIDIA H200", "date": "2026-12-02",
        "cost_models": {"smollm2-135m-real": {"wall": fitted}}}))
    model, where = cost_model.committed()
    assert model == CostModel(2e-3, 1e-6, 3e-6, 4e-9) and "812 steps" in where


def test_pictures():
    import matplotlib

    matplotlib.use("Agg")
    from paged_course.serving import plot

    res = fake_run(driver)
    fig = plot.plot_timeline({"paged": res, "reserve_max": res})
    assert len(fig.axes) == 2 and "simulated" in fig.axes[-1].get_xlabel()
    curve = pts((1, 1.0), (2, 1.5), (3, 4.0))
    recs = [{**r, "model": m} for m in ("m1", "m2")
            for r in sweep.records({"paged": curve, "reserve_max": curve}, "d")]
    fig = plot.plot_curves(recs, simulated=True)
    assert len(fig.axes) == 2 and fig.axes[1].get_title() == "m2, d"
    assert len(fig.axes[0].lines) == 2 + 2 + 1  # two curves, two sustained marks, the bound
    fig = plot.plot_arrivals({"a": hand_trace()}, seconds_per_token=0.01)
    assert len(fig.axes) == 2  # (the count of overlapping requests on a twin axis)


def test_points_sized_in_seconds_arrive_over_the_span_at_every_rate():
    """``span_s``: each point has ``rate x span`` requests (at least ``min_requests``), so its
    arrivals last ~``span_s`` at every rate; a fixed count would arrive in 40 / rate seconds
    (a burst at high rates) -- the mistake the 2026-12-02 H200 run made on Alpaca-like."""
    class Engine(FakeEngine):  # (the driver's default params: SamplingParams, not a length)
        def add_request(self, prompt_ids, params, *, arrival_time=None):
            return super().add_request(prompt_ids, params.max_tokens, arrival_time=arrival_time)

    trace = workload.make_trace("Alpaca-like", 600, 1.0, seed=3, max_len=256)
    kept: list = []
    sweep.sweep_policy(Engine, trace, [2.0, 20.0, 100.0], lambda: driver.SimulatedClock(
        CostModel(1e-3, 0, 0, 0)), keep=kept, span_s=5.0, min_requests=40)
    assert [len(r.requests) for r in kept] == [40, 100, 500]
    spans = [r.trace.duration_s for r in kept]
    assert spans[0] > 10 and all(3.5 < s < 6.5 for s in spans[1:]), spans
    assert sweep.requests_for(100.0, 5.0, 300) == 300  # (all the trace has)
    with pytest.raises(ValueError, match="span_s"):
        sweep.requests_for(1.0, 0.0, 10)
    with pytest.raises(ValueError, match="n must be"):
        trace.head(0)


class _ServingFake(FakeEngine):
    """FakeEngine taking the driver's SamplingParams; at most 8 requests at once."""

    def __init__(self):
        super().__init__(max_running=8)

    def add_request(self, prompt_ids, params, *, arrival_time=None):
        return super().add_request(prompt_ids, params.max_tokens, arrival_time=arrival_time)


def _knee_sweep(first_rate, **kw):
    trace = workload.make_trace("Alpaca-like", 400, 1.0, seed=5, max_len=256)
    engine = _ServingFake()
    kw = {"unloaded_s": 10e-3, "span_s": 4.0, "min_requests": 30, **kw}
    return sweep.sweep_to_knee(lambda: engine, trace, first_rate, lambda: driver.SimulatedClock(
        CostModel(10e-3, 0, 0, 0)), **kw)


def test_sweep_to_knee_stops_one_step_past_the_bound():
    """8 at once, 10 ms a step, ~56 tokens a request: the knee is near 8 / 0.56 s ~ 14 req/s.
    From 3 req/s it grows 1.6x a point until a point is above 2x the first's latency; the
    sustained rate at that bound is then bracketed by two points 1.6x apart."""
    points = _knee_sweep(3.0)
    rates = [p["rate_rps"] for p in points]
    lat = [p["mean_normalized_latency_s"] for p in points]
    bound = 2 * lat[0]
    assert rates[0] == 3.0 and all(b == pytest.approx(a * 1.6)
                                   for a, b in zip(rates, rates[1:], strict=False))
    assert lat[-1] > bound and all(x <= bound for x in lat[:-1]), lat
    assert 3 <= len(points) <= 7 and 14 < rates[-1] < 14 * 1.6**2, rates
    assert sweep.sustained_rate(points, bound)[0] is not None


def test_sweep_to_knee_moves_a_loaded_start_down_and_respects_its_limits():
    loaded = _knee_sweep(40.0)  # (far past the knee: its first point is no unloaded latency)
    assert loaded[0]["rate_rps"] < 40.0 / 1.6**2 * 1.01
    assert len(_knee_sweep(1.0, max_points=2)) == 2
    assert len(_knee_sweep(1.0, deadline=0.0)) == 1  # (the first point, then out of time)
    with pytest.raises(ValueError, match="growth"):
        _knee_sweep(1.0, growth=1.0)
    with pytest.raises(ValueError, match="first_rate"):
        _knee_sweep(0.0)
