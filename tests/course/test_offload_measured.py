"""Lesson 07 reads the GPU's offload measurement (``tools/gpu/offload.py``'s JSON) when it is
committed: a fake file of that shape, and the verdict drawn from its numbers."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from paged_course import offload


def fake(ratios: dict[int, float]) -> dict:
    """A JSON of tools/gpu/offload.py's shape with the given recompute / copy ratios."""
    rows = [dict(prefix_tokens=n, blocks=n // 16, bytes=n * 131072, copy_back_ms=n / 1000,
                 bulk_h2d_ms=n / 1100, copy_back_gbps=55.0, prefill_tflop=1.0,
                 recompute_ms=ratio * n / 1000, recompute_over_copy=ratio)
            for n, ratio in ratios.items()]
    return dict(gpu="NVIDIA H200", torch="2.11.0+cu130", cuda="13.0", paged_ref="0.1",
                python="3.12.3", date="2026-12-01", model=offload.LLAMA_8B,
                kv_bytes_per_block=2**21, matmul_tflops=750.0, matmul_size=8192,
                pinned_h2d_gbps=55.3, results=rows)


def test_missing_file_is_none(tmp_path):
    assert offload.load_measured(tmp_path / "offload.json") is None


def test_reads_and_describes_a_measurement(tmp_path):
    path = tmp_path / "offload.json"
    path.write_text(json.dumps(fake({1024: 0.6, 512: 0.4, 2048: 1.5, 4096: 3.0})))
    data = offload.load_measured(path)
    text = offload.describe_measured(data)
    head, *table, verdict = text.splitlines()
    assert "NVIDIA H200" in head and "2026-12-01" in head and "torch 2.11.0+cu130" in head
    assert "55.3 GB/s" in head and "750 TFLOP/s" in head
    assert [line.split()[0] for line in table[2:]] == ["512", "1024", "2048", "4096"]
    assert verdict.startswith("copying back beats even an ideal recompute from 2048 tokens up")
    assert "1.5x" in verdict


@pytest.mark.parametrize("ratios, first, says", [
    ({512: 2.0, 1024: 4.0}, 512, "at every prefix measured: 2.0x faster at 512 tokens, 4.0x"),
    ({512: 0.5, 1024: 0.9}, None, "an ideal recompute (at the matmul rate) is faster"),
    ({512: 1.2, 1024: 0.9, 2048: 1.1}, 2048, "from 2048 tokens up"),  # a dip: from the last
])
def test_when_offload_wins(ratios, first, says):
    data = fake(ratios)
    assert offload.offload_wins_from(data["results"]) == first
    assert says in offload.describe_measured(data)


def test_a_file_of_another_shape_names_what_is_missing(tmp_path):
    data = fake({512: 2.0})
    del data["matmul_tflops"], data["results"][0]["recompute_ms"]
    path = tmp_path / "offload.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match=r"missing matmul_tflops, results\[0\]\.recompute_ms"):
        offload.load_measured(path)


def test_the_gpu_script_writes_what_the_lesson_reads(tmp_path):
    """tools/gpu/offload.py --smoke (tiny sizes on this CPU) writes a file this reads."""
    script = Path(__file__).parents[2] / "tools" / "gpu" / "offload.py"
    spec = importlib.util.spec_from_file_location("offload_tool_for_lesson", script)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--smoke", "--out", str(tmp_path / "offload.json")]) == 0
    data = offload.load_measured(tmp_path / "offload.json")
    assert "not a measurement" in offload.describe_measured(data).splitlines()[0]
