"""``python -m paged_bench tiers --quick`` on a CPU: it runs, checks what comes back bit for bit,
writes the stamped record, and leaves no disk file behind."""

from __future__ import annotations

import json

import pytest
import torch

from paged_bench import SUITES
from paged_bench import tiers as suite

BACKENDS = {"disk_cold", "disk_warm", "spill_to_disk", "fsync", "host", "recompute"}


def test_tiers_is_a_suite():
    assert "tiers" in SUITES


def test_quick_run_writes_the_record(tmp_path, capsys):
    out = tmp_path / "out" / "tiers.json"
    assert suite.main(["--quick", "--reps", "2", "--workers", "2", "--out", str(out),
                       "--disk-path", str(tmp_path)]) == 0
    assert "wrote" in capsys.readouterr().out
    data = json.loads(out.read_text())
    for key in ("gpu", "torch", "triton", "date", "commit", "python"):
        assert data[key], key
    assert data["suite"] == "tiers" and data["quick"] is True
    assert data["shape"] == suite.QUICK_SHAPE and "paged_prefill" in data["recompute"]
    assert data["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 2  # K+V, layers, heads, dim, bf16
    disk = data["disk"]
    assert "POSIX_FADV_DONTNEED" in disk["cold"] and disk["workers"] == 2 and disk["kernel"]
    rows = {(r["case"], r["backend"]): r for r in data["results"]}
    assert set(rows) == {(f"P{n}", b) for n in suite.QUICK_PREFIXES for b in BACKENDS}
    for (case, backend), r in rows.items():
        assert r["ms"] > 0 and r["prefix_tokens"] == int(case[1:]) and r["label"] == backend
        assert len(r["ms_all"]) == r["reps"] == (4 if backend == "spill_to_disk" else 2)
        if backend == "recompute":
            assert r["tflops"] > 0 and r["prefill_tflop"] > 0
        else:
            assert r["bytes"] == r["prefix_tokens"] * data["kv_bytes_per_token"]
            assert r["gbps"] == pytest.approx(r["bytes"] / r["ms"] / 1e6)
        if backend in ("disk_cold", "disk_warm", "host"):
            assert r["check"] == "bit-exact" and r["recompute_over_this"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "the disk file was left"


def test_bad_prefixes_are_refused(tmp_path):
    with pytest.raises(SystemExit) as exc:
        suite.main(["--quick", "--prefixes", "64,100", "--out", str(tmp_path / "t.json")])
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="the full run is the GPU's")
def test_without_a_gpu_the_full_run_says_so(tmp_path, capsys):
    assert suite.main(["--out", str(tmp_path / "t.json")]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_mount_of_finds_the_longest_mount_point(tmp_path):
    mount = suite.mount_of(str(tmp_path))
    if mount:  # (a Linux /proc/mounts)
        assert str(tmp_path).startswith(mount["mount"]) and mount["fs_type"]


def test_a_spent_budget_leaves_one_rep(tmp_path, capsys):
    out = tmp_path / "tiers.json"
    assert suite.main(["--quick", "--reps", "2", "--budget-s", "0", "--out", str(out),
                       "--disk-path", str(tmp_path)]) == 0
    assert "1 rep" in capsys.readouterr().out
    reps = {(r["case"], r["backend"]): r["reps"] for r in json.loads(out.read_text())["results"]}
    assert reps["P64", "host"] == 2 and reps["P256", "host"] == 1
