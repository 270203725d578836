"""paged_ref.kernels.triton.checks: the unplanned call's value checks as one kernel, against
the same checks done in NumPy (in the interpreter here; tests/test_gpu.py runs it compiled)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from paged_ref.kernels.triton import checks as triton_checks
from tests.conftest import KERNEL_DEVICE
from tests.mutations.mutate import mutant_of

#: Where the Triton kernels take tensors here: CUDA on a GPU (compiled), the CPU otherwise.
DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)


def numpy_stats(table, lens, block_size, num_blocks):
    table, lens = table.cpu().numpy().astype(np.int64), lens.cpu().numpy().astype(np.int64)
    used = np.arange(table.shape[1])[None, :] * block_size < lens[:, None]
    bad = used & ((table < 0) | (table >= num_blocks))
    return int(lens.min()), int(lens.max()), int(lens.sum()), int(bad.sum())


def random_case(seed, batch, width, block_size=4, num_blocks=50, strided=False):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(-2, width * block_size + 3, (batch,), generator=gen, dtype=torch.int32)
    table = torch.randint(-3, num_blocks + 3, (batch, width), generator=gen, dtype=torch.int32)
    table[:, ::5] = 2**31 - 1  # huge ids, as garbage in unused entries often is
    if strided:  # a transposed view and every other length: the kernel takes strides
        table = table.t().contiguous().t()
        lens = torch.stack([lens, lens]).t().flatten()[::2]
    return table.to(DEVICE), lens.to(DEVICE), block_size, num_blocks


CASES = [(0, 1, 1), (1, 3, 7), (2, 16, 128), (3, 17, 129), (4, 40, 300), (5, 5, 0),
         (6, 1, 9000), (7, 2, 4097), (8, 9, 1025)]  # (long rows: the loop's several tiles)


@pytest.mark.parametrize("batch, width, most_steps", [(1, 8193, 3), (8, 2049, 3), (32, 1010, 2),
                                                      (256, 65, 1), (3, 5, 1)])
def test_a_long_narrow_table_takes_few_steps(batch, width, most_steps):
    """One program's loop steps run one after another: B1_L131072's one row of 8,193 entries in
    16 x 128 tiles took 65 (~60 us on an H200)."""
    rows, cols = triton_checks.tile_shape(batch, width)
    assert rows * cols <= triton_checks.TILE_ENTRIES and rows <= triton_checks.ROWS
    assert -(-width // cols) <= most_steps
    assert cols <= max(16, 2 * width), "wider than the table needs"


@pytest.mark.parametrize("seed, batch, width", CASES)
@pytest.mark.parametrize("strided", [False, True])
def test_kernel_counts_what_numpy_counts(seed, batch, width, strided):
    args = random_case(seed, batch, width, strided=strided)
    assert triton_checks.length_stats(*args) == numpy_stats(*args)


def numpy_checked_lens(table, lens, block_size, num_blocks):
    """What the kernel writes to ``checked_lens``: the length, or -1 for a row failing a check."""
    table, lens = table.cpu().numpy().astype(np.int64), lens.cpu().numpy().astype(np.int64)
    used = np.arange(table.shape[1])[None, :] * block_size < lens[:, None]
    bad = (used & ((table < 0) | (table >= num_blocks))).any(axis=1)
    ok = ~bad & (lens >= 0) & (lens <= table.shape[1] * block_size)
    return np.where(ok, lens, -1)


@pytest.mark.parametrize("seed, batch, width", CASES)
def test_checked_lens_mark_each_failing_row(seed, batch, width):
    table, lens, bs, nb = random_case(seed, batch, width, strided=seed % 2 == 1)
    got = triton_checks.start_checks(table, lens, bs, nb).checked_lens
    assert got.dtype == torch.int32
    np.testing.assert_array_equal(got.cpu().numpy(), numpy_checked_lens(table, lens, bs, nb))


def test_an_entry_just_past_the_last_used_block_is_not_checked():
    """Length 8 with blocks of 4 uses entries 0 and 1: garbage in entry 2 is fine, in 1 not."""
    table = torch.tensor([[0, 1, -7]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([8], dtype=torch.int32, device=DEVICE)
    assert triton_checks.length_stats(table, lens, 4, 2)[3] == 0
    lens[0] = 9  # now entry 2 is used
    assert triton_checks.length_stats(table, lens, 4, 2)[3] == 1


MUTATIONS = [
    ("used mask off by one at a block edge", "first_token[None, :] < lens[:, None]",
     "first_token[None, :] <= lens[:, None]"),
    ("negative ids not bad", "(ids < 0) | (ids >= num_blocks)", "(ids >= num_blocks)"),
    ("padded rows counted in the minimum", "tl.where(r_mask, lens, big)", "lens"),
    ("a row with a bad entry passes", "(tl.sum(bad, axis=1) == 0) & ", ""),
    ("a row past the table's capacity passes", " & (lens <= capacity)", ""),
    ("a negative row passes", " & (lens >= 0)", ""),
]


@pytest.mark.parametrize("desc, old, new", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_planted_mistakes_are_caught(desc, old, new, tmp_path, monkeypatch):
    mutant = mutant_of(triton_checks, [(old, new)], tmp_path, monkeypatch)
    cases = [random_case(seed, b, w) for seed, b, w in CASES]
    cases.append((torch.tensor([[0, 1, -7]], dtype=torch.int32, device=DEVICE),
                  torch.tensor([8], dtype=torch.int32, device=DEVICE), 4, 2))
    assert any(mutant.length_stats(*c) != numpy_stats(*c)
               or (mutant.start_checks(*c).checked_lens.cpu().numpy()
                   != numpy_checked_lens(*c)).any()
               for c in cases), desc
