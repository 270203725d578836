"""The runner's fused ops (paged_ref.models.fused) against transformers' own modules and a
float64 reference: ``backend="torch"`` is transformers' arithmetic (equal bit for bit),
``backend="triton"`` runs the kernels of paged_ref.kernels.triton.fused (Triton's interpreter on
a CPU, compiled on a GPU) on tiny shapes that are not powers of two (hidden 576, 9 / 3 heads,
head_dim 80)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from transformers import LlamaConfig  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402
from transformers.models.llama.modeling_llama import (  # noqa: E402
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
)

from paged_course.checks import assert_close  # noqa: E402
from paged_ref import _device  # noqa: E402
from paged_ref.models import fused  # noqa: E402
from tests.conftest import KERNEL_DEVICE

DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)
DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def exact_rounding(backend: str, dtype: torch.dtype) -> bool:
    """Whether a rounding to ``dtype`` is torch's (to nearest even): Triton's interpreter
    truncates float32 to bfloat16, the compiled kernels round to nearest."""
    return backend == "torch" or dtype != torch.bfloat16 or not _device.INTERPRET


def randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(DEVICE, dtype)


# ---- add + RMS norm ----------------------------------------------------------------------------


def hf_norm(hidden: int, weight: torch.Tensor, eps: float) -> LlamaRMSNorm:
    norm = LlamaRMSNorm(hidden, eps=eps).to(DEVICE, weight.dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    return norm


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden, scale, with_delta", [
    (576, 1.0, True),    # SmolLM2's hidden size: not a power of two
    (64, 1e-3, True),    # tiny activations: eps matters as much as the variance
    (96, 1.0, False),    # the first layer's norm: nothing to add
])
def test_add_rms_norm_matches_llama_rmsnorm(backend, dtype, hidden, scale, with_delta):
    eps = 1e-5
    h = randn(5, hidden, dtype=dtype, seed=1, scale=scale)
    delta = randn(5, hidden, dtype=dtype, seed=2, scale=scale) if with_delta else None
    weight = randn(hidden, dtype=dtype, seed=3)
    h_new, x = fused.add_rms_norm(h, delta, weight, eps, backend=backend)
    h_ref = h + delta if with_delta else h
    with torch.no_grad():
        x_ref = hf_norm(hidden, weight, eps)(h_ref)
    if exact_rounding(backend, dtype):
        assert torch.equal(h_new, h_ref), "the residual add rounds as torch's does"
    assert_close(h_new, h.double() + (0 if delta is None else delta.double()), name="h + delta")
    assert x.dtype == x_ref.dtype and x.shape == x_ref.shape
    h64 = h_ref.double()
    x64 = weight.double() * h64 * torch.rsqrt(h64.pow(2).mean(-1, keepdim=True) + eps)
    assert_close(x, x64, name="rms norm vs float64")
    if backend == "torch":
        assert torch.equal(x, x_ref)
    else:
        assert_close(x, x_ref.double(), name="rms norm vs LlamaRMSNorm")


# ---- rotary + K/V write ------------------------------------------------------------------------


def rope_case(num_q_heads, num_kv_heads, head_dim, dtype, num_tokens=6, num_slots=40, seed=0):
    """Fused projection output, cos/sin of LlamaRotaryEmbedding at shuffled far positions,
    poisoned caches and distinct shuffled slots."""
    cfg = LlamaConfig(hidden_size=num_q_heads * head_dim, num_attention_heads=num_q_heads,
                      num_key_value_heads=num_kv_heads, head_dim=head_dim, rope_theta=10000.0)
    rotary = LlamaRotaryEmbedding(cfg).to(DEVICE)
    gen = torch.Generator().manual_seed(seed)
    positions = torch.randperm(3000, generator=gen)[:num_tokens].to(DEVICE)
    qkv = randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, seed=seed)
    cos, sin = rotary(qkv, positions[None])
    caches = [torch.full((num_slots // 4, 4, num_kv_heads, head_dim), 1e4, dtype=dtype,
                         device=DEVICE) for _ in range(2)]
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens].to(DEVICE)
    return qkv, cos[0], sin[0], caches, slots


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 80), (2, 2, 16)])
def test_rope_write_matches_apply_rotary_pos_emb(backend, dtype, heads):
    hq, hkv, d = heads
    qkv, cos, sin, (k_cache, v_cache), slots = rope_case(hq, hkv, d, dtype)
    before = k_cache.clone()
    q = fused.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, hq, backend=backend)
    q_in, k_in, v_in = qkv.view(len(slots), -1, d).split([hq, hkv, hkv], dim=1)
    q_ref, k_ref = apply_rotary_pos_emb(q_in, k_in, cos, sin, unsqueeze_dim=1)
    k_rows, v_rows = (c.view(-1, hkv, d)[slots] for c in (k_cache, v_cache))
    assert q.shape == (len(slots), hq, d) and q.dtype == dtype
    assert torch.equal(v_rows, v_in), "v is stored as it is"
    if backend == "torch":
        assert torch.equal(q, q_ref) and torch.equal(k_rows, k_ref)
    else:
        assert_close(q, q_ref.double(), name="q vs apply_rotary_pos_emb")
        assert_close(k_rows, k_ref.double(), name="k vs apply_rotary_pos_emb")
    # float64: x * cos + rotate_half(x) * sin, rotate_half(x) = (-x_hi, x_lo)
    x = torch.cat([q_in, k_in], dim=1).double()
    lo, hi = x.chunk(2, dim=-1)
    x64 = x * cos.double()[:, None] + torch.cat([-hi, lo], dim=-1) * sin.double()[:, None]
    assert_close(torch.cat([q, k_rows], dim=1), x64, name="rotary vs float64")
    untouched = torch.ones(k_cache.numel() // (hkv * d), dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(k_cache.view(-1, hkv, d)[untouched], before.view(-1, hkv, d)[untouched])
    assert torch.equal(v_cache.view(-1, hkv, d)[untouched], before.view(-1, hkv, d)[untouched])


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_rope_write_into_a_quantised_cache(fmt):
    """The Triton path rotates into a buffer and quantises it in as the torch path does."""
    from paged_ref.memory.storage import PagedKVCache

    qkv, cos, sin, _, slots = rope_case(4, 2, 32, torch.float32, seed=5)
    out = {}
    for backend in ("torch", "triton"):
        cache = PagedKVCache(1, 10, 4, 2, 32, dtype=torch.float32, device=DEVICE, kv_format=fmt)
        k_cache, v_cache = cache.k_caches[0], cache.v_caches[0]
        q = fused.rope_write_kv(qkv, cos, sin, k_cache, v_cache, slots, 4, backend=backend)
        out[backend] = (q, k_cache.data.clone(), v_cache.data.clone())
    assert_close(out["triton"][0], out["torch"][0].double())
    assert torch.equal(out["triton"][2], out["torch"][2]), "v codes"
    same = (out["triton"][1] == out["torch"][1]).float().mean().item()
    assert same > 0.99, f"k codes: only {same:.1%} equal"


# ---- silu(gate) * up ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 1536])  # masked in one program; two programs a row
def test_silu_mul_matches_llama_mlp_activation(backend, dtype, inter):
    gate_up = randn(3, 2 * inter, dtype=dtype, seed=7, scale=3.0)
    got = fused.silu_mul(gate_up, backend=backend)
    gate, up = gate_up[:, :inter], gate_up[:, inter:]
    expected = ACT2FN["silu"](gate) * up  # LlamaMLP: act_fn(gate_proj(x)) * up_proj(x)
    g64 = gate.double()
    assert_close(got, g64 * torch.sigmoid(g64) * up.double(), name="silu * up vs float64")
    if backend == "torch":
        assert torch.equal(got, expected)
    else:
        assert_close(got, expected.double(), name="silu * up vs transformers")


# ---- fused projections, backends ---------------------------------------------------------------


@pytest.mark.parametrize("bias", [False, True])
def test_fuse_linears_is_the_projections_side_by_side(bias):
    torch.manual_seed(0)
    linears = [torch.nn.Linear(24, n, bias=bias, dtype=torch.float64) for n in (16, 8, 8)]
    x = torch.randn(5, 24, dtype=torch.float64)
    weight, b = fused.fuse_linears(*linears)
    assert (b is not None) == bias and not weight.requires_grad
    expected = torch.cat([m(x) for m in linears], dim=-1)
    assert_close(torch.nn.functional.linear(x, weight, b), expected.detach())


def test_fuse_linears_refuses_mixed_biases():
    with pytest.raises(ValueError, match="bias"):
        fused.fuse_linears(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4, bias=False))


def test_bad_backend_names_the_argument():
    with pytest.raises(ValueError, match="fused_backend"):
        fused.choose_backend("cuda", torch.device("cpu"))
    assert fused.choose_backend("auto", torch.device("cpu")) == "torch"
