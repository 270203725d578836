"""Lesson 07's simulations: savings by sharing, a shared system prompt, the offload arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from paged_ref.course import offload, sharing_sim
from paged_ref.course.simulate import Requests


def test_parallel_sampling_saving_is_the_shared_prompt_blocks():
    reqs = Requests(prompt=np.array([8]), output=np.array([4]), max_len=64)
    r = sharing_sim.parallel_sampling_saving(reqs, n=2, block_size=4)
    # 2 samples of 8 + t tokens, t = 0..3: unshared 2 * 3 blocks per step (t >= 1: 3 blocks)
    # with sharing the 2 prompt blocks count once: 4 blocks per step (t = 0: 2)
    assert (r.held, r.unshared, r.copies) == (2 + 3 * 4, 2 * 2 + 3 * 6, 0)
    assert r.saving == pytest.approx(1 - 14 / 22)


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
