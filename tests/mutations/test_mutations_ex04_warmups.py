"""Lesson 04 warm-ups' likely mistakes, planted into the solution: the tests must catch each."""

from __future__ import annotations

import pytest

from tests.mutations.mutate import Mutation, assert_caught

NAME = "ex04_warmups"

MUTATIONS = [
    # 4.0a masked_row_copy_kernel
    Mutation("4.0a missed mask: reads the padding past n_cols",
             "tl.load(x_ptr + row * stride_x + offs, mask=offs < n_cols, other=0.0)",
             "tl.load(x_ptr + row * stride_x + offs)", keyword="masked_row_copy"),
    Mutation("4.0a off-by-one mask: reads column n_cols",
             "mask=offs < n_cols, other=0.0)", "mask=offs <= n_cols, other=0.0)",
             keyword="masked_row_copy"),
    Mutation("4.0a row stride ignored (rows assumed BLOCK apart)",
             "tl.load(x_ptr + row * stride_x + offs,", "tl.load(x_ptr + row * BLOCK + offs,",
             keyword="masked_row_copy"),
    Mutation("4.0a masked store: padded output lanes left as they were",
             "    tl.store(out_ptr + row * BLOCK + offs, values)",
             "    tl.store(out_ptr + row * BLOCK + offs, values, mask=offs < n_cols)",
             keyword="masked_row_copy"),
    # 4.0b gather_rows_kernel
    Mutation("4.0b rows past n_idx not masked: garbage indices are followed",
             "mask = i_mask[:, None] & (offs_d < n_cols)[None, :]",
             "mask = (offs_d < n_cols)[None, :]", keyword="gather_rows"),
    Mutation("4.0b columns not masked: reads the padding past n_cols",
             "mask = i_mask[:, None] & (offs_d < n_cols)[None, :]", "mask = i_mask[:, None]",
             keyword="gather_rows"),
    Mutation("4.0b the index used as the row itself (no gather)",
             "x_ptr + rows[:, None] * stride_x", "x_ptr + offs_i[:, None] * stride_x",
             keyword="gather_rows"),
    Mutation("4.0b rows and columns broadcast the wrong way round",
             "x_ptr + rows[:, None] * stride_x + offs_d[None, :]",
             "x_ptr + rows[None, :] * stride_x + offs_d[:, None]", keyword="gather_rows"),
    # 4.0c running_max_kernel
    Mutation("4.0c masked lanes load 0, which wins over negative values",
             'mask=cols < n, other=float("-inf"))', "mask=cols < n, other=0.0)",
             keyword="running_max"),
    Mutation("4.0c missed mask: reads past the row's length",
             'mask=cols < n, other=float("-inf"))', 'other=float("-inf"))',
             keyword="running_max"),
    Mutation("4.0c loop bound rounded down: the last partial tile is skipped",
             "    for s in range(0, tl.cdiv(n, BLOCK)):\n        cols",
             "    for s in range(0, n // BLOCK):\n        cols",
             keyword="running_max"),
    Mutation("4.0c the max restarts every step (the tile's max, not the running max)",
             "m = tl.maximum(m, tl.max(values, axis=0))", "m = tl.max(values, axis=0)",
             keyword="running_max"),
    Mutation("4.0c step index used as a column (tiles overlap)",
             "cols = s * BLOCK + offs", "cols = s + offs", keyword="running_max"),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=str)
def test_mutation_is_caught(mutation, tmp_path):
    assert_caught(NAME, mutation, tmp_path)
