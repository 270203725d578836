"""``python -m paged_bench sharing``: blocks held with and without sharing, counted in the engine
-- by hand on a case small enough to count, quickly to a temporary file, and in the committed
``results/cpu/sharing_engine.json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from paged_bench import SUITES

pytest.importorskip("transformers")

from paged_bench import sharing as suite  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
FIELDS = {"mode", "n", "dataset", "requests", "steps", "blocks_shared", "blocks_unshared",
          "saved", "peak_blocks_shared", "peak_blocks_unshared", "copies_on_write",
          "simulated_saved", "paper_saved_range"}


@pytest.fixture(scope="module")
def tiny():
    from paged_bench.engine import build_model

    torch.set_num_threads(1)
    return build_model("tiny", dtype=torch.float32, device="cpu", seed=0)


def test_sharing_is_a_suite():
    assert "sharing" in SUITES


def test_blocks_counted_by_hand(tiny):
    """A 6-token prompt in blocks of 4, n = 2, 3 tokens each. Step 1 (prefill): 2 blocks, one
    sequence. Step 2: both samples write position 6: the first copies the shared partial
    block (3 blocks held, 4 unshared, 1 copy). Step 3: both write position 7 in place."""
    from paged_ref.engine import Engine, SamplingParams

    engine = Engine(tiny, num_blocks=16, block_size=4, enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=3, n=2, temperature=1.0, seed=1, ignore_eos=True)
    got = suite.measure(engine, lambda: engine.generate([[7, 8, 9, 10, 11, 12]], params=sp),
                        key=lambda r: "the request")
    assert got == {"the request": dict(steps=3, blocks_shared=2 + 3 + 3,
                                       blocks_unshared=2 + 4 + 4, peak_blocks_shared=3,
                                       peak_blocks_unshared=4, copies_on_write=1,
                                       saved=pytest.approx(1 - 8 / 10))}
    assert "schedule" not in vars(engine.scheduler), "the counting hook stayed"


def test_a_quick_run_writes_stamped_records(tmp_path):
    out = tmp_path / "sharing_engine.json"
    assert suite.main(["--requests", "0.1", "--sizes", "2,3", "--max-len", "128",
                       "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert {"gpu", "date", "commit", "torch"} <= data.keys() and data["suite"] == "sharing"
    recs = data["results"]
    assert [(r["dataset"], r["mode"], r["n"]) for r in recs] == [
        (d, m, n) for d in suite.DATASETS for m in suite.MODES for n in (2, 3)]
    for r in recs:
        assert FIELDS <= r.keys(), FIELDS - r.keys()
        assert 0 <= r["blocks_shared"] <= r["blocks_unshared"] and 0 <= r["saved"] < 1
        assert r["saved"] == pytest.approx(1 - r["blocks_shared"] / r["blocks_unshared"])
        assert (r["simulated_saved"] is None) == (r["n"] == 3)  # (lesson 07 has 2, 4, 6)
    beams = {r["dataset"]: r["saved"] for r in recs if r["mode"] == "beam" and r["n"] == 2}
    assert all(v > 0.1 for v in beams.values()), "beams shared nothing"


def test_the_committed_results_hold_every_case():
    data = json.loads((ROOT / "results" / "cpu" / "sharing_engine.json").read_text())
    recs = {(r["dataset"], r["mode"], r["n"]): r for r in data["results"]}
    assert set(recs) == {(d, m, n) for d in suite.DATASETS for m in suite.MODES
                         for n in (2, 4, 6)}
    for (dataset, mode, n), r in recs.items():
        assert FIELDS <= r.keys() and 0 < r["saved"] < 1
        assert r["simulated_saved"] is not None
        if mode == "beam":  # beams share their history too: more than the prompt alone
            assert r["saved"] > recs[dataset, "parallel", n]["saved"]
    for dataset in suite.DATASETS:  # more samples or beams share more
        for mode in suite.MODES:
            saved = [recs[dataset, mode, n]["saved"] for n in (2, 4, 6)]
            assert saved == sorted(saved), (dataset, mode, saved)
