"""Checks for lesson 12's exercises (solutions by default; ``--impl exercises`` for yours).

12.1 is checked against the spec written out case by case on random requests, and against the
engine's own reservations where the engine has them; 12.2 against a dense reading of the curve
(the piecewise-linear latency evaluated on a fine grid of rates) on random sweeps, and on
hand-made edge cases. ``tests/mutations/test_mutations_ex12.py`` plants likely mistakes into
the solution and checks that these tests catch each one.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from paged_course.checks import assert_equal
from tests.conftest import load_exercise
from tests.engine.test_prefix_scheduling import check_starvation_bound, spec_order

SEEDS = range(5)
POLICIES = ("paged", "reserve_max", "reserve_pow2", "reserve_oracle")


@pytest.fixture
def ex(request):
    return load_exercise(request.config, "ex12_serving")


# ---- 12.1 reserved_blocks ------------------------------------------------------------------


def spec_blocks(policy, prompt, output, max_len, bs):
    """Exercise 12.1 as the spec reads, one case at a time."""
    pow2 = 1
    while pow2 < output:
        pow2 *= 2
    tokens = {"paged": prompt, "reserve_max": max_len, "reserve_pow2": prompt + pow2,
              "reserve_oracle": prompt + output}[policy]
    return math.ceil(min(tokens, max_len) / bs)


@pytest.mark.parametrize("seed", SEEDS)
def test_12_1_reserved_blocks_matches_the_spec(ex, seed):
    rng = random.Random(seed)
    for _ in range(300):
        max_len = rng.choice([256, 1000, 2048])
        prompt = rng.randint(1, max_len - 1)
        output = rng.randint(1, max_len - prompt)
        bs = rng.choice([1, 8, 16, 32])
        for policy in POLICIES:
            args = (policy, prompt, output, max_len, bs)
            assert_equal(ex.reserved_blocks(*args), spec_blocks(*args),
                         name=f"reserved_blocks{args}")


def test_12_1_reserved_blocks_edges(ex):
    assert_equal(ex.reserved_blocks("reserve_pow2", 10, 1, 512, 16), 1, name="pow2 of 1 is 1")
    assert_equal(ex.reserved_blocks("reserve_pow2", 16, 64, 512, 16), 5,
                 name="64 is already a power of two")
    assert_equal(ex.reserved_blocks("reserve_pow2", 16, 65, 512, 16), 9,
                 name="65 -> 128 output slots")
    assert_equal(ex.reserved_blocks("reserve_pow2", 600, 300, 1024, 16), 64,
                 name="pow2 clipped to max_model_len")
    assert_equal(ex.reserved_blocks("reserve_oracle", 17, 15, 1024, 16), 2,
                 name="32 tokens fill 2 blocks exactly")
    assert_equal(ex.reserved_blocks("reserve_max", 3, 2, 1000, 16), 63, name="ceil(1000 / 16)")
    assert_equal(ex.reserved_blocks("paged", 33, 900, 1024, 16), 3, name="paged: the prompt")
    with pytest.raises(ValueError):
        ex.reserved_blocks("reserve_half", 10, 10, 100, 16)


def test_12_1_reserved_blocks_agrees_with_the_engine(ex):
    policy_module = pytest.importorskip("paged_ref.engine.policy")
    if not hasattr(policy_module, "reserved_tokens"):
        pytest.skip("this engine has no reservation policies")
    from paged_ref.cache_math import blocks_needed

    rng = random.Random(7)
    for _ in range(300):
        prompt, output = rng.randint(1, 600), rng.randint(1, 400)
        for policy in POLICIES[1:]:
            want = blocks_needed(policy_module.reserved_tokens(policy, prompt, output, 1024), 16)
            assert_equal(ex.reserved_blocks(policy, prompt, output, 1024, 16), want,
                         name=f"{policy}, prompt {prompt}, output {output}")


# ---- 12.2 sustained_rate -------------------------------------------------------------------


def assert_rate(got, want, *, name):
    """``got == want`` up to rounding (None must be None)."""
    if want is None or got is None:
        assert_equal(got, want, name=name)
    elif not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
        raise AssertionError(f"{name}: expected {want!r}, got {got!r}")


def dense_sustained(rates, lats, bound):
    """The curve as a piecewise-linear function of the rate, scanned on a fine grid: the first
    rate where it exceeds the bound (minus one step), None / the last rate at the ends."""
    if lats[0] > bound:
        return None
    grid = np.linspace(rates[0], rates[-1], 200_001)
    above = np.nonzero(np.interp(grid, rates, lats) > bound)[0]
    return float(grid[above[0]]) if len(above) else rates[-1]


@pytest.mark.parametrize("seed", SEEDS)
def test_12_2_sustained_rate_matches_a_dense_scan(ex, seed):
    rng = random.Random(seed)
    for _ in range(60):
        n = rng.randint(2, 8)
        rates = sorted(rng.sample(range(1, 100), n))
        lats = [rng.uniform(0.5, 1.5)]
        for _ in range(n - 1):  # mostly rising, sometimes dipping
            lats.append(max(0.1, lats[-1] + rng.uniform(-0.4, 2.0)))
        bound = rng.uniform(0.8, 4.0)
        want = dense_sustained(rates, lats, bound)
        got = ex.sustained_rate(rates, lats, bound)
        if want is None:
            assert_rate(got, None, name=f"sustained_rate({rates}, {lats}, {bound:.3f})")
        else:
            assert got is not None and abs(got - want) <= (rates[-1] - rates[0]) * 1e-4, (
                f"sustained_rate({rates}, {[round(x, 3) for x in lats]}, {bound:.3f}): "
                f"expected {want:.4f}, got {got}")


def test_12_2_sustained_rate_edges(ex):
    assert_rate(ex.sustained_rate([1, 2, 3, 4], [1.0, 1.5, 3.0, 9.0], 2.0), 2 + 0.5 / 1.5,
                 name="interpolated between 2 and 3")
    assert_rate(ex.sustained_rate([1, 2], [2.5, 3.0], 2.0), None, name="above from the start")
    assert_rate(ex.sustained_rate([1, 2, 5], [1.0, 1.1, 1.2], 2.0), 5,
                 name="never above: at least the highest rate")
    assert_rate(ex.sustained_rate([1, 2, 3], [1.0, 2.0, 4.0], 2.0), 2.0,
                 name="a latency equal to the bound is within")
    assert_rate(ex.sustained_rate([1, 2, 3], [2.0, 2.0, 5.0], 2.0), 2.0,
                name="a flat stretch at the bound is within")
    assert_rate(ex.sustained_rate([1, 2], [2.0, 4.0], 2.0), 1.0,
                 name="the lowest rate exactly at the bound")
    assert_rate(ex.sustained_rate([1, 2, 3, 4], [1.0, 3.0, 1.5, 1.6], 2.0), 1.5,
                 name="only the first crossing counts")
    assert_rate(ex.sustained_rate([0.5, 1.0], [0.01, 0.05], 0.03), 0.75,
                 name="fractional rates, s/token latencies")


def test_12_2_agrees_with_the_library(ex):
    from paged_course.serving.sweep import sustained_rate

    rng = random.Random(3)
    for _ in range(50):
        rates = sorted(rng.sample(range(1, 60), 5))
        lats = sorted(rng.uniform(0.5, 6.0) for _ in range(5))
        curve = [{"rate_rps": r, "mean_normalized_latency_s": x} for r, x in zip(rates, lats)]
        want, _ = sustained_rate(curve, 2.0)
        got = ex.sustained_rate(rates, lats, 2.0)
        assert (got is None) == (want is None) and (want is None or got == pytest.approx(want))


# ---- 12.3 admission_order ------------------------------------------------------------------
# (the spec written another way, and the starvation test, are the engine's own tests')


@pytest.mark.parametrize("seed", SEEDS)
def test_12_3_admission_order_matches_the_spec(ex, seed):
    rng = random.Random(seed)
    for _ in range(200):
        n = rng.randint(1, 12)
        cached = [rng.choice([0, 16, 32, rng.randrange(0, 800, 16)]) for _ in range(n)]
        overtaken = [rng.randint(0, 6) for _ in range(n)]
        bound = rng.randint(0, 6)
        assert_equal(ex.admission_order(cached, overtaken, bound),
                     spec_order(cached, overtaken, bound),
                     name=f"admission_order({cached}, {overtaken}, {bound})")


def test_12_3_admission_order_edges(ex):
    assert_equal(ex.admission_order([0, 48, 16, 48], [0, 0, 0, 0], 8), [1, 3, 2, 0],
                 name="most cached first, ties in queue order")
    assert_equal(ex.admission_order([0, 48, 16], [8, 0, 9], 8), [0, 2, 1],
                 name="the aged first, in queue order")
    assert_equal(ex.admission_order([16, 0, 32], [0, 0, 0], 0), [0, 1, 2],
                 name="max_overtakes=0: everyone is aged, first come first served")
    assert_equal(ex.admission_order([16, 0, 32], [3, 2, 3], 3), [0, 2, 1],
                 name="overtaken exactly max_overtakes times is aged")
    assert_equal(ex.admission_order([], [], 4), [], name="an empty queue")


def test_12_3_admission_order_never_starves(ex):
    """One seat a step; each step a request whose prompt is cached arrives. The one with nothing
    cached is admitted right after max_overtakes of them."""
    check_starvation_bound(ex)


def test_12_3_agrees_with_the_engine(ex):
    policy_module = pytest.importorskip("paged_ref.engine.policy")
    if not hasattr(policy_module, "admission_order"):
        pytest.skip("this engine has no prefix-aware admission")
    rng = random.Random(8)
    for _ in range(100):
        n = rng.randint(1, 10)
        cached = [rng.randrange(0, 400, 16) for _ in range(n)]
        overtaken = [rng.randint(0, 5) for _ in range(n)]
        assert_equal(ex.admission_order(cached, overtaken, 3),
                     policy_module.admission_order(cached, overtaken, 3),
                     name=f"admission_order({cached}, {overtaken}, 3)")
