"""Checks for lesson 03's exercises (gather attention), on fresh random paged inputs.

Run against the worked solutions (default) or your file:
``pytest tests/exercises/test_ex03_gather_attention.py --impl exercises``.
In the notebook: ``course.check("ex03_gather_attention", keyword="padded_slots")``.
"""

from __future__ import annotations

import math

import pytest
import torch

from paged_course.checks import assert_close, assert_equal
from paged_course.testing import make_paged_inputs
from paged_ref.reference import contiguous_attention
from paged_ref.reference import token_slots as slots_of_one_sequence
from tests.conftest import load_exercise


@pytest.fixture
def ex(request):
    return load_exercise(request.config, "ex03_gather_attention")


def _expected_slots(inp, max_len, block_size):
    rows = []
    for b, n in enumerate(inp.seq_lens.tolist()):
        row = slots_of_one_sequence(inp.block_tables[b].tolist(), n, block_size)
        rows.append(row + [0] * (max_len - n))
    slots = torch.tensor(rows, dtype=torch.int64).reshape(len(rows), max_len)
    valid = torch.arange(max_len)[None, :] < inp.seq_lens.long()[:, None]
    return slots, valid


# ---- Exercise 3.1: padded_slots --------------------------------------------------------------


def test_padded_slots_docstring_example(ex):
    tables = torch.tensor([[7, 2, -1], [5, -1, 99999]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    slots, valid = ex.padded_slots(tables, lens, 6, 4)
    assert_equal(slots, torch.tensor([[28, 29, 30, 31, 8, 9], [20, 21, 22, 0, 0, 0]]),
                 name="slots")
    assert_equal(valid, torch.tensor([[True] * 6, [True] * 3 + [False] * 3]), name="valid")


@pytest.mark.parametrize(
    "seq_lens, block_size",
    [([5, 16, 0, 31], 8), ([1, 2, 3], 1), ([17, 32, 33], 16), ([0, 0], 4)],
    ids=["bs8_ragged", "bs1", "bs16_boundaries", "all_empty"],
)
def test_padded_slots_on_random_tables(ex, seq_lens, block_size):
    inp = make_paged_inputs(seq_lens, block_size=block_size, seed=sum(seq_lens) + block_size)
    max_len = max(seq_lens)
    slots, valid = ex.padded_slots(inp.block_tables, inp.seq_lens, max_len, block_size)
    expected_slots, expected_valid = _expected_slots(inp, max_len, block_size)
    assert isinstance(slots, torch.Tensor) and slots.dtype == torch.int64, (
        f"slots must be an int64 tensor, got {getattr(slots, 'dtype', type(slots))}"
    )
    assert isinstance(valid, torch.Tensor) and valid.dtype == torch.bool, (
        f"valid must be a bool tensor, got {getattr(valid, 'dtype', type(valid))}"
    )
    assert_equal(valid, expected_valid, name="valid")
    assert_equal(slots, expected_slots, name="slots (0 where invalid)")


def test_padded_slots_pads_past_the_longest_sequence(ex):
    """max_len may exceed every length (up to what the table holds): padding is slot 0."""
    inp = make_paged_inputs([3, 9], block_size=4, seed=31, spare_columns=2)
    max_len = inp.block_tables.shape[1] * 4
    slots, valid = ex.padded_slots(inp.block_tables, inp.seq_lens, max_len, 4)
    expected_slots, expected_valid = _expected_slots(inp, max_len, 4)
    assert_equal(valid, expected_valid, name="valid")
    assert_equal(slots, expected_slots, name="slots (0 where invalid)")


def test_padded_slots_huge_entries_do_not_overflow(ex):
    """A used block id near the int32 limit: multiply in int64."""
    big = 2**31 - 2
    tables = torch.tensor([[big, -1]], dtype=torch.int32)
    slots, _ = ex.padded_slots(tables, torch.tensor([2], dtype=torch.int32), 2, 16)
    assert_equal(slots, torch.tensor([[big * 16, big * 16 + 1]]), name="slots")


# ---- Exercise 3.2: gather_slots --------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gather_slots_copies_each_slot(ex, dtype):
    inp = make_paged_inputs([7, 20, 1], num_kv_heads=2, head_dim=32, block_size=8, dtype=dtype,
                            seed=32)
    slots, _ = _expected_slots(inp, 20, 8)
    k, v = ex.gather_slots(inp.k_cache, inp.v_cache, slots)
    assert k.shape == (3, 20, 2, 32) and v.shape == (3, 20, 2, 32), (
        f"expected k, v of shape (3, 20, 2, 32), got {tuple(k.shape)} and {tuple(v.shape)}"
    )
    assert k.dtype == dtype and v.dtype == dtype, f"dtype changed: {k.dtype}, {v.dtype}"
    for b, n in enumerate(inp.seq_lens.tolist()):
        for t in range(n):
            s = int(slots[b, t])
            blk, off = divmod(s, 8)
            assert_equal(k[b, t], inp.k_cache[blk, off], name=f"k[{b}, {t}] (slot {s})")
            assert_equal(v[b, t], inp.v_cache[blk, off], name=f"v[{b}, {t}] (slot {s})")


def test_gather_slots_returns_copies(ex):
    inp = make_paged_inputs([6], block_size=4, seed=33)
    slots, _ = _expected_slots(inp, 6, 4)
    k, _ = ex.gather_slots(inp.k_cache, inp.v_cache, slots)
    before = inp.k_cache.clone()
    k.zero_()
    assert torch.equal(inp.k_cache, before), "writing to the gathered k changed the cache"


# ---- Exercise 3.3: masked_attention -----------------------------------------------------------


def test_masked_attention_docstring_example(ex):
    q = torch.tensor([[[1.0], [0.0]]])
    k = torch.tensor([0.0, math.log(3), math.nan]).view(1, 3, 1, 1)
    v = torch.tensor([4.0, 8.0, math.nan]).view(1, 3, 1, 1)
    valid = torch.tensor([[True, True, False]])
    out = ex.masked_attention(q, k, v, valid, 1.0)
    assert_close(out, torch.tensor([[[7.0], [6.0]]], dtype=torch.float64), name="output")


def _random_attention_inputs(batch, length, hq, hkv, d, dtype, seed, nan_padding=True):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, hq, d, generator=gen)
    k = torch.randn(batch, length, hkv, d, generator=gen)
    v = torch.randn(batch, length, hkv, d, generator=gen)
    lens = torch.randint(1, length + 1, (batch,), generator=gen)
    lens[0] = length
    valid = torch.arange(length)[None, :] < lens[:, None]
    if nan_padding:
        k = torch.where(valid[:, :, None, None], k, math.nan)
        v = torch.where(valid[:, :, None, None], v, math.nan)
    return q.to(dtype), k.to(dtype), v.to(dtype), valid


def _expected_attention(q, k, v, valid, scale):
    """float64, one (sequence, head) at a time."""
    batch, hq, _ = q.shape
    group = hq // k.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(batch):
        idx = valid[b].nonzero().flatten()
        if idx.numel() == 0:
            continue
        for h in range(hq):
            kk = k[b, idx, h // group].double()
            vv = v[b, idx, h // group].double()
            p = torch.softmax(kk @ q[b, h].double() * scale, dim=0)
            out[b, h] = p @ vv
    return out


@pytest.mark.parametrize(
    "hq, hkv, d, dtype",
    [(4, 4, 64, torch.float32), (8, 2, 80, torch.float32), (8, 1, 128, torch.float32),
     (8, 2, 64, torch.float16), (4, 1, 64, torch.bfloat16)],
    ids=["mha_f32", "gqa4_f32", "gqa8_d128_f32", "gqa4_f16", "gqa4_bf16"],
)
def test_masked_attention_matches_float64(ex, hq, hkv, d, dtype):
    q, k, v, valid = _random_attention_inputs(3, 21, hq, hkv, d, dtype, seed=hq * d + hkv)
    scale = d**-0.5
    out = ex.masked_attention(q, k, v, valid, scale)
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected q's dtype {dtype}"
    assert_close(out, _expected_attention(q, k, v, valid, scale), name="attention output")


def test_masked_attention_uses_the_scale(ex):
    q, k, v, valid = _random_attention_inputs(2, 9, 4, 2, 32, torch.float32, seed=34)
    out = ex.masked_attention(q, k, v, valid, 0.7)
    assert_close(out, _expected_attention(q, k, v, valid, 0.7), name="output with scale 0.7")


def test_masked_attention_empty_rows_are_zero(ex):
    q, k, v, valid = _random_attention_inputs(3, 5, 4, 2, 16, torch.float32, seed=35)
    valid[1] = False
    k[1], v[1] = math.nan, math.nan
    out = ex.masked_attention(q, k, v, valid, 0.25)
    assert not out.isnan().any(), f"NaN in the output at {out.isnan().nonzero()[:3].tolist()}"
    assert_equal(out[1], torch.zeros(4, 16), name="row with no valid position")
    assert_close(out, _expected_attention(q, k, v, valid, 0.25), name="output")


def test_masked_attention_matches_paged_ref(ex):
    q, k, v, valid = _random_attention_inputs(4, 13, 8, 2, 64, torch.float32, seed=36)
    got = ex.masked_attention(q, k, v, valid, 0.125)
    assert_close(got, contiguous_attention(q, k, v, valid, scale=0.125).double(),
                 name="vs paged_ref.reference.contiguous_attention")


# ---- all three together -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "seq_lens, block_size, hq, hkv, dtype, poison",
    [([5, 16, 0, 31], 8, 8, 2, torch.float32, "nan"),
     ([1, 40], 16, 4, 4, torch.float32, "large"),
     ([12, 3, 25], 1, 8, 1, torch.bfloat16, "nan")],
    ids=["bs8_gqa4_nan", "bs16_mha", "bs1_gqa8_bf16"],
)
def test_paged_attention_gather_matches_reference(ex, seq_lens, block_size, hq, hkv, dtype,
                                                  poison):
    inp = make_paged_inputs(seq_lens, num_q_heads=hq, num_kv_heads=hkv, block_size=block_size,
                            dtype=dtype, poison=poison, seed=37 + block_size)
    out = ex.paged_attention_gather(*inp.args())
    assert_close(out, inp.reference(), name="paged_attention_gather output")
