"""paged_ref.kernels.triton.quant_write: the engine's quantising K/V write in one Triton kernel
(the interpreter here; on a GPU, compiled) writes the very bytes ``write_slots`` writes, for
every format, input dtype, head count and head_dim, including the values where rounding is
delicate: e4m3 and INT4 ties, saturation, subnormals, negative zero, all-zero and constant
heads. Planted mistakes in the rounding, the clamp, the sign of zero and the nibble order are
each caught."""

from __future__ import annotations

import inspect

import pytest
import torch

from paged_ref import _device
from paged_ref.kernels.triton import quant_write as triton_quant_write
from paged_ref.memory.storage import PagedKVCache
from paged_ref.quant import write_slots
from tests.mutations.mutate import mutant_of

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FORMATS = ("fp8", "fp8_token_head", "int4", "int4_g64")


def delicate_values(num_tokens, heads, head_dim, dtype, seed):
    """K-like values over six decades, with rows built to land on rounding edges."""
    gen = torch.Generator().manual_seed(seed)
    mags = torch.logspace(-4, 1.5, num_tokens, dtype=torch.float64)[:, None, None]
    x = torch.randn(num_tokens, heads, head_dim, generator=gen, dtype=torch.float64) * mags
    x[0] = 0.0  # an all-zero token: scale 1 (fp8 per token-head), 2^-24 (INT4)
    x[1, 0] = 2.5  # a constant head
    x[2, 0, : head_dim // 4] = 1000.0  # past 448: saturates
    x[3, 0] = -1e-5  # negative values that round to zero: -0.0 codes
    grid = torch.tensor([1.0625, 1.1875, 0.5 + 2**-10, 3.0 * 2**-10, 14.5, 240.0, 448.0])
    x[4, 0, : grid.numel()] = grid  # e4m3 ties (to even) and edges, at scale 1
    half = torch.arange(head_dim, dtype=torch.float64) % 16 + 0.5  # INT4 ties: min 0.5 ..
    x[5, 0] = half.clamp(max=15.5) - 0.5 * (torch.arange(head_dim) % 32 == 0)  # .. max 15.5
    return x.to(dtype)


def write_both(fmt, dtype, heads, head_dim, seed=0, quant_write=None):
    num_blocks, block_size, num_tokens = 5, 8, 24
    caches = [PagedKVCache(1, num_blocks, block_size, heads, head_dim, dtype=dtype,
                           device=DEVICE, kv_format=fmt) for _ in range(2)]
    k = delicate_values(num_tokens, heads, head_dim, dtype, seed).to(DEVICE)
    v = delicate_values(num_tokens, heads, head_dim, dtype, seed + 1).flip(0).to(DEVICE)
    slots = torch.randperm(num_blocks * block_size, generator=torch.Generator().manual_seed(
        seed))[:num_tokens].to(DEVICE)
    (k1, v1), (k2, v2) = caches[0].layer(0), caches[1].layer(0)
    write_slots(k1, k, slots)
    write_slots(v1, v, slots)
    (quant_write or triton_quant_write.quant_write_triton)(k2, v2, k, v, slots)
    return (k1, v1), (k2, v2)


def assert_same_bytes(ref, got):
    for a, b in zip(ref, got, strict=True):
        for name in ("data", "scale", "zero"):
            x, y = getattr(a, name), getattr(b, name)
            if x is None:
                assert y is None
                continue
            x, y = x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8)
            assert torch.equal(x, y), name


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,head_dim", [(3, 64), (8, 128), (1, 32)])
def test_same_bytes_as_write_slots(fmt, dtype, heads, head_dim):
    if fmt == "int4_g64" and head_dim < 64:
        pytest.skip("a group of 64 channels needs head_dim >= 64")
    ref, got = write_both(fmt, dtype, heads, head_dim)
    assert_same_bytes(ref, got)


PLANTED = {
    "round half up": ("return r + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)",
                      "return r + tl.where(frac >= 0.5, 1.0, 0.0)"),
    "no saturation": ("y = tl.minimum(tl.maximum(y, -448.0), 448.0)", "y = y"),
    "+0.0 for negatives": ("return tl.where(snapped == 0.0, v * 0.0, snapped)",
                           "return snapped"),
    "nibbles swapped": ("packed = lo_half | (hi_half << 4)", "packed = hi_half | (lo_half << 4)"),
    "zero not rounded to float16": ("g - zero16.to(tl.float32)[:, :, None]",
                                    "g - low[:, :, None]"),
}


@pytest.mark.parametrize("mistake", PLANTED)
def test_planted_mistakes_are_caught(mistake, tmp_path, monkeypatch):
    mutant = mutant_of(triton_quant_write, [PLANTED[mistake]], tmp_path, monkeypatch)
    caught = False
    for fmt in FORMATS:
        ref, got = write_both(fmt, torch.float32, 3, 64, quant_write=mutant.quant_write_triton)
        try:
            assert_same_bytes(ref, got)
        except AssertionError:
            caught = True
    assert caught, mistake


def test_the_kernel_writes_out_the_quantisers_constants():
    """The kernel has e4m3's 448 and INT4's 15 as literals: they must stay quant.py's."""
    from paged_ref.quant import FP8_MAX, INT4_MAX

    source = inspect.getsource(triton_quant_write)
    assert FP8_MAX == 448.0 and INT4_MAX == 15
    assert "448.0" in source and "15.0" in source


def test_layouts_it_cannot_write_are_errors():
    cache = PagedKVCache(1, 4, 8, 2, 32, dtype=torch.float16, device=DEVICE, kv_format="int4")
    k_cache, v_cache = cache.layer(0)
    k = torch.randn(3, 2, 32, dtype=torch.float16, device=DEVICE)
    slots = torch.arange(3, device=DEVICE)
    strided = torch.randn(3, 32, 2, dtype=torch.float16, device=DEVICE).transpose(1, 2)
    with pytest.raises(ValueError, match="last dim contiguous"):
        triton_quant_write.quant_write_triton(k_cache, v_cache, strided, k, slots)
    other = PagedKVCache(1, 4, 8, 2, 32, dtype=torch.float16, device=DEVICE, kv_format="fp8")
    with pytest.raises(ValueError, match="one format"):
        triton_quant_write.quant_write_triton(k_cache, other.layer(0)[1], k, k, slots)


@pytest.mark.skipif(DEVICE != "cuda" or _device.INTERPRET, reason="needs a CUDA GPU")
def test_engine_decode_step_on_int4_launches_few_kernels():
    """The reason for the kernel: an INT4 decode step had 52 kernels a layer (9.5 plain)."""
    from paged_bench.engine import build_model, decode_step
    from paged_ref.engine import Engine

    model = build_model("smollm2-135m")
    engine = Engine(model, num_blocks=600, block_size=16, max_num_seqs=32, kv_format="int4")
    engine.generate([[5] * 40] * 32, 2, ignore_eos=True)
    step = decode_step(engine, model, 32, 200, 4000.0)
    assert step["kernels_per_layer"] < 15, step["kernels_by_name"]
