"""``paged_bench warmup``'s pieces that run on a CPU: the collector-pause recorder (the GPU run
records each ``generate``'s pauses next to its speed) and the CPU message."""

from __future__ import annotations

import gc

import pytest
import torch

from paged_bench import warmup


class _Cycle:
    def __init__(self):
        self.me = self


def test_collector_pauses_counts_each_pass_by_generation():
    with warmup.CollectorPauses() as pauses:
        for _ in range(100):
            _Cycle()
        gc.collect(0)
        gc.collect()
    got = pauses.as_dict()
    assert got["gc_passes_by_generation"][0] >= 1 and got["gc_passes_by_generation"][2] >= 1
    assert 0 < got["gc_longest_pause_s"] <= got["gc_pause_s"]
    assert not any(getattr(c, "__self__", None) is pauses for c in gc.callbacks)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the suite runs (minutes)")
def test_on_a_cpu_it_says_why_it_stops(capsys):
    assert warmup.main([]) == 0
    assert "no CUDA GPU" in capsys.readouterr().out
