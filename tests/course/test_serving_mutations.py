"""Likely mistakes in paged_course.serving, planted one at a time: the checks of
``tests/course/test_serving.py`` must catch each."""

from __future__ import annotations

import pytest

from paged_course.serving import cost_model, driver, sweep, workload
from tests.course import test_serving as checks
from tests.mutations.mutate import mutant_of

MUTATIONS = [
    # (module, what went wrong, edits, the check that must fail)
    (driver, "TTFT measured from when the request was scheduled, not from its arrival",
     [("return self.token_times[0] - self.arrival_s", "return self.token_times[0] - self.added_s")],
     checks.check_hand_latencies),
    (driver, "normalized latency divided by the prompt's tokens",
     [("return self.e2e / n if n", "return self.e2e / self.prompt_len if n")],
     checks.check_hand_latencies),
    (driver, "a request's arrival taken as the time the driver added it",
     [("RequestRecord(i, r.arrival_s, now,", "RequestRecord(i, now, now,")],
     checks.check_hand_latencies),
    (driver, "tokens stamped with the step's start, not its end",
     [("rec.token_times.extend([end] *", "rec.token_times.extend([now] *")],
     checks.check_hand_latencies),
    (driver, "the simulated clock is set to the step's cost instead of advanced by it",
     [("self.t += float(self.cost_model(shape))", "self.t = float(self.cost_model(shape))")],
     checks.check_clock_follows_the_cost_model),
    (workload, "evenly spread gaps of the right mean (not exponential)",
     [(".exponential(1.0, n)", ".uniform(0.0, 2.0, n)")], checks.check_poisson),
    (workload, "gaps multiplied by the rate",
     [("np.cumsum(gaps) / rate", "np.cumsum(gaps) * rate")], checks.check_poisson),
    (workload, "at_rate scales the gaps the wrong way",
     [("k = self.rate_rps / rate_rps", "k = rate_rps / self.rate_rps")],
     checks.check_rates_scale_one_trace),
    (sweep, "the sustained rate is the last grid point within, not interpolated",
     [("return r0 + (bound - l0) / (l1 - l0) * (r1 - r0), False", "return r0, False")],
     checks.check_sustained),
    (sweep, "the bound from the worst policy's unloaded latency",
     [("return factor * min(firsts)", "return factor * max(firsts)")], checks.check_sustained),
    (sweep, "a point exactly at the bound counts as above it",
     [("not (lat <= bound)", "not (lat < bound)")], checks.check_sustained),
    (cost_model, "least squares without the sign constraint",
     [("            if (coef < 0).any():\n                continue\n", "")],
     checks.check_fit_recovers),
]


@pytest.mark.parametrize("module, description, edits, check", MUTATIONS,
                         ids=[m[1] for m in MUTATIONS])
def test_planted_mistake_is_caught(module, description, edits, check, tmp_path, monkeypatch):
    mutant = mutant_of(module, edits, tmp_path, monkeypatch)
    with pytest.raises((AssertionError, ValueError)):
        check(mutant)
