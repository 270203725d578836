"""Lesson 08's helpers: FLOP counting, the tile classification and pictures (the benchmark's
CPU answer: tests/course/test_bench_common.py)."""

from __future__ import annotations

import pytest

import paged_ref  # noqa: F401
from paged_course.viz.prefill import classify_tiles, draw_causal_offset, draw_roofline
from paged_ref.cache_math import attention_flops, visible_keys


@pytest.mark.parametrize("seq_len, q_len", [(1, 1), (7, 7), (40, 13), (9, 1), (5, 0)])
def test_visible_keys_counts_the_mask(seq_len, q_len):
    by_hand = sum(seq_len - q_len + i + 1 for i in range(q_len))
    assert visible_keys(seq_len, q_len) == by_hand
    assert visible_keys(seq_len, q_len, causal=False) == q_len * seq_len
    assert attention_flops(seq_len, q_len, 32, 128) == 4 * 32 * 128 * by_hand


def test_classify_tiles_covers_exactly_the_visible_keys():
    """Full tiles hold only visible keys; every visible key is in a full or masked tile."""
    seq_len, q_len, bq, bn = 70, 37, 8, 16
    grid = classify_tiles(seq_len, q_len, bq, bn)
    for i in range(q_len):
        pos = seq_len - q_len + i
        row = grid[i // bq]
        for j in range(seq_len):
            kind = row[j // bn]
            if kind == "full":
                assert j <= pos, f"row {i} does not see key {j} but its tile is unmasked"
            if j <= pos:
                assert kind != "skipped", f"row {i} sees key {j} but its tile is skipped"


def test_pictures_draw():
    assert draw_causal_offset(20, 12, block_q=4, block_n=8).axes
    assert draw_roofline({"a": 1.0, "b": 800.0}, peak_tflops=700, bw_gbps=4000,
                         measured={"b": 300.0}).axes


def test_quant_table_of_the_committed_run():
    """Lesson 10's prefill table, from the committed H200 run, and what its text says of it:
    over a quantised cache our kernel takes 1.2-1.5x bf16's time, is faster than FlashInfer's
    FP8 prefill, and many times faster than the torch backend the engine used before."""
    import json

    from paged_bench.prefill import quant_table
    from paged_course import ROOT

    result = json.loads((ROOT / "results" / "h200" / "prefill_quant.json").read_text())
    table = quant_table(result)
    assert [r["case"] for r in table] == ["P8_L2048", "P1_L16384", "P32_chunk512_ctx8192"]
    for row in table:
        for fmt in ("fp8", "fp8_token_head", "int4"):
            assert 1.2 < row[f"{fmt} / bf16"] < 1.5, (row["case"], fmt)
        assert row["fp8 ms"] < row["fp8_token_head ms"] < row["int4 ms"]
        assert row["FlashInfer fp8 ms"] > 1.7 * row["fp8 ms"]
        assert row["torch fp8 ms"] is None or row["torch fp8 ms"] > 15 * row["fp8 ms"]
    # a planted swap of two formats' labels must show
    swapped = json.loads(json.dumps(result))
    for r in swapped["results"]:
        r["label"] = {"triton fp8": "triton int4", "triton int4": "triton fp8"}.get(r["label"],
                                                                                  r["label"])
    assert quant_table(swapped)[0]["fp8 ms"] == table[0]["int4 ms"]


def test_float16_dots_beat_the_first_bfloat16_build():
    """Deep dive 10a: the first build (bfloat16 dots) was 5-11 % slower on every case and
    format."""
    import json

    from paged_bench.prefill import quant_table
    from paged_course import ROOT
    from paged_course.quant_deep import study_part

    now = quant_table(json.loads((ROOT / "results" / "h200" / "prefill_quant.json").read_text()))
    first_build = study_part("fp8_triton_study", "prefill_bf16_dots")  # (deep dive 10a)
    first = quant_table({"results": first_build["rows"]})
    for a, b in zip(now, first, strict=True):
        for fmt in ("fp8", "fp8_token_head", "int4"):
            assert 1.04 < b[f"{fmt} ms"] / a[f"{fmt} ms"] < 1.12, (a["case"], fmt)


def test_suite_rows_over_quantised_caches_at_a_tiny_shape(monkeypatch, kernel_device):
    """The prefill suite's rows, driven on the kernels' device (the interpreter on a CPU) with
    a tiny shape and a stand-in timer: bf16 rows from ``run_case``, quantised ones from
    ``quant_rows`` (checked against float64 of the de-quantised cache), and ``quant_table``
    reads them back."""
    import torch

    from paged_bench import prefill as bench_prefill
    from paged_bench.common import check_then_time

    monkeypatch.setattr(bench_prefill, "DEVICE", kernel_device)
    monkeypatch.setattr(bench_prefill, "SHAPE", dict(num_q_heads=4, num_kv_heads=2, head_dim=32,
                                                     block_size=16, dtype=torch.float32))
    monkeypatch.setattr(bench_prefill, "check_then_time", lambda *a, **k: check_then_time(
        *a, **k, timer=lambda fn: 2.0))
    pairs = [(40, 24), (17, 17)]
    rows = bench_prefill.run_case("tiny", pairs, ["triton", "torch"], [], peak=100.0)
    for fmt in ("fp8", "int4"):
        rows += bench_prefill.quant_rows("tiny", pairs, fmt, ["triton", "torch"], peak=100.0)
    labels = [r["label"] for r in rows]
    assert labels == ["triton", "torch", "triton fp8", "torch fp8", "triton int4", "torch int4"]
    assert all(r["rel_err"] < 1e-5 for r in rows), [(r["label"], r["rel_err"]) for r in rows]
    assert rows[2]["kind"] == "prefill_quant" and rows[2]["bytes"] < rows[0]["bytes"]
    (row,) = bench_prefill.quant_table({"results": rows})
    assert row["fp8 / bf16"] == 1.0 and row["torch fp8 ms"] == 2.0
    assert row["FlashInfer fp8 ms"] is None
