"""tools/gpu/transfer_probe.py (issue 15): its copy kernel, its profile arithmetic, and a smoke
run of the whole probe on the CPU (gloo, a tiny pool, Triton in the interpreter)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "tools" / "gpu"))  # (spawned ranks too)
import transfer_probe as probe  # noqa: E402


def test_copy_kernel_matches_index_select_and_index_copy():
    # more, fewer and as many programs as rows (23): every row copied exactly once
    probe.check_copy_kernels(torch.device("cpu"), programs=(1, 3, 64))


def test_copy_kernel_check_catches_a_kernel_that_ignores_the_index(monkeypatch):
    right = probe.copy_rows
    monkeypatch.setattr(probe, "copy_rows", lambda src, dst, index, *args, **kw: right(
        src, dst, torch.arange(len(index)), *args, **kw))  # rows 0, 1, ... not index
    with pytest.raises(AssertionError, match="gather"):
        probe.check_copy_kernels(torch.device("cpu"), programs=(2,))


def test_union_and_profile_summary():
    assert probe.union_ms([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == pytest.approx(4.0)
    events = [  # microseconds, as a chrome trace
        {"name": "void at::native::indexSelectLargeIndex<bf16>", "ts": 0, "dur": 1000},
        {"name": "ncclDevKernel_SendRecv(args)", "ts": 500, "dur": 2000},
        {"name": "ncclDevKernel_SendRecv(args)", "ts": 3000, "dur": 1000},
        {"name": "elementwise_kernel<index_copy_kernel_impl<bf16>>", "ts": 3500, "dur": 1500},
    ]
    s = probe.profile_summary(events, wall_ms=10.0)
    assert s["span_ms"] == pytest.approx(5.0)
    assert s["by_class"]["nccl"] == {"total_ms": pytest.approx(3.0), "count": 2}
    assert s["by_class"]["gather"]["count"] == 1 and s["by_class"]["scatter"]["count"] == 1
    assert s["nccl_busy_ms"] == pytest.approx(3.0)
    assert s["nccl_busy_pct_of_span"] == pytest.approx(60.0)
    assert s["nccl_busy_pct_of_wall"] == pytest.approx(30.0)
    assert s["nccl_and_copy_overlap_ms"] == pytest.approx(0.5 + 0.5)
    assert [t["class"] for t in s["timeline"]] == ["gather", "nccl", "nccl", "scatter"]


def test_cpu_smoke_run_writes_checked_rows(tmp_path):
    out = tmp_path / "transfer_probe.json"
    assert probe.main(["--cpu", "--prompts", "37", "--reps", "1", "--programs", "2",
                       "--env-sets", "nvl_chunk_1MiB", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "not a measurement" in data["gpu"]
    assert data["errors"] == [] and all(p["error"] is None for p in data["pairs"])
    variants = {r["variant"] for r in data["results"]}
    assert {"V0_library", "V0_probe", "raw_chunked", "V2_triton2", "V3_index_put",
            "V3_prealloc", "V2+V3_triton2+prealloc",
            "V4[nvl_chunk_1MiB]:V0_library"} <= variants
    for r in data["results"]:
        assert r["ms"] > 0 and r["case"] == "P37" and r["messages"] == 4
        assert r["pct_peer_copy_bw"] == pytest.approx(100 * r["gbps"] / data["peer_copy_gbps"])
    assert sum(r["checked"] for r in data["results"]) >= 8  # the data were compared
    assert {k["method"] for k in data["copy_kernels"] if "ms" in k} == {
        "index_select", "index_copy", "index_put", "triton2x1", "triton2x2", "triton2x4"}
    for rank in ("rank0", "rank1"):
        prof = data["profile_v0"][rank]
        assert prof["by_class"]["nccl"]["count"] >= 4  # gloo's send / recv ops on a CPU
    assert data["profile_v0"]["rank1"]["checked_equal"] is True
