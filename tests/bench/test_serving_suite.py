"""``python -m paged_bench serving`` on a CPU: its simulated knees, its command line, and the
simulated run it makes instead (the real scheduler, a null runner), written as the GPU run's
JSON and PNG would be."""

from __future__ import annotations

import json

import pytest

from paged_bench import SUITES
from paged_bench import serving as suite
from paged_course.serving import cost_model as cm
from paged_course.serving import workload


def test_serving_is_a_suite():
    assert "serving" in SUITES


def test_simulated_knees_order_the_policies():
    pytest.importorskip("transformers")
    from paged_ref.engine import engine as engine_module

    if not hasattr(engine_module.Engine, "add_request"):
        pytest.skip("paged_ref.engine has no online API here")
    trace = workload.make_trace("Alpaca-like", 40, 1.0, seed=0, max_len=256)
    knees = suite.simulated_knees({"Alpaca-like": trace}, ("paged", "reserve_max"),
                                  cm.PRIOR_H200, 64, 16, factors=(0.3, 0.7, 1.1))
    assert set(knees) == {("paged", "Alpaca-like"), ("reserve_max", "Alpaca-like")}
    assert knees["paged", "Alpaca-like"] > 2 * knees["reserve_max", "Alpaca-like"] > 0


def test_requests_option():
    assert suite.parse_requests("") == suite.REQUESTS
    assert suite.parse_requests("Alpaca-like=12")["Alpaca-like"] == 12


def test_cpu_run_is_simulated_and_writes_the_records(tmp_path, capsys):
    """Without a GPU the suite runs its simulated version by itself; on a GPU machine (where
    it would measure for minutes) ``--simulate`` asks for the same run."""
    import torch

    pytest.importorskip("transformers")
    from paged_ref.engine import engine as engine_module

    if not hasattr(engine_module.Engine, "add_request"):
        pytest.skip("paged_ref.engine has no online API here")
    out = tmp_path / "serving.json"
    gpu = torch.cuda.is_available()
    assert suite.main(["--datasets", "Alpaca-like", "--policies", "paged,reserve_max",
                       "--factors", "0.5,1.0,1.6", "--out", str(out)]
                      + (["--simulate"] if gpu else [])) == 0
    said = capsys.readouterr().out
    assert ("--simulate" if gpu else "no CUDA GPU here") in said and "simulated" in said
    data = json.loads(out.read_text())
    assert data["simulated"] and out.with_suffix(".png").exists()
    recs = {r["policy"]: r for r in data["results"]}
    assert set(recs) == {"paged", "reserve_max"}
    keys = {"rate_rps", "mean_normalized_latency_s", "p50_ttft_s", "p99_ttft_s", "p50_tpot_s",
            "p99_tpot_s", "throughput_tok_s"}
    for rec in recs.values():
        assert rec["dataset"] == "Alpaca-like" and len(rec["curve"]) == 3
        assert keys <= set(rec["curve"][0]) and rec["latency_bound_s"] > 0
    assert recs["paged"]["sustained_rate_rps"] > recs["reserve_max"]["sustained_rate_rps"]
