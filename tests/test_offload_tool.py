"""tools/gpu/offload.py: the FLOP count and a smoke run on the CPU."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

SPEC = importlib.util.spec_from_file_location(
    "offload_tool", Path(__file__).parents[1] / "tools" / "gpu" / "offload.py")
offload = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(offload)


def test_prefill_flops_of_a_llama_8b_layer_stack():
    # one token: 2 FLOPs per weight of the 32 layers (~6.98 B weights), no attention square
    assert offload.prefill_flops(1, offload.LLAMA_8B) == pytest.approx(
        2 * 32 * 218_103_808 + 32 * 2 * 32 * 128)
    # causal attention grows with n^2: doubling n more than doubles the FLOPs
    assert offload.prefill_flops(2048, offload.LLAMA_8B) > 2 * offload.prefill_flops(
        1024, offload.LLAMA_8B)


def test_smoke_run_writes_json(tmp_path):
    out = tmp_path / "offload.json"
    assert offload.main(["--smoke", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert "not a measurement" in data["gpu"]
    assert [r["prefix_tokens"] for r in data["results"]] == [64, 128]
    assert all(r["copy_back_ms"] > 0 and r["recompute_ms"] > 0 for r in data["results"])
