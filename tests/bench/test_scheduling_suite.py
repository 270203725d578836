"""``python -m paged_bench scheduling``, quick: a small shared-prefix trace through both policies
into a tmp file, the fields the docs and the results page read, and the bar's arithmetic."""

from __future__ import annotations

import json

import pytest

from paged_bench import SUITES
from paged_bench import scheduling as suite

RUN_FIELDS = {"pool", "factor", "num_blocks", "rate_rps", "policy", "max_overtakes", "hit_rate",
              "cached_tokens", "admitted_tokens", "requests_per_s", "throughput_tok_s",
              "p50_ttft_s", "p99_ttft_s", "max_ttft_s", "preemptions", "steps", "finished",
              "requests", "host_ms_per_step"}


def test_scheduling_is_a_suite():
    assert "scheduling" in SUITES


def test_quick_run_writes_the_fields(tmp_path, capsys):
    pytest.importorskip("transformers")
    out = tmp_path / "scheduling.json"
    assert suite.main(["--requests", "40", "--factors", "1.2", "--roomy-factors", "1.2",
                       "--num-blocks", "160", "--roomy-blocks", "1024", "--sweep", "2,none",
                       "--sweep-factors", "1.2", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"gpu", "date", "commit", "cost_model", "workload", "fcfs_saturation_rps",
            "results", "comparisons"} <= data.keys()
    runs = data["results"]
    assert len(runs) == 2 + 2 + 2  # tight: fcfs, prefix, the two swept; roomy: fcfs, prefix
    for r in runs:
        assert RUN_FIELDS <= r.keys(), RUN_FIELDS - r.keys()
        assert r["finished"] == r["requests"] == 40 and 0 <= r["hit_rate"] < 1
        assert r["p50_ttft_s"] <= r["p99_ttft_s"] <= r["max_ttft_s"]
    assert [r["max_overtakes"] for r in runs[:4]] == [None, 8, 2, 10**9]
    assert {r["pool"] for r in runs} == {"tight", "roomy"}
    assert all(r["hit_rate"] > 0.3 for r in runs), "system prompts and turns share prefixes"
    assert len(data["comparisons"]) == 2 and "meets_bar" in data["comparisons"][0]
    assert "prefix/fcfs" in capsys.readouterr().out


def run(policy, **kw):
    base = {"pool": "tight", "rate_rps": 10.0, "factor": 1.0, "policy": policy,
            "max_overtakes": 16 if policy == "prefix" else None, "hit_rate": 0.5,
            "requests_per_s": 10.0, "throughput_tok_s": 1000.0, "p99_ttft_s": 1.0}
    return {**base, **kw}


def test_the_bar():
    fcfs = run("fcfs")
    assert suite.compare(fcfs, run("prefix", hit_rate=0.6, requests_per_s=11.0,
                                   p99_ttft_s=1.1))["meets_bar"]
    for worse in ({"p99_ttft_s": 1.11}, {"hit_rate": 0.5}, {"requests_per_s": 10.0}):
        better = {"hit_rate": 0.6, "requests_per_s": 11.0, "p99_ttft_s": 0.9, **worse}
        assert not suite.compare(fcfs, run("prefix", **better))["meets_bar"], worse
    c = suite.compare(fcfs, run("prefix", requests_per_s=12.5, p99_ttft_s=0.5))
    assert c["x_requests_per_s"] == 1.25 and c["x_p99_ttft"] == 0.5


def test_sweep_option():
    assert suite.parse_sweep("4, 64,none") == [4, 64, None] and suite.parse_sweep("") == []
