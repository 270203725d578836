"""Lesson 07's simulations: savings by sharing, a shared system prompt, the offload arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from paged_course import offload, sharing_sim
from paged_course.simulate import Requests


def test_parallel_sampling_saving_is_the_shared_prompt_blocks():
    reqs = Requests(prompt=np.array([8]), output=np.array([4]), max_len=64)
    r = sharing_sim.parallel_sampling_saving(reqs, n=2, block_size=4)
    # 2 samples of 8 + t tokens, t = 0..3: unshared 2 * 3 blocks per step (t >= 1: 3 blocks)
    # with sharing the 2 prompt blocks count once: 4 blocks per step (t = 0: 2)
    assert (r.held, r.unshared, r.copies) == (2 + 3 * 4, 2 * 2 + 3 * 6, 0)
    assert r.saving == pytest.approx(1 - 14 / 22)


def test_parallel_samples_of_the_same_length():
    reqs = Requests(prompt=np.array([8, 8]), output=np.array([4, 1]), max_len=64)
    r = sharing_sim.parallel_sampling_saving(reqs, n=2, block_size=4, same_length=True)
    # request 0 as above (14 held, 22 unshared); request 1: one step, 2 held, 2 * 2 unshared
    assert (r.held, r.unshared, r.copies) == (14 + 2, 22 + 4, 0)


def test_paper_savings_are_per_dataset():
    """The paper's §6.3 ranges: Alpaca 6.1-9.8 / 37.6-55.2, ShareGPT 16.2-30.5 / 44.3-66.3."""
    paper = sharing_sim.PAPER_SAVING
    assert set(paper) == set(sharing_sim.DATASETS)
    assert paper["Alpaca-like"] == {"parallel sampling": (6.1, 9.8), "beam search": (37.6, 55.2)}
    assert paper["ShareGPT-like"] == {"parallel sampling": (16.2, 30.5),
                                      "beam search": (44.3, 66.3)}
    stale = {"dataset": "ShareGPT-like", "method": "parallel sampling", "n / width": 2,
             "saving %": 7.7, "paper % (Alpaca, n/width 2-6)": "6.1-9.8"}  # an old JSON row
    rows = [stale, dict(stale, **{"n / width": 4, "saving %": 18.8}),
            dict(stale, method="beam search", **{"n / width": 6, "saving %": 79.7})]
    shown = sharing_sim.with_paper(rows)
    assert [r[sharing_sim.PAPER_COLUMN] for r in shown] == ["16.2-30.5", "16.2-30.5",
                                                            "44.3-66.3"]
    assert [r["vs paper"] for r in shown] == ["below", "within", "above"]
    assert not any("Alpaca" in key for r in shown for key in r)
    assert sharing_sim.compare_with_paper(rows) == {
        ("ShareGPT-like", "parallel sampling"): {"below": [2], "within": [4], "above": []},
        ("ShareGPT-like", "beam search"): {"below": [], "within": [], "above": [6]}}


def test_random_beams_share_an_ancestor_about_2_width_steps_back():
    assert sharing_sim.beams_common_ancestor_steps(1) == 0
    assert sharing_sim.beams_common_ancestor_steps(2, trials=4000) == pytest.approx(2, rel=0.1)
    assert sharing_sim.beams_common_ancestor_steps(6, trials=2000) == pytest.approx(10, rel=0.1)


def test_beam_search_shares_more_than_parallel_sampling():
    reqs = sharing_sim.dataset("Alpaca-like", 4, seed=0)
    beam = sharing_sim.beam_search_saving(reqs, 4)
    par = sharing_sim.parallel_sampling_saving(reqs, 4)
    assert 0 < par.saving < beam.saving < 1
    assert beam.copies > 0


def test_system_prompt_caching_raises_the_hit_rate_and_the_batch():
    reqs = sharing_sim.dataset("Alpaca-like", 30, seed=1, max_len=256)
    off = sharing_sim.system_prompt_run(reqs, 64, 120, enable_prefix_caching=False)
    on = sharing_sim.system_prompt_run(reqs, 64, 120, enable_prefix_caching=True)
    assert off.hit_rate == 0 and 0.5 < on.hit_rate < 1
    assert on.peak_running > off.peak_running
    with pytest.raises(ValueError, match="does not fit"):
        sharing_sim.system_prompt_run(reqs, 64, 10, enable_prefix_caching=True)


def test_dataset_names():
    with pytest.raises(ValueError, match="name must be one of"):
        sharing_sim.dataset("nope", 3)


def test_offload_arithmetic():
    rows = offload.estimate(64.0, 989.0, prefixes=[1024])
    assert rows[0]["MiB"] == 128.0  # 128 KiB per token for Llama-3-8B in bf16
    assert rows[0]["copy_back_ms"] == pytest.approx(128 * 2**20 / 64e9 * 1e3)
    be = offload.breakeven_gbps(1024, 989.0)
    at_breakeven = offload.estimate(be, 989.0, prefixes=[1024])[0]
    assert at_breakeven["recompute / copy"] == pytest.approx(1.0)
