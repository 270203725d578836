"""Checks for lesson 10's exercises (quantised KV caches), on fresh random values.

Run against the worked solutions (default) or your file:
``pytest tests/exercises/test_ex10_quant.py --impl exercises``.
In the notebook: ``course.check("ex10_quant", keyword="fp8")``.

The last tests plant likely mistakes into the solution and check these tests catch each one.
"""

from __future__ import annotations

import pytest
import torch

from paged_ref import _device
from paged_course.checks import assert_close, assert_equal
from paged_course.testing import make_paged_inputs
from paged_ref.reference import gather_kv
from tests.conftest import load_exercise
from tests.mutations.mutate import load_mutant

DEVICE = _device.triton_device()


@pytest.fixture
def ex(request):
    return load_exercise(request.config, "ex10_quant")


def _values(shape, seed, dtype=torch.float32):
    """Unit-normal values with one large one-signed channel (as in real K caches)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    x[..., 1] = x[..., 1] * 8 + 20
    return x.to(dtype)


# ---- Exercise 10.1: quantize_fp8 ----------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fp8_codes_and_scales(ex, dtype):
    x = _values((33, 3, 64), seed=1, dtype=dtype)
    codes, scale = ex.quantize_fp8(x)
    assert codes.dtype == torch.float8_e4m3fn, f"codes dtype {codes.dtype}"
    assert codes.shape == x.shape, f"codes shape {tuple(codes.shape)}"
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1], (
        f"scale must be float32 {tuple(x.shape[:-1])}, got {scale.dtype} {tuple(scale.shape)}")
    amax = x.float().abs().amax(-1)
    assert_close(scale, (amax / 448).double(), rel_tol=1e-6, name="scale = amax / 448")
    assert not codes.float().isnan().any(), "NaN codes: clamp to [-448, 448] before the cast"
    assert_equal(codes.float().abs().amax(-1), torch.full(x.shape[:-1], 448.0),
                 name="largest |code| per vector")


def test_fp8_round_trip_is_within_half_a_step(ex):
    x = _values((20, 2, 64), seed=2)
    codes, scale = ex.quantize_fp8(x)
    back = codes.float() * scale[..., None]
    normal = (x / scale[..., None]).abs() >= 2.0**-6
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2.0**-4 + 1e-6, f"relative error {rel.max():.4f} > 2^-4 (half a step)"


def test_fp8_zero_vector_gets_scale_one(ex):
    x = _values((4, 2, 16), seed=3)
    x[1, 0] = 0
    codes, scale = ex.quantize_fp8(x)
    assert scale[1, 0] == 1.0, f"scale of an all-zero vector: {scale[1, 0]} (want 1.0)"
    assert (codes[1, 0].float() == 0).all()


# ---- Exercise 10.2: quantize_int4 ----------------------------------------------------------------


def test_int4_shapes_and_packing(ex):
    x = _values((17, 2, 64), seed=4)
    packed, scale, zero = ex.quantize_int4(x)
    assert packed.dtype == torch.uint8 and packed.shape == (17, 2, 32), (
        f"packed: {packed.dtype} {tuple(packed.shape)}, want uint8 (17, 2, 32)")
    for name, t in (("scale", scale), ("zero", zero)):
        assert t.dtype == torch.float16 and t.shape == (17, 2, 2), (
            f"{name}: {t.dtype} {tuple(t.shape)}, want float16 (17, 2, 2)")
    halves = x.unflatten(-1, (2, 32))
    assert_close(zero, halves.amin(-1).double(), rel_tol=1e-3, name="zero = min of each half")
    want = (halves.amax(-1) - halves.amin(-1)) / 15
    assert_close(scale, want.double(), rel_tol=1e-3, name="scale = (max - min) / 15")
    # low nibble: first half's codes; high nibble: second half's (min -> 0, max -> 15)
    low, high = packed & 15, packed >> 4
    first, second = halves[..., 0, :], halves[..., 1, :]
    assert_equal(low[first == first.amin(-1, keepdim=True)].unique(), torch.tensor([0],
                 dtype=torch.uint8), name="low-nibble code of each first-half minimum")
    assert_equal(high[second == second.amax(-1, keepdim=True)].unique(), torch.tensor(
        [15], dtype=torch.uint8), name="high-nibble code of each second-half maximum")


def test_int4_round_trip_is_within_half_a_step(ex):
    x = _values((40, 2, 32), seed=5)
    packed, scale, zero = ex.quantize_int4(x)
    back = ex.dequantize_int4(packed, scale, zero)
    step = scale.float().repeat_interleave(16, dim=-1)
    err = (back - x).abs()
    bound = step / 2 + 2e-3 * x.abs().max()
    worst = (err / bound).max()
    assert (err <= bound).all(), f"error up to {worst:.2f}x half a step: rounding or clamping"


def test_int4_matches_paged_ref_format(ex):
    """Your codes are paged_ref's int4 with group_size = D/2: they go into paged_attention."""
    import paged_ref

    x = _values((9, 2, 64), seed=6)
    ref = paged_ref.quantize(x, "int4_g32")
    packed, scale, zero = ex.quantize_int4(x)
    assert_equal(packed, ref.data, name="packed codes")
    assert_equal(scale, ref.scale, name="scale")
    assert_equal(zero, ref.zero, name="zero")


# ---- Exercise 10.3: dequant_int4_kernel ----------------------------------------------------------


@pytest.mark.parametrize("lens, block_size, head_dim", [([37, 5], 16, 64), ([50], 8, 32),
                                                        ([1, 16], 4, 128)])
def test_dequant_kernel_matches_gather(ex, lens, block_size, head_dim):
    inp = make_paged_inputs(lens, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                            device=DEVICE, seed=len(lens) + head_dim)
    k = inp.quantized(f"int4_g{head_dim // 2}").k_cache
    expected, _, _ = gather_kv(k, k, inp.block_tables, inp.seq_lens, max(lens))
    for b, n in enumerate(lens):
        for head in range(2):
            got = ex.gather_dequant_int4(k.data, k.scale, k.zero, inp.block_tables[b], n, head)
            assert_close(got, expected[b, :n, head].double(), rel_tol=1e-6,
                         name=f"sequence {b} head {head}")


# ---- mutation tests: plant a likely mistake, the tests above must catch it ---------------------

MUTATIONS = {
    "fp8 scale over the wrong dim": ("amax = x.abs().amax(dim=-1)", "amax = x.abs().amax(dim=0)"),
    "fp8 scale for 127 not 448": ("amax / FP8_MAX, torch", "amax / 127.0, torch"),
    "fp8 no zero guard": ("torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))",
                          "amax / FP8_MAX"),
    "int4 floor not round": ("codes = torch.round(", "codes = torch.floor("),
    "int4 scale / 16": ("scale = ((high - low) / 15)", "scale = ((high - low) / 16)"),
    "int4 zero = max": ("zero = low.to(torch.float16)", "zero = high.to(torch.float16)"),
    "int4 nibbles swapped": ("packed = codes[..., 0, :] | (codes[..., 1, :] << 4)",
                             "packed = codes[..., 1, :] | (codes[..., 0, :] << 4)"),
    "int4 codes from the float32 scale": ("/ scale.float()[..., None])",
                                          "/ (high - low)[..., None] * 15)"),
    "kernel forgets the table": ("block = tl.load(table_ptr + offs_t // BLOCK_SIZE, mask=t_mask, "
                                 "other=0).to(tl.int64)",
                                 "block = (offs_t // BLOCK_SIZE).to(tl.int64)"),
    "kernel uses scale 0 for both halves": ("s1 = tl.load(scale_ptr + token_head * 2 + 1,",
                                            "s1 = tl.load(scale_ptr + token_head * 2,"),
    "kernel drops the zero": ("low = z0[:, None] + s0", "low = 0 * z0[:, None] + s0"),
    "kernel high nibble unshifted": ("(packed >> 4).to(tl.float32)",
                                     "(packed & 240).to(tl.float32)"),
}
CHECKS = [test_fp8_codes_and_scales, test_fp8_round_trip_is_within_half_a_step,
          test_fp8_zero_vector_gets_scale_one, test_int4_shapes_and_packing,
          test_int4_round_trip_is_within_half_a_step, test_int4_matches_paged_ref_format,
          test_dequant_kernel_matches_gather]
PARAMS = {"dtype": torch.float32, "lens": [37, 5], "block_size": 16, "head_dim": 64}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_mutation_is_caught(request, tmp_path, name):
    if request.config.getoption("--impl") != "solutions":
        pytest.skip("mutation tests check the tests, against the solutions")
    mutant = load_mutant("ex10_quant", *MUTATIONS[name], tmp_path)
    for check in CHECKS:
        args = [p for p in check.__code__.co_varnames[: check.__code__.co_argcount] if p != "ex"]
        try:
            check(mutant, **{a: PARAMS[a] for a in args})
        except Exception:
            return  # caught (an AssertionError, or the mistake crashed)
    pytest.fail(f"no test caught the planted mistake {name!r}")
