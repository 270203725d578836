"""paged_course.cost: the no-read-back guard, the step timings and the lesson's pictures."""

from __future__ import annotations

import json

import matplotlib
import pytest
import torch

from paged_course import cost
from paged_course.simulate import sample_requests
from paged_course.testing import make_paged_inputs

matplotlib.use("Agg")
ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("read", [lambda t: t.item(), lambda t: t.tolist(), lambda t: t.cpu(),
                                  lambda t: int(t), lambda t: bool(t), lambda t: t.numpy()],
                         ids=["item", "tolist", "cpu", "int", "bool", "numpy"])
def test_forbid_host_reads_raises_and_restores(read):
    t = torch.tensor([3])
    with cost.forbid_host_reads(), pytest.raises(cost.HostReadError):
        read(t)
    read(t)  # restored after the block


def test_forbid_host_reads_restores_after_an_error():
    with pytest.raises(ZeroDivisionError), cost.forbid_host_reads():
        raise ZeroDivisionError
    assert torch.tensor([2]).item() == 2


def test_call_steps_us_names_every_step():
    inp = make_paged_inputs([5, 9], seed=0)
    steps = cost.call_steps_us(inp, calls=2)
    assert set(cost.STEPS) | {"unplanned_call", "planned_call", "picked"} == set(steps)
    assert all(v > 0 for k, v in steps.items() if k != "picked")


def test_committed_results_make_the_table_and_pictures():
    bench = json.loads((ROOT / "results/h200/decode.json").read_text())
    page = json.loads((ROOT / "results/h200/page_size.json").read_text())
    headers, rows = cost.decode_table(bench)
    assert len(headers) == 1 + len(cost.TABLE_COLUMNS) and len(rows) == 6
    assert all("-" not in cell for row in rows for cell in row[1:]), rows
    cost.plot_call_steps(bench["host_us"])
    waste = cost.half_block_waste([1, 16, 256], sample_requests(200, seed=0), 20_000)
    assert waste[1] <= waste[16] < waste[256]
    cost.plot_page_size(page, waste)
    cost.plot_roofline(bench, [("decode", 4.0, 16.0), ("prefill", 800.0, float("nan"))])
    assert cost.decode_intensity(32, 8) == 4.0
