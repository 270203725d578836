"""Checks for lesson 04's warm-ups (small Triton kernels), on fresh random inputs.

Run against the worked solutions (default) or your file:
``pytest tests/exercises/test_ex04_warmups.py --impl exercises``.
In the notebook: ``course.check("ex04_warmups", keyword="masked_row_copy")``.

Every input lives inside a larger buffer whose other elements are NaN ("poison"): a load that
should have been masked reads NaN (inside the buffer, so nothing crashes) and the check shows
where.
"""

from __future__ import annotations

import math

import pytest
import torch

from paged_ref import _device
from paged_course.checks import assert_close, assert_equal
from tests.conftest import load_exercise

DEVICE = _device.triton_device()

needs_triton = pytest.mark.skipif(not _device.HAS_TRITON, reason="triton is not installed")
pytestmark = needs_triton


@pytest.fixture
def ex(request):
    return load_exercise(request.config, "ex04_warmups")


def poisoned_rows(gen, rows: int, n_cols: int, stride: int) -> torch.Tensor:
    """A [rows, stride]-strided view of random data in its first n_cols columns, NaN elsewhere,
    inside a buffer with a NaN row before and after (so stray reads stay in bounds)."""
    buf = torch.full((rows + 2, stride), math.nan)
    buf[1:-1, :n_cols] = torch.randn(rows, n_cols, generator=gen)
    buf = buf.to(DEVICE)
    return buf[1:-1, :n_cols]


# ---- Exercise 4.0a: masked_row_copy_kernel ------------------------------------------------------


@pytest.mark.parametrize("rows, n_cols, stride, block", [(3, 5, 8, 8), (4, 13, 20, 16),
                                                          (2, 16, 16, 16), (5, 1, 7, 32)],
                         ids=["5_of_8", "13_of_16", "full_block", "one_col"])
def test_masked_row_copy(ex, rows, n_cols, stride, block):
    gen = torch.Generator().manual_seed(70 + n_cols)
    x = poisoned_rows(gen, rows, n_cols, stride)
    out = ex.masked_row_copy(x, n_cols, block)
    expected = torch.zeros(rows, block, dtype=torch.float64)
    expected[:, :n_cols] = x.cpu().double()
    assert_close(out, expected, rel_tol=0.0,
                 name=f"out (columns >= {n_cols} must be 0; NaN there means an unmasked read)")


# ---- Exercise 4.0b: gather_rows_kernel ----------------------------------------------------------


@pytest.mark.parametrize("num_rows, n_idx, n_cols, stride, block_i, block_d",
                         [(10, 5, 12, 16, 8, 16), (6, 16, 16, 16, 16, 16), (40, 3, 9, 11, 16, 16),
                          (8, 0, 8, 8, 16, 16)],
                         ids=["ragged", "full", "strided", "none"])
def test_gather_rows(ex, num_rows, n_idx, n_cols, stride, block_i, block_d):
    gen = torch.Generator().manual_seed(80 + num_rows + n_idx)
    x = poisoned_rows(gen, num_rows, n_cols, stride)
    idx = torch.randint(0, num_rows, (block_i,), generator=gen, dtype=torch.int32)
    idx[n_idx:] = -1  # garbage past n_idx: -1 (the NaN row before x) and other rows' ids
    idx[n_idx + 1::2] = torch.randint(0, num_rows, (len(idx[n_idx + 1::2]),), generator=gen,
                                      dtype=torch.int32)
    out = ex.gather_rows(x, idx.to(DEVICE), n_idx, n_cols, block_i, block_d)
    expected = torch.zeros(block_i, block_d, dtype=torch.float64)
    for i in range(n_idx):
        expected[i, :n_cols] = x[int(idx[i])].cpu().double()
    assert_close(out, expected, rel_tol=0.0,
                 name=f"out (rows >= {n_idx} and columns >= {n_cols} must be 0)")


def test_gather_rows_repeats_and_order(ex):
    """The same row twice, in any order: a gather is not a slice."""
    gen = torch.Generator().manual_seed(90)
    x = poisoned_rows(gen, 5, 16, 16)
    idx = torch.tensor([4, 4, 0, 2, -1, 3, 3, -1, 1, 0, 2, 2, 4, 1, 0, 3], dtype=torch.int32)
    out = ex.gather_rows(x, idx.to(DEVICE), 16, 16, 16, 16)
    expected = torch.zeros(16, 16, dtype=torch.float64)
    for i, r in enumerate(idx.tolist()):
        if r >= 0:
            expected[i] = x[r].cpu().double()
    keep = idx >= 0
    assert_close(out[keep], expected[keep], rel_tol=0.0, name="gathered rows (idx >= 0)")


# ---- Exercise 4.0c: running_max_kernel ----------------------------------------------------------


@pytest.mark.parametrize("lens, block, shift", [([37, 16, 1, 0, 50], 16, 0.0),
                                                ([9, 20, 4], 4, -10.0),
                                                ([100, 33], 32, -1000.0)],
                         ids=["ragged_bs16", "negative_bs4", "very_negative_bs32"])
def test_running_max(ex, lens, block, shift):
    gen = torch.Generator().manual_seed(100 + block)
    width = max(lens) + block  # room for a tile that runs past every row
    x = poisoned_rows(gen, len(lens), width, width + 3)
    x[:, :] = torch.randn(len(lens), width, generator=gen).to(DEVICE) + shift
    for r, n in enumerate(lens):
        x[r, n:] = 1e30  # past the row's length: an unmasked read wins the max
    steps = ex.running_max(x, torch.tensor(lens, dtype=torch.int32, device=DEVICE), block)
    num_steps = steps.shape[1]
    expected = torch.full((len(lens), num_steps), math.nan, dtype=torch.float64)
    for r, n in enumerate(lens):
        for s in range(-(-n // block)):
            expected[r, s] = x[r, : min((s + 1) * block, n)].max().item()
    written = ~expected.isnan()
    got = steps.cpu().double()
    assert_equal(~got.isnan(), written,
                 name=f"which steps[row, s] were written (a row of n values has ceil(n/{block}))")
    assert_close(got[written], expected[written], rel_tol=0.0,
                 name="running max after each step (flattened over rows)")
