"""Lesson 08's helpers: FLOP counting, the tile classification and pictures (the benchmark's
CPU answer: tests/course/test_bench_common.py)."""

from __future__ import annotations

import pytest

import paged_ref  # noqa: F401
from paged_ref.cache_math import attention_flops, visible_keys
from paged_ref.course.viz_prefill import classify_tiles, draw_causal_offset, draw_roofline


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
