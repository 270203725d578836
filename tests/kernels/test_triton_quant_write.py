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

from paged_ref.kernels.triton import quant_write as triton_quant_write
from paged_ref.memory.storage import PagedKVCache
from paged_ref.quant import write_slots
from tests.conftest import COMPILED, KERNEL_DEVICE
from tests.mutations.mutate import mutant_of

DEVICE = KERNEL_DEVICE
#: "int4_head": one (scale, zero) pair per head, ``int4_g<head_dim>``.
FORMATS = ("fp8", "fp8_token_head", "int4", "int4_head")


def format_name(fmt: str, head_dim: int) -> str:
    return f"int4_g{head_dim}" if fmt == "int4_head" else fmt


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
    n = min(head_dim, grid.numel())
    x[4, 0, :n] = grid[:n]  # e4m3 ties (to even) and edges, at scale 1
    half = torch.arange(head_dim, dtype=torch.float64) % 16 + 0.5  # INT4 ties: min 0.5 ..
    x[5, 0] = half.clamp(max=15.5) - 0.5 * (torch.arange(head_dim) % 32 == 0)  # .. max 15.5
    return x.to(dtype)


def write_both(fmt, dtype, heads, head_dim, seed=0, quant_write=None, *, num_blocks=5,
               block_size=8, num_tokens=24, values=delicate_values):
    caches = [PagedKVCache(1, num_blocks, block_size, heads, head_dim, dtype=dtype,
                           device=DEVICE, kv_format=format_name(fmt, head_dim))
              for _ in range(2)]
    k = values(num_tokens, heads, head_dim, dtype, seed).to(DEVICE)
    v = values(num_tokens, heads, head_dim, dtype, seed + 1).flip(0).to(DEVICE)
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


BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
#: (heads, head_dim, dtype): every dtype with the powers of two; the head dims that are not
#: (80, 96, 120; 6: halves of 3 channels), which the kernel pads with masks as the attention
#: kernels do, one dtype each.
SHAPES = [(h, d, t) for h, d in [(3, 64), (8, 128), (1, 32)] for t in (BF16, F16, F32)] + [
    (2, 80, BF16), (3, 96, F16), (1, 120, F32), (5, 6, BF16)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("heads,head_dim,dtype", SHAPES, ids=str)
def test_same_bytes_as_write_slots(fmt, dtype, heads, head_dim):
    ref, got = write_both(fmt, dtype, heads, head_dim)
    assert_same_bytes(ref, got)


def unbound_key_value(num_tokens, heads, head_dim, dtype, seed):
    """vLLM's test inputs: K (or V) as one of three views of a ``[T, 3, H, D]`` qkv tensor,
    so its token stride is ``3 * H * D``."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_tokens, 3, heads, head_dim, generator=gen).to(dtype)[:, 1]


# vLLM's reshape_and_cache_flash grid (tests/kernels/attention/test_cache.py): 8 heads, head
# sizes 64 / 80 / 256, block sizes 8 / 16 / 32, bfloat16 / float32, 42 // 2 tokens into random
# slots of a pool of 1024 // 2 blocks; every format. Compiled, the whole grid; in the
# interpreter a covering set (each head size, block size, format and dtype; 64 blocks).
VLLM_GRID = [(f, t, d, b) for f in FORMATS for t in (BF16, F32) for d in (64, 80, 256)
             for b in (8, 16, 32)]
if not COMPILED:
    VLLM_GRID = [(f, (BF16, F32)[i % 2], d, b) for i, f in enumerate(FORMATS)
                 for d, b in ((64, 8), (80, 16), (256, 32))]


@pytest.mark.parametrize("fmt,dtype,head_size,block_size", VLLM_GRID, ids=str)
def test_vllm_reshape_and_cache_grid(fmt, dtype, head_size, block_size):
    ref, got = write_both(fmt, dtype, 8, head_size, seed=head_size + block_size,
                          num_blocks=512 if COMPILED else 64, block_size=block_size,
                          num_tokens=21, values=unbound_key_value)
    assert_same_bytes(ref, got)


PLANTED = {
    "round half up": ("return r + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)",
                      "return r + tl.where(frac >= 0.5, 1.0, 0.0)"),
    "no saturation": ("y = tl.minimum(tl.maximum(y, -448.0), 448.0)", "y = y"),
    "+0.0 for negatives": ("return tl.where(snapped == 0.0, v * 0.0, snapped)",
                           "return snapped"),
    "nibbles swapped": (
        "packed = _int4_codes(lo, s_lo, z_lo) | (_int4_codes(hi, s_hi, z_hi) << 4)",
        "packed = _int4_codes(hi, s_hi, z_hi) | (_int4_codes(lo, s_lo, z_lo) << 4)"),
    "zero not rounded to float16": ("return scale.to(tl.float16), low.to(tl.float16)",
                                    "return scale.to(tl.float16), low"),
    "padded lanes in the INT4 minimum": ("low = tl.min(tl.where(ok, x, float(\"inf\")), axis=1)",
                                         "low = tl.min(x, axis=1)"),
    "padded lanes in a head's one group": ("both_ok = tl.join(ok, ok)",
                                           "both_ok = tl.join(ok | True, ok | True)"),
}


@pytest.mark.parametrize("mistake", list(PLANTED)[5:])
def test_planted_padding_mistakes_are_caught(mistake, tmp_path, monkeypatch):
    """head_dim 80 is padded to 64 lanes a half (40 channels): a padded lane that takes part
    in a group's minimum is caught (the constant and the tie rows have a minimum above 0)."""
    mutant = mutant_of(triton_quant_write, [PLANTED[mistake]], tmp_path, monkeypatch)
    fmt = "int4_head" if "group" in mistake else "int4"
    ref, got = write_both(fmt, torch.float32, 3, 80, seed=5, num_blocks=3,
                          quant_write=mutant.quant_write_triton)
    with pytest.raises(AssertionError):
        assert_same_bytes(ref, got)


#: What the hardware does for the kernel where it is compiled: Triton lowers float32 -> e4m3
#: to ``cvt.rn.satfinite.e4m3x2.f32`` on NVIDIA GPUs (sm_89+, the only ones with e4m3), which
#: saturates at 448 by itself; the interpreter's cast does not. So without the clamp the
#: compiled kernel writes the same bytes, and that mutant is a mistake only in the interpreter.
SATURATED_BY_THE_CAST = ("no saturation",)


@pytest.mark.parametrize("mistake", list(PLANTED)[:5])
def test_planted_mistakes_are_caught(mistake, tmp_path, monkeypatch):
    if COMPILED and mistake in SATURATED_BY_THE_CAST:
        pytest.skip("compiled, the e4m3 cast saturates by itself (cvt.rn.satfinite): the same "
                    "bytes without the clamp; the mutant is caught in the interpreter")
    mutant = mutant_of(triton_quant_write, [PLANTED[mistake]], tmp_path, monkeypatch)
    caught = False
    for fmt in FORMATS:
        ref, got = write_both(fmt, torch.float32, 3, 64, quant_write=mutant.quant_write_triton)
        try:
            assert_same_bytes(ref, got)
        except AssertionError:
            caught = True
    assert caught, mistake


#: Issue 36's scenario 11 planted back: a head_dim (or half of one) that is not a power of two
#: used as a block size unpadded (Triton's aranges take powers of two only).
UNPADDED = {
    "head_dim unpadded (fp8)": (("D_PAD=triton.next_power_of_2(head_dim)", "D_PAD=head_dim"),
                                ("fp8", "fp8_token_head")),
    "half a head unpadded (int4)": (
        ("HALF_PAD=triton.next_power_of_2(max(1, head_dim // 2))",
         "HALF_PAD=max(1, head_dim // 2)"), ("int4", "int4_head")),
}


@pytest.mark.parametrize("mistake", UNPADDED)
def test_planted_unpadded_head_dim_is_caught(mistake, tmp_path, monkeypatch):
    edit, formats = UNPADDED[mistake]
    mutant = mutant_of(triton_quant_write, [edit], tmp_path, monkeypatch)
    monkeypatch.setattr(triton_quant_write, "quant_write_triton", mutant.quant_write_triton)
    for fmt in formats:
        for heads, head_dim, dtype in SHAPES[-4:-1]:  # 80, 96, 120
            with pytest.raises(Exception):  # noqa: B017,PT011 -- any failure is the catch
                test_same_bytes_as_write_slots(fmt, dtype, heads, head_dim)


def test_the_kernel_writes_out_the_quantisers_constants():
    """The kernel has e4m3's 448 and INT4's 15 as literals: they must stay paged_ref.quant's."""
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


@pytest.mark.gpu
def test_engine_decode_step_on_int4_launches_few_kernels():
    """The reason for the kernel: an INT4 decode step had 52 kernels a layer (9.5 plain)."""
    from paged_bench.engine import build_model, decode_step
    from paged_ref.engine import Engine

    model = build_model("smollm2-135m")
    engine = Engine(model, num_blocks=600, block_size=16, max_num_seqs=32, kv_format="int4")
    engine.generate([[5] * 40] * 32, 2, ignore_eos=True)
    step = decode_step(engine, model, 32, 200, 4000.0)
    assert step["kernels_per_layer"] < 15, step["kernels_by_name"]
