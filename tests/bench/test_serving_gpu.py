"""The serving driver and suite on a CUDA GPU (skipped without one): the real engine against
the wall clock, its runner timed with CUDA events, and a short run of the suite."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.gpu  # (tests/conftest.py: skipped without a CUDA GPU)
pytest.importorskip("transformers")


def test_wall_clock_run_on_the_gpu():
    from paged_bench.engine import build_model
    from paged_course.serving import driver, fit, instrument, workload
    from paged_ref.engine import Engine

    model = build_model("tiny", dtype=torch.bfloat16, device="cuda", seed=0)
    engine = instrument(Engine(model, num_blocks=256, block_size=16, max_model_len=512,
                               enable_prefix_caching=False, reservation="reserve_oracle"))
    trace = workload.make_trace("Alpaca-like", 40, 50.0, seed=1, max_len=512)
    # NOTE: the first run compiles the kernels inside its first steps (seconds a step, which
    # no per-step cost model fits, and which swamp the fit below); the second is measured.
    driver.run(engine, trace, driver.WallClock())
    engine.runner.times.clear()
    res = driver.run(engine, trace, driver.WallClock())
    assert not res.simulated and not res.truncated
    for r in res.requests:
        assert len(r.token_times) == r.output_len and r.ttft > 0 and r.e2e >= r.ttft
        assert r.token_times[0] >= r.arrival_s
    s = driver.summarize(res)
    assert s["finished"] == 40 and s["throughput_tok_s"] > 0
    times = engine.runner.times
    assert len(times) >= len([st for st in res.steps if st.shape.tokens])
    assert all(g > 0 for _, g in times), [g for _, g in times if g <= 0]
    model_ = fit([(st.shape.tokens, st.shape.seqs, st.shape.kv_tokens, st.seconds)
                  for st in res.steps])
    assert model_.a + model_.c > 0, f"no per-step or per-request cost in the fit: {model_}"


def test_suite_short_run(tmp_path):
    from paged_bench import serving as suite

    out = tmp_path / "serving.json"
    assert suite.main(["--models", "llama-3.2-1b-like", "--datasets", "Alpaca-like",
                       "--requests", "Alpaca-like=32", "--policies", "paged,reserve_max",
                       "--factors", "0.5,1.0,1.5", "--budget-s", "120",
                       "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    recs = {r["policy"]: r for r in data["results"]}
    assert set(recs) == {"paged", "reserve_max"} and data["gpu"].startswith("NVIDIA")
    assert data["cost_models"]["llama-3.2-1b-like"]["wall"]["steps"] > 0
    assert out.with_suffix(".png").exists()
