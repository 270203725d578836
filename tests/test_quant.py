"""Quantised KV formats (paged_ref.quant): what each code can hold, the round trip, the
quantising write path of PagedKVCache, and clear errors for bad combinations."""

from __future__ import annotations

import pytest
import torch

from paged_course.checks import assert_close, assert_equal
from paged_ref import KVFormat, PagedKVCache, QuantizedKV, dequantize, quantize
from paged_ref.quant import FP8_MAX, pack_int4, unpack_int4

FORMATS = ["fp8", "fp8_token_head", "int4", "int4_g64"]


def _values(shape, seed, outliers=True):
    """Random K-like values: unit normal, one outlier channel of ~20x (as real K caches)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    if outliers:
        x[..., 3] *= 20
    return x


# ---- the formats ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
def test_parse_and_name_round_trip(name):
    fmt = KVFormat.parse(name)
    assert fmt.name == name and KVFormat.parse(fmt) is fmt


def test_bytes_per_token_head():
    assert KVFormat.parse("fp8").bytes_per_token_head(128) == 128
    assert KVFormat.parse("fp8_token_head").bytes_per_token_head(128) == 132
    assert KVFormat.parse("int4").bytes_per_token_head(128) == 64 + 2 * 4  # two (scale, zero)
    assert KVFormat.parse("int4_g128").bytes_per_token_head(128) == 64 + 4


def test_fp8_round_trip_error_is_half_a_step():
    """e4m3 has 3 mantissa bits: a normal value is off by at most 2^-4 of itself."""
    x = _values((64, 4, 64), seed=1)
    for per in ("tensor", "token_head"):
        qkv = quantize(x, KVFormat.fp8(per))
        back = dequantize(qkv)
        scale = qkv.scale if qkv.scale.dim() == 0 else qkv.scale[..., None]
        normal = (x / scale).abs() >= 2.0**-6  # e4m3's smallest normal
        rel = ((back - x).abs() / x.abs())[normal]
        assert rel.max() <= 2.0**-4 + 1e-7, f"per={per}: max relative error {rel.max():.3g}"


def test_fp8_per_tensor_scale_saturates_instead_of_nan():
    x = torch.tensor([[1.0, -3.0, 1000.0, -2000.0]])
    qkv = quantize(x, "fp8", scale=1.0)
    back = dequantize(qkv)
    assert_equal(back, torch.tensor([[1.0, -3.0, FP8_MAX, -FP8_MAX]]), name="saturated")


@pytest.mark.parametrize("group", [16, 32])
def test_int4_round_trip_error_is_half_a_step(group):
    x = _values((40, 2, 32), seed=2)
    qkv = quantize(x, KVFormat.int4(group))
    back = dequantize(qkv)
    step = qkv.scale.float().repeat_interleave(group, dim=-1)
    # half a step, plus float16 rounding of zero (the group's minimum)
    slack = 1e-3 * x.abs().unflatten(-1, (-1, group)).amax(-1).repeat_interleave(group, -1)
    assert ((back - x).abs() <= step / 2 + slack).all()
    codes = unpack_int4(qkv.data)
    assert codes.max() <= 15 and codes.dtype == torch.uint8
    # the group's min and max are hit (asymmetric code uses the whole range)
    g = codes.unflatten(-1, (-1, group))
    assert (g.amin(-1) == 0).all() and (g.amax(-1) >= 14).all()


def test_int4_packing_layout():
    """Byte i holds channel i (low nibble) and channel i + D/2 (high nibble)."""
    gen = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (5, 3, 8), generator=gen, dtype=torch.uint8)
    packed = pack_int4(codes)
    assert packed.shape == (5, 3, 4) and packed.dtype == torch.uint8
    assert_equal(packed & 0xF, codes[..., :4], name="low nibbles")
    assert_equal(packed >> 4, codes[..., 4:], name="high nibbles")
    assert_equal(unpack_int4(packed), codes, name="unpack(pack(codes))")


def test_constant_group_decodes_exactly():
    x = torch.full((3, 2, 16), 0.375)
    for name in ("int4_g8", "int4_g16", "fp8_token_head"):
        assert_equal(dequantize(quantize(x, name)), x, name=name)


# ---- the write path ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cache_write_quantises_and_gather_dequantises(name, dtype):
    fmt = KVFormat.parse(name)
    scale = dict(scale=0.05) if fmt.scale_per == "tensor" else {}
    cache = PagedKVCache(2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=64, dtype=dtype,
                         kv_format=name, **({"k_scale": 0.05, "v_scale": 0.02} if scale else {}))
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(7, 2, 64, generator=gen).to(dtype)
    v = torch.randn(7, 2, 64, generator=gen).to(dtype)
    table = [5, 0]
    cache.write(1, k, v, [20, 21, 22, 23, 0, 1, 2])
    k_back, v_back = cache.gather(1, table, 7)
    assert k_back.dtype == dtype and k_back.shape == (7, 2, 64)
    assert_equal(k_back, dequantize(quantize(k, fmt, **scale), dtype), name="gathered k")
    k_cache, v_cache = cache.layer(1)
    assert isinstance(k_cache, QuantizedKV) and k_cache.format == fmt
    assert cache.nbytes == sum(t.nbytes for c in cache.k_caches + cache.v_caches
                               for t in c.tensors())
    assert cache.bytes_per_token == int(2 * 2 * 2 * fmt.bytes_per_token_head(64))
    # layer 0 untouched
    assert dequantize(cache.layer(0)[0]).abs().max() == 0


def test_cache_bad_combinations():
    with pytest.raises(ValueError, match="kv_format"):
        PagedKVCache(1, 4, 4, 2, 64, kv_format="fp4")
    with pytest.raises(TypeError, match="kv_format"):
        PagedKVCache(1, 4, 4, 2, 64, kv_format=8)
    with pytest.raises(ValueError, match="k_scale"):
        PagedKVCache(1, 4, 4, 2, 64, kv_format="fp8", k_scale=-1.0)
    with pytest.raises(ValueError, match="k_scale/v_scale"):
        PagedKVCache(1, 4, 4, 2, 64, kv_format="int4", v_scale=0.1)
    with pytest.raises(ValueError, match="group_size"):
        PagedKVCache(1, 4, 4, 2, 64, kv_format="int4_g16")
    cache = PagedKVCache(1, 4, 4, 2, 64, kv_format="int4")
    with pytest.raises(TypeError, match="k dtype"):
        cache.write(0, torch.randn(1, 2, 64), torch.randn(1, 2, 64), [0])


# ---- QuantizedKV checks its parts ---------------------------------------------------------------


def test_quantized_kv_names_the_bad_part():
    x = _values((4, 2, 2, 32), seed=5, outliers=False)
    good = quantize(x, "int4_g16")
    with pytest.raises(TypeError, match="data"):
        QuantizedKV(good.data.to(torch.int8), good.scale, good.zero, good.format)
    with pytest.raises(ValueError, match="scale .* shape"):
        QuantizedKV(good.data, good.scale[..., :1], good.zero, good.format)
    with pytest.raises(TypeError, match="zero"):
        QuantizedKV(good.data, good.scale, None, good.format)
    with pytest.raises(TypeError, match="scale.*float16"):
        QuantizedKV(good.data, good.scale.float(), good.zero, good.format)
    fp8 = quantize(x, "fp8_token_head")
    with pytest.raises(ValueError, match="zero"):
        QuantizedKV(fp8.data, fp8.scale, fp8.scale, fp8.format)
    with pytest.raises(ValueError, match="scale"):
        QuantizedKV(fp8.data, fp8.scale[0], None, fp8.format)
    with pytest.raises(TypeError, match="format"):
        QuantizedKV(fp8.data, fp8.scale, None, "fp8_token_head")
    with pytest.raises(ValueError, match="scale="):
        quantize(x, "int4_g16", scale=1.0)
    with pytest.raises(TypeError, match="x must be"):
        quantize(x.to(torch.int32), "fp8")
    with pytest.raises(ValueError, match="group_size"):
        KVFormat.int4(-1)
    assert KVFormat.int4().group(64) == 32 and KVFormat.parse("int4_g128").group(64) == 128
    with pytest.raises(ValueError, match="scale_per"):
        KVFormat("fp8", "group")


def test_dequantized_cache_matches_its_reference():
    """The float64 reference of a quantised cache is the reference of its de-quantised values."""
    from paged_course.testing import make_paged_inputs

    inp = make_paged_inputs([9, 20], block_size=8, seed=6)
    for name in FORMATS:
        qin = inp.quantized(name)
        plain = type(inp)(inp.q, dequantize(qin.k_cache), dequantize(qin.v_cache),
                          inp.block_tables, inp.seq_lens)
        assert_close(qin.reference(), plain.reference(), rel_tol=1e-12, name=name)


@pytest.mark.parametrize("name", ["fp8", "int4_g32"])
def test_cache_copy_blocks_copies_codes_and_scales(name):
    cache = PagedKVCache(2, num_blocks=5, block_size=4, num_kv_heads=2, head_dim=64,
                         kv_format=name, dtype=torch.float32)
    gen = torch.Generator().manual_seed(7)
    for layer in range(2):
        k, v = torch.randn(2, 8, 2, 64, generator=gen)
        cache.write(layer, k, v, list(range(4, 12)))  # blocks 1 and 2
    before = [cache.gather(layer, [1, 2], 8) for layer in range(2)]
    cache.copy_blocks([(1, 3), (2, 4)])
    for layer in range(2):
        after = cache.gather(layer, [3, 4], 8)
        for got, want in zip(after, before[layer], strict=True):
            assert_equal(got, want, name=f"layer {layer} copied block")


def test_cache_host_tier_is_for_plain_caches():
    with pytest.raises(ValueError, match="num_host_blocks"):
        PagedKVCache(1, 4, 4, 2, 64, kv_format="fp8", num_host_blocks=2)
