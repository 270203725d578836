"""``python -m paged_bench host_path`` on a CPU: the planned call's host path with the kernel
launch stubbed out (the proxy this machine can measure), written as JSON."""

from __future__ import annotations

import json

import pytest
import torch

from paged_bench import SUITES
from paged_bench import host_path as suite
from paged_ref.kernels.triton import launch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU proxy (a GPU "
                                "machine times the real launch: tests/test_gpu_planned.py)")


def test_host_path_is_a_suite():
    assert "host_path" in SUITES


def test_b4_l2048_host_path_is_timed_bound_with_the_launch_stubbed(tmp_path, capsys):
    out = tmp_path / "host_path.json"
    assert suite.main(["--calls", "300", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["case"] == "B4_L2048" and result["launch_stubbed"]
    assert result["backend"] == "triton_split" and result["split"]["num_chunks"] > 1
    assert result["bound"], "the timed calls went the full path"
    row = result["planned_call"]
    assert row["calls"] == 300 and 0 < row["median_us"] <= row["p90_us"]
    assert "planned_call: host" in capsys.readouterr().out


def test_stub_replaces_every_launch_and_is_undone():
    real = launch.run_kernel
    with suite.stubbed_launches():
        assert launch.run_kernel is not real
        assert launch.run_kernel(lambda: 1 / 0) is None  # nothing runs
    assert launch.run_kernel is real
