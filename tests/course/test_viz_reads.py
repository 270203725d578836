"""The pictures of what a kernel read (lesson 04's warm-ups)."""

from __future__ import annotations

import pytest

from paged_course import viz


def test_reads_from_probe_names_the_addresses():
    loaded = [[3.0, 0.0, 7.0], [7.0, float("nan"), 1.5], [100.0, -2.0, 1.0]]
    assert viz.reads_from_probe(loaded, 8) == [True, False, True, False, False, False, True,
                                               False]


def test_draw_memory_reads_counts_each_kind():
    touched = [True, True, False, False]
    expected = [True, False, True, False]
    fig = viz.draw_memory_reads(touched, expected, cols=2, title="t")
    title = fig.axes[0].get_title()
    assert "read as specified 1, read outside the data 1, missed 1" in title
    assert len(fig.axes[0].patches) == 4


@pytest.mark.parametrize("args, error, text", [
    (([True], [True, False], 2), ValueError, "touched has 1 elements"),
    (([True], [True], 0), ValueError, "cols must be >= 1"),
])
def test_draw_memory_reads_rejects_bad_input(args, error, text):
    with pytest.raises(error, match=text):
        viz.draw_memory_reads(*args)


def test_draw_running_max_draws_one_line_per_step():
    fig = viz.draw_running_max([-3.0, -1.0, -2.0, -5.0, -4.0, 2.0], 4, [-1.0, 2.0])
    labels = [t.get_text() for t in fig.axes[0].texts]
    assert labels == ["-1.00", "2.00"]
    with pytest.raises(ValueError, match="block must be >= 1"):
        viz.draw_running_max([1.0], 0, [])
