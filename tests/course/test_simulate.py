"""paged_course.simulate: bytes per token, request sampling, the reservation simulation."""

from __future__ import annotations

import numpy as np
import pytest

from paged_course import simulate as S


@pytest.mark.parametrize(
    ("model", "expected"),
    [("Llama-3-8B", 131072), ("Mistral-7B", 131072), ("Llama-3-70B", 327680),
     ("Llama-2-7B", 524288)],
)
def test_kv_bytes_per_token_of_known_models(model, expected):
    assert S.model_bytes_per_token(S.MODELS[model]) == expected
    assert S.model_bytes_per_token(S.MODELS[model], "float32") == 2 * expected
    assert S.model_bytes_per_token(S.MODELS[model], 1) == expected // 2  # an 8-bit cache


def test_model_table_rows():
    rows = S.model_table(seq_len=4096)
    llama3 = next(r for r in rows if r["model"] == "Llama-3-8B")
    assert llama3["kib_per_token"] == 128
    assert llama3["gib_per_4096_tokens"] == pytest.approx(0.5)


def test_sample_requests_deterministic_and_bounded():
    a = S.sample_requests(500, seed=3)
    b = S.sample_requests(500, seed=3)
    c = S.sample_requests(500, seed=4)
    np.testing.assert_array_equal(a.prompt, b.prompt)
    np.testing.assert_array_equal(a.output, b.output)
    assert not np.array_equal(a.prompt, c.prompt)
    assert a.prompt.min() >= 1 and a.output.min() >= 1
    assert a.total.max() <= a.max_len == 2048


def test_sample_requests_right_skewed_with_sharegpt_like_means():
    r = S.sample_requests(20000, seed=0)
    # clipping at max_len lowers the means a little; lognormal: mean well above the median
    assert 140 < r.prompt.mean() < 175
    assert 300 < r.output.mean() < 350
    assert np.median(r.output) < 0.8 * r.output.mean()


def test_reserved_slots():
    assert S.reserved_slots("max", 10, 25, 2048) == 2048
    assert S.reserved_slots("pow2", 10, 25, 2048) == 10 + 32
    assert S.reserved_slots("pow2", 10, 32, 2048) == 10 + 32
    assert S.reserved_slots("pow2", 1500, 600, 2048) == 2048
    assert S.reserved_slots("oracle", 10, 25, 2048) == 35


@pytest.fixture(scope="module")
def results():
    req = S.sample_requests(600, seed=1)
    return S.compare_strategies(req, capacity_slots=8192, block_size=16)


def test_shares_add_up(results):
    for r in results.values():
        assert sum(r.share.values()) == pytest.approx(1.0)
        assert all(0 <= v <= 1 for v in r.share.values())
        assert r.saturated_steps > 0


def test_utilisation_order(results):
    t = {s: r.token_share for s, r in results.items()}
    assert t["max"] < t["pow2"] < t["oracle"] < t["paged"]
    assert t["paged"] > 0.9
    assert results["paged"].share["future"] == 0
    assert results["oracle"].share["rounding"] == pytest.approx(0)


def test_more_requests_fit_when_paged(results):
    n = {s: r.mean_running for s, r in results.items()}
    assert n["max"] == pytest.approx(8192 / 2048)  # 4 max-length reservations fit exactly
    assert n["max"] < n["pow2"] < n["oracle"] < n["paged"]


def test_simulation_deterministic():
    req = S.sample_requests(200, seed=5)
    a = S.simulate("paged", req, 4096, block_size=16)
    b = S.simulate("paged", req, 4096, block_size=16)
    assert a == b


def test_small_paged_pool_preempts_and_still_finishes():
    req = S.sample_requests(100, seed=2, max_len=256)
    r = S.simulate("paged", req, capacity_slots=256, block_size=16)
    assert r.preemptions > 0
    assert r.steps >= req.output.max()


def test_requests_that_fit_matches_capacity():
    req = S.sample_requests(300, seed=0, max_len=512)
    bpt = S.model_bytes_per_token(S.MODELS["Llama-3-8B"])
    fit = S.requests_that_fit(512 * 8 * bpt, "max", req, bytes_per_token=bpt)
    assert fit == pytest.approx(8)
    assert S.requests_that_fit(512 * 8 * bpt, "paged", req, bytes_per_token=bpt) > 8


def test_bad_arguments():
    req = S.sample_requests(10, seed=0)
    with pytest.raises(ValueError, match="strategy"):
        S.simulate("lru", req, 4096)
    with pytest.raises(ValueError, match="capacity_slots"):
        S.simulate("max", req, 1000)
    with pytest.raises(ValueError):
        S.sample_requests(0)
