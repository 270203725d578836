"""``python -m paged_bench engine``'s arithmetic, on a CPU (the suite itself needs a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from paged_bench.engine import busy_seconds


def event(start_us: float, end_us: float):
    return SimpleNamespace(time_range=SimpleNamespace(start=start_us, end=end_us))


@pytest.mark.parametrize("ranges, busy_us", [
    ([], 0),
    ([(0, 10)], 10),
    ([(0, 10), (20, 25)], 15),  # a gap is not busy
    ([(0, 10), (5, 12)], 12),  # overlapping kernels (two streams) count once
    ([(0, 30), (5, 12), (40, 41)], 31),  # one inside another
    ([(40, 41), (0, 30), (5, 12)], 31),  # in any order
])
def test_busy_time_is_the_union_of_the_kernels_time_ranges(ranges, busy_us):
    assert busy_seconds([event(a, b) for a, b in ranges]) == pytest.approx(busy_us / 1e6)
