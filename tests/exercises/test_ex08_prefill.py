"""Checks for lesson 08's exercises (prefill over the paged cache), on fresh random inputs.

Run against the worked solutions (default) or your file:
``pytest tests/exercises/test_ex08_prefill.py --impl exercises``.
In the notebook: ``course.check("ex08_prefill", keyword="causal_offset_mask")``.

The Triton tests run in Triton's interpreter on a CPU (tiny sizes) and compiled on a GPU. At the
end, mutation tests plant the likely mistakes into the solutions and check that these tests
catch each one.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_ref import _device
from paged_course.checks import assert_close, assert_equal
from paged_course.testing import make_prefill_inputs
from paged_ref.prefill import paged_prefill_reference
from tests.conftest import load_exercise, run_kernel
from tests.mutations.mutate import load_mutant

DEVICE = _device.triton_device()
ROOT = Path(__file__).resolve().parents[2]
NAME = "ex08_prefill"
needs_triton = pytest.mark.skipif(not _device.HAS_TRITON, reason="triton is not installed")


@pytest.fixture
def ex(request):
    return load_exercise(request.config, NAME)


# ---- Exercise 8.1: causal_offset_mask -----------------------------------------------------------


def test_causal_offset_mask_docstring_example(ex):
    T, F = True, False
    assert_equal(ex.causal_offset_mask(5, 2), torch.tensor([[T, T, T, T, F], [T, T, T, T, T]]),
                 name="causal_offset_mask(5, 2): rows are tokens 3 and 4")


@pytest.mark.parametrize("seq_len, q_len", [(6, 6), (9, 1), (13, 4), (7, 0), (1, 1)])
def test_causal_offset_mask_every_entry(ex, seq_len, q_len):
    want = torch.tensor([[j <= seq_len - q_len + i for j in range(seq_len)]
                         for i in range(q_len)], dtype=torch.bool).reshape(q_len, seq_len)
    got = ex.causal_offset_mask(seq_len, q_len)
    assert got.dtype == torch.bool, f"expected a bool mask, got {got.dtype}"
    assert_equal(got, want, name=f"causal_offset_mask({seq_len}, {q_len}) (True = row sees key)")


# ---- Exercise 8.2: prefill_one_sequence ---------------------------------------------------------


def _one_sequence_reference(q, k, v, scale, causal):
    """float64, one query head at a time, keys counted by hand."""
    q_len, hq, _ = q.shape
    seq_len, hkv, _ = k.shape
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(q_len):
        visible = seq_len - q_len + i + 1 if causal else seq_len
        for h in range(hq):
            kv = h // (hq // hkv)
            p = torch.softmax(k[:visible, kv].double() @ q[i, h].double() * scale, dim=0)
            out[i, h] = p @ v[:visible, kv].double()
    return out


@pytest.mark.parametrize(
    "seq_len, q_len, hq, hkv, causal, dtype",
    [(12, 12, 4, 4, True, torch.float32), (20, 7, 8, 2, True, torch.float32),
     (9, 1, 6, 3, True, torch.float16), (15, 5, 8, 2, False, torch.float32),
     (17, 9, 8, 1, True, torch.bfloat16)],
    ids=["prompt_mha", "prefix_gqa4", "decode_gqa2_f16", "noncausal", "gqa8_bf16"],
)
def test_prefill_one_sequence_matches_reference(ex, seq_len, q_len, hq, hkv, causal, dtype):
    gen = torch.Generator().manual_seed(80 + seq_len + q_len)
    q = torch.randn(q_len, hq, 16, generator=gen).to(dtype)
    k = torch.randn(seq_len, hkv, 16, generator=gen).to(dtype)
    v = torch.randn(seq_len, hkv, 16, generator=gen).to(dtype)
    got = ex.prefill_one_sequence(q, k, v, scale=0.25, causal=causal)
    assert got.dtype == torch.float32, f"expected float32, got {got.dtype}"
    assert_close(got, _one_sequence_reference(q, k, v, 0.25, causal), rel_tol=1e-5,
                 name=f"prefill_one_sequence ({q_len} rows after {seq_len - q_len} cached tokens,"
                      f" {hq} q heads / {hkv} kv heads, causal={causal})")


# ---- Exercise 8.3: tile_key_ranges --------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize(
    "first_pos, last_pos, seq_len, causal, block_n, want",
    [(40, 47, 100, True, 16, (32, 48)),   # the docstring example
     (15, 15, 16, True, 16, (16, 16)),    # the row sees a whole key tile: no masked tile
     (14, 30, 31, True, 16, (0, 31)),     # first row sees only part of tile 0
     (0, 15, 16, True, 16, (0, 16)),      # a prompt's first tile
     (63, 70, 200, True, 32, (64, 71)),
     (3, 9, 37, False, 16, (32, 37)),     # not causal: everything but the last partial tile
     (0, 3, 32, False, 16, (32, 32))],
    ids=["example", "exact_tile", "partial", "first_tile", "bn32", "noncausal", "noncausal_exact"],
)
def test_tile_key_ranges(ex, first_pos, last_pos, seq_len, causal, block_n, want):
    got = run_kernel(ex.key_ranges, first_pos, last_pos, seq_len, causal=causal, block_n=block_n)
    assert got == want, (
        f"rows = tokens {first_pos}..{last_pos} of {seq_len}, causal={causal}, BLOCK_N "
        f"{block_n}: expected (full_end, kv_end) = {want}, got {got}")


# ---- Exercise 8.4: attend_key_range, through the given kernel -----------------------------------


@needs_triton
@pytest.mark.parametrize(
    "seq_lens, q_lens, hq, hkv, block_size, dtype, causal",
    [([20, 37, 9], [20, 16, 1], 4, 2, 4, torch.float32, True),
     ([33, 18], [17, 18], 8, 2, 5, torch.float32, True),
     ([40, 7, 0], [12, 7, 0], 4, 1, 16, torch.bfloat16, True),
     ([25, 19], [9, 19], 4, 4, 8, torch.float32, False)],
    ids=["prefix_gqa2_bs4", "gqa4_bs5", "bf16_gqa4_bs16", "noncausal"],
)
def test_attend_key_range_matches_reference(ex, seq_lens, q_lens, hq, hkv, block_size, dtype,
                                            causal):
    inp = make_prefill_inputs(seq_lens, q_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=32,
                              block_size=block_size, dtype=dtype, device=DEVICE, poison="nan",
                              seed=sum(seq_lens))
    out = run_kernel(ex.paged_prefill_tiles, *inp.args(), causal=causal)
    assert_close(out, inp.reference(causal=causal),
                 name=f"paged_prefill output (seq_lens {seq_lens}, query rows {q_lens})")


@needs_triton
def test_attend_key_range_every_diagonal_offset(ex):
    """Cached prefixes of 0..16 tokens put the diagonal everywhere inside a key tile."""
    prefixes = list(range(17))
    q_lens = [9 + p % 3 for p in prefixes]
    inp = make_prefill_inputs([p + n for p, n in zip(prefixes, q_lens, strict=True)], q_lens,
                              num_q_heads=1, num_kv_heads=1, head_dim=16, block_size=3,
                              device=DEVICE, seed=88)
    out = run_kernel(ex.paged_prefill_tiles, *inp.args(), block_m=16, block_n=16)
    assert_close(out, paged_prefill_reference(*inp.args()),
                 name="paged_prefill output, prefixes 0..16")


# ---- Mutation tests: each likely mistake, planted in the solutions, is caught -------------------

MUTATIONS = [
    # (id, old text, new text, the test that must catch it, its arguments)
    ("mask_off_by_one", "<= positions", "< positions",
     test_causal_offset_mask_every_entry, (13, 4)),
    ("mask_without_offset", "torch.arange(seq_len - q_len, seq_len)[:, None]",
     "torch.arange(0, q_len)[:, None]", test_causal_offset_mask_every_entry, (13, 4)),
    ("gqa_modulo_heads", "k.float().repeat_interleave(group, dim=1)",
     "k.float().repeat(1, group, 1)", test_prefill_one_sequence_matches_reference,
     (20, 7, 8, 2, True, torch.float32)),
    ("causal_ignored", "    if causal:\n        mask = causal_offset_mask",
     "    if False:\n        mask = causal_offset_mask",
     test_prefill_one_sequence_matches_reference, (20, 7, 8, 2, True, torch.float32)),
    ("full_end_one_too_far", "full_end = (first_pos + 1) // BLOCK_N",
     "full_end = (first_pos + 2) // BLOCK_N", test_tile_key_ranges,
     (14, 30, 31, True, 16, (0, 31))),
    ("kv_end_misses_diagonal", "kv_end = last_pos + 1", "kv_end = last_pos",
     test_tile_key_ranges, (40, 47, 100, True, 16, (32, 48))),
    ("no_mask_on_last_partial_tile", "keep = key_ok[None, :]",
     "keep = key_ok[None, :] | True", test_attend_key_range_matches_reference,
     ([25, 19], [9, 19], 4, 4, 8, torch.float32, False)),
    ("causal_mask_off_by_one", "key[None, :] <= pos[:, None]", "key[None, :] < pos[:, None]",
     test_attend_key_range_matches_reference,
     ([20, 37, 9], [20, 16, 1], 4, 2, 4, torch.float32, True)),
    ("no_rescale_of_acc", "acc = acc * alpha[:, None] + tl.dot", "acc = acc + tl.dot",
     test_attend_key_range_matches_reference,
     ([33, 18], [17, 18], 8, 2, 5, torch.float32, True)),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_mutations_are_caught(mutation, tmp_path, request):
    if request.config.getoption("--impl") != "solutions":
        pytest.skip("mutation tests check the tests, against the solutions")
    mutation_id, old, new, test, args = mutation
    if "kernel" in test.__name__ or test.__name__.startswith(("test_tile", "test_attend")):
        if not _device.HAS_TRITON:
            pytest.skip("triton is not installed")
    mutant = load_mutant(NAME, old, new, tmp_path)
    with pytest.raises(AssertionError):
        test(mutant, *args)
