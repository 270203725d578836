"""paged_attention over quantised caches: every backend against the float64 reference of the
de-quantised cache, and clear errors for bad combinations.

A covering set of cases (each format with several block sizes, head dims, GQA ratios,
dtypes of q, NaN in unused slots, zero-length rows), small because the Triton backends run in
Triton's interpreter on a CPU. The split kernel is also forced to cut sequences into chunks.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from paged_course.checks import assert_close, assert_equal
from paged_course.testing import make_paged_inputs
from paged_ref import QuantizedKV, paged_attention, quantize
from paged_ref.kernels.triton.split import SplitPlan, paged_attention_split
from tests.conftest import KERNEL_DEVICE

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (id, format, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, q dtype, poison)
CASES = [
    ("fp8_bs16_gqa4", "fp8", [1, 15, 33], 8, 2, 64, 16, F32, "large"),
    ("fp8_bs8_d80_bf16", "fp8", [9, 0, 24], 4, 4, 80, 8, BF16, "nan"),
    ("fp8th_bs16_f16", "fp8_token_head", [17, 40], 8, 1, 64, 16, F16, "nan"),
    ("fp8th_bs1_d128", "fp8_token_head", [3, 7], 4, 2, 128, 1, F32, "large"),
    ("int4_bs16_gqa4", "int4", [31, 16, 0], 8, 2, 64, 16, F32, "nan"),
    ("int4_bs8_bf16", "int4", [5, 26], 4, 1, 64, 8, BF16, "large"),
    ("int4g64_bs32_f16", "int4_g64", [40, 1], 8, 8, 64, 32, F16, "large"),
    ("int4g128_d128_bs16", "int4_g128", [20, 49], 4, 2, 128, 16, F32, "nan"),
]
BACKENDS = ["torch", "triton", "triton_split"]
#: Where the Triton kernels take tensors here: CUDA on a GPU (compiled), the CPU otherwise.
DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)


def _inputs(case_id, fmt, seq_lens, hq, hkv, d, bs, dtype, poison):
    inp = make_paged_inputs(seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                            block_size=bs, dtype=dtype, poison=poison,
                            seed=zlib.crc32(case_id.encode()), device=DEVICE)
    return inp.quantized(fmt)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_float64_of_dequantised_cache(backend, case):
    inp = _inputs(*case)
    out = paged_attention(*inp.args(), backend=backend)
    assert out.dtype == inp.q.dtype and out.shape == inp.q.shape
    assert_close(out, inp.reference(), name=f"{backend} {case[1]} output")
    for b, n in enumerate(case[2]):
        if n == 0:
            assert_equal(out[b].float().cpu(), torch.zeros(out.shape[1:]), name=f"row {b}")


@pytest.mark.parametrize("fmt", ["fp8", "fp8_token_head", "int4"])
def test_split_kernel_in_chunks(fmt):
    """Chunks of 16 tokens (not a multiple of the block size 12): the lse merge of
    de-quantised partials."""
    inp = make_paged_inputs([50, 3, 31], num_q_heads=8, num_kv_heads=2, head_dim=64,
                            block_size=12, seed=21, device=DEVICE).quantized(fmt)
    out = paged_attention_split(*inp.args(), plan=SplitPlan(chunk_size=16, num_chunks=4))
    assert_close(out, inp.reference(), name=f"split {fmt}")


def test_quantisation_error_vs_plain_cache_is_small():
    """Against the unquantised cache the error is the format's, not a bug's: FP8 a few %,
    INT4 ~10 % on unit-normal K/V (the committed table has the numbers)."""
    plain = make_paged_inputs([64, 40], num_q_heads=8, num_kv_heads=2, head_dim=64, seed=22)
    ref = plain.reference()
    for fmt, bound in (("fp8", 0.06), ("fp8_token_head", 0.06), ("int4", 0.2)):
        out = paged_attention(*plain.quantized(fmt).args(), backend="torch")
        assert_close(out, ref, rel_tol=bound, name=f"{fmt} vs plain")


# ---- bad combinations -------------------------------------------------------------------------


def _pair(fmt="int4"):
    inp = make_paged_inputs([5, 9], block_size=4, seed=23)
    return inp, inp.quantized(fmt)


def test_bare_codes_without_scales_is_a_type_error():
    inp, qi = _pair("fp8")
    with pytest.raises(TypeError, match="k_cache .*scales"):
        paged_attention(inp.q, qi.k_cache.data, qi.v_cache, inp.block_tables, inp.seq_lens)
    with pytest.raises(TypeError, match="v_cache .*scales"):
        paged_attention(inp.q, qi.k_cache, qi.v_cache.data, inp.block_tables, inp.seq_lens)


def test_mixed_plain_and_quantised_is_a_type_error():
    inp, qi = _pair()
    with pytest.raises(TypeError, match="v_cache must be a QuantizedKV"):
        paged_attention(inp.q, qi.k_cache, inp.v_cache, inp.block_tables, inp.seq_lens)
    with pytest.raises(TypeError, match="k_cache must be a QuantizedKV"):
        paged_attention(inp.q, inp.k_cache, qi.v_cache, inp.block_tables, inp.seq_lens)
    other = quantize(inp.v_cache, "int4_g64")
    with pytest.raises(TypeError, match="v_cache format"):
        paged_attention(inp.q, qi.k_cache, other, inp.block_tables, inp.seq_lens)


def test_bad_q_and_shapes_with_quantised_cache():
    inp, qi = _pair()
    with pytest.raises(TypeError, match="q dtype"):
        paged_attention(inp.q.to(torch.int32), *qi.args()[1:])
    with pytest.raises(ValueError, match="q head_dim"):
        paged_attention(inp.q[..., :32].contiguous(), *qi.args()[1:])
    k = qi.k_cache
    squeezed = QuantizedKV(k.data[0], k.scale[0], k.zero[0], k.format)
    with pytest.raises(ValueError, match="k_cache must have 4 dimensions"):
        paged_attention(inp.q, squeezed, squeezed, inp.block_tables, inp.seq_lens)
    strided = QuantizedKV(k.data[:, ::2], k.scale[:, ::2], k.zero[:, ::2], k.format)
    with pytest.raises(ValueError, match="contiguous"):
        paged_attention(inp.q, strided, strided, inp.block_tables, inp.seq_lens)


@pytest.mark.parametrize("backend", ["triton", "triton_split"])
def test_int4_kernels_need_a_power_of_two_head_dim(backend):
    inp = make_paged_inputs([5], head_dim=80, block_size=4, seed=24,
                            device=DEVICE).quantized("int4_g80")
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention(*inp.args(), backend=backend)
    out = paged_attention(*inp.args(), backend="torch")  # the torch backend reads any
    assert_close(out, inp.reference(), name="torch int4 d80")


def test_cache_layer_goes_straight_into_paged_attention():
    from paged_ref import KVCacheManager, PagedKVCache

    manager = KVCacheManager(num_blocks=8, block_size=4)
    cache = PagedKVCache(1, 8, 4, 2, 64, dtype=F32, kv_format="fp8_token_head", device=DEVICE)
    gen = torch.Generator().manual_seed(25)
    manager.add_sequence("a", 10)
    k, v = torch.randn(2, 10, 2, 64, generator=gen).to(DEVICE)
    cache.write(0, k, v, [manager.block_table("a")[t // 4] * 4 + t % 4 for t in range(10)])
    q = torch.randn(1, 4, 64, generator=gen).to(DEVICE)
    tables = torch.tensor([manager.block_table("a")], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([10], dtype=torch.int32, device=DEVICE)
    out = paged_attention(q, *cache.layer(0), tables, lens, backend="triton")
    k_back, v_back = cache.gather(0, manager.block_table("a"), 10)  # de-quantised, token order
    k_back, v_back = k_back.double().cpu(), v_back.double().cpu()
    scores = torch.einsum("hd,thd->ht", q[0].double().cpu(), k_back.repeat_interleave(2, 1))
    probs = torch.softmax(scores / 8, dim=-1)  # head_dim 64: scale 1/8
    expected = torch.einsum("ht,thd->hd", probs, v_back.repeat_interleave(2, 1))
    assert_close(out[0], expected, name="attention over cache.layer(0)")


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_planned_call_with_quantised_cache(fmt):
    """plan_decode with q's dtype plans a quantised cache like any other (no read-back)."""
    from paged_ref import plan_decode

    inp = make_paged_inputs([30, 7], num_q_heads=8, num_kv_heads=2, head_dim=64, block_size=8,
                            dtype=BF16, seed=26, device=DEVICE).quantized(fmt)
    plan = plan_decode(inp.seq_lens.tolist(), num_q_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=8, dtype=BF16, device=DEVICE, backend="triton")
    out = paged_attention(*inp.args(), plan=plan)
    assert_close(out, inp.reference(), name=f"planned {fmt}")
