"""Fused Triton kernels for the engine's layer step (:mod:`paged_ref.models.fused`).

A decode step moves little data per kernel, so its time is mostly the number of kernels. A
Hugging Face Llama layer launches 41 in bf16 (each RMS norm 8 elementwise ops, rotary 5 per
tensor, ...); these three kernels, with fused q/k/v and gate/up matrices, bring it to 10:

* :func:`add_rms_norm_kernel`  ``h = h + delta; x = rmsnorm(h) * weight``: the residual add of
  the previous sub-block and the next norm, one read of each row;
* :func:`rope_write_kernel`    rotary embedding of q and k, straight from the fused q/k/v
  projection's output, K and V stored into their paged-cache slots;
* :func:`silu_mul_kernel`      ``silu(gate) * up`` from the fused gate/up projection's output.

The arithmetic is Hugging Face's, casts included, so a float32 model gives the same numbers up
to rounding order and a bf16 model rounds where transformers rounds: ``LlamaRMSNorm`` upcasts
to float32, computes ``h * rsqrt(mean(h^2) + eps)``, casts back to the model's dtype, then
multiplies by the weight; ``apply_rotary_pos_emb`` rounds each product ``q * cos`` and
``rotate_half(q) * sin`` to the model's dtype before adding; ``act_fn(gate) * up`` rounds the
activation first. Each kernel computes in float32 and rounds with :func:`_round` at those
points.

All shapes are compile-time constants (``tl.constexpr``) and every block is a power of two,
masked for sizes that are not (hidden 576, 9 query heads, head_dim 80, ...). No kernel reads a
value back to the host or allocates, so they run inside CUDA graphs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_ref.kernels.triton.launch import launch


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """``x`` (float32) rounded to ``DTYPE`` and back: what storing a torch op's result does."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def add_rms_norm_kernel(h_ptr, delta_ptr, weight_ptr, h_out_ptr, x_out_ptr, eps,
                        HIDDEN: tl.constexpr, BLOCK: tl.constexpr, HAS_DELTA: tl.constexpr):
    """Grid (num_tokens,): one row of ``HIDDEN`` values.

    ``h_out = h + delta`` (rounded to h's dtype; skipped without ``HAS_DELTA``, where h_out is
    not written) and ``x_out = weight * (h_out * rsqrt(mean(h_out^2) + eps))``.
    """
    row = tl.program_id(0).to(tl.int64) * HIDDEN
    offs = tl.arange(0, BLOCK)
    ok = offs < HIDDEN
    dtype = h_ptr.dtype.element_ty
    h = tl.load(h_ptr + row + offs, mask=ok, other=0.0).to(tl.float32)
    if HAS_DELTA:
        delta = tl.load(delta_ptr + row + offs, mask=ok, other=0.0).to(tl.float32)
        h = _round(h + delta, dtype)
        tl.store(h_out_ptr + row + offs, h, mask=ok)
    variance = tl.sum(h * h, axis=0) / HIDDEN  # padded lanes are 0: they add nothing
    x = _round(h * tl.rsqrt(variance + eps), dtype)
    weight = tl.load(weight_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(x_out_ptr + row + offs, weight * x, mask=ok)


@triton.jit
def _rotate(ptr, ok, cos_lo, cos_hi, sin_lo, sin_hi, HALF: tl.constexpr, DTYPE: tl.constexpr):
    """Rotary embedding of the head vectors at ``ptr`` (``[heads, HALF]`` pointers to their
    first halves): ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = (-x_hi, x_lo)``.
    Returns the two halves, float32, each product rounded to ``DTYPE`` as transformers does."""
    x_lo = tl.load(ptr, mask=ok, other=0.0).to(tl.float32)
    x_hi = tl.load(ptr + HALF, mask=ok, other=0.0).to(tl.float32)
    lo = _round(x_lo * cos_lo, DTYPE) - _round(x_hi * sin_lo, DTYPE)
    hi = _round(x_hi * cos_hi, DTYPE) + _round(x_lo * sin_hi, DTYPE)
    return lo, hi


@triton.jit
def rope_write_kernel(qkv_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr,
                      slot_mapping_ptr, stride_qkv, stride_cos,
                      NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr,
                      HEAD_DIM: tl.constexpr, Q_HEADS_PAD: tl.constexpr,
                      KV_HEADS_PAD: tl.constexpr, HALF_PAD: tl.constexpr):
    """Grid (num_tokens,): token ``t``'s row of the fused projection, ``[q heads | k heads |
    v heads] x HEAD_DIM``. Writes rotated q to ``q_out[t]`` (``[NUM_Q_HEADS, HEAD_DIM]``) and
    rotated k and plain v to cache row ``slot_mapping[t]`` (``[NUM_KV_HEADS, HEAD_DIM]``)."""
    HALF: tl.constexpr = HEAD_DIM // 2
    t = tl.program_id(0).to(tl.int64)
    dtype = qkv_ptr.dtype.element_ty
    d = tl.arange(0, HALF_PAD)[None, :]  # a dim of the first half; its partner is d + HALF
    d_ok = d < HALF
    cs = cos_ptr + t * stride_cos + d
    cos_lo = tl.load(cs, mask=d_ok, other=0.0).to(tl.float32)
    cos_hi = tl.load(cs + HALF, mask=d_ok, other=0.0).to(tl.float32)
    sn = sin_ptr + t * stride_cos + d
    sin_lo = tl.load(sn, mask=d_ok, other=0.0).to(tl.float32)
    sin_hi = tl.load(sn + HALF, mask=d_ok, other=0.0).to(tl.float32)
    row = qkv_ptr + t * stride_qkv

    hq = tl.arange(0, Q_HEADS_PAD)[:, None]
    ok = (hq < NUM_Q_HEADS) & d_ok
    lo, hi = _rotate(row + hq * HEAD_DIM + d, ok, cos_lo, cos_hi, sin_lo, sin_hi, HALF, dtype)
    q_out = q_out_ptr + t * (NUM_Q_HEADS * HEAD_DIM) + hq * HEAD_DIM + d
    tl.store(q_out, lo, mask=ok)
    tl.store(q_out + HALF, hi, mask=ok)

    hk = tl.arange(0, KV_HEADS_PAD)[:, None]
    ok = (hk < NUM_KV_HEADS) & d_ok
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + hk * HEAD_DIM + d
    k_src = row + (NUM_Q_HEADS + hk) * HEAD_DIM + d
    lo, hi = _rotate(k_src, ok, cos_lo, cos_hi, sin_lo, sin_hi, HALF, dtype)
    tl.store(k_cache_ptr + dst, lo, mask=ok)
    tl.store(k_cache_ptr + dst + HALF, hi, mask=ok)
    v_src = k_src + NUM_KV_HEADS * HEAD_DIM
    tl.store(v_cache_ptr + dst, tl.load(v_src, mask=ok), mask=ok)
    tl.store(v_cache_ptr + dst + HALF, tl.load(v_src + HALF, mask=ok), mask=ok)


@triton.jit
def silu_mul_kernel(gate_up_ptr, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (num_tokens, cdiv(INTER, BLOCK)): ``out[t] = silu(gate) * up`` where row ``t`` of
    ``gate_up`` is ``[gate (INTER) | up (INTER)]``; silu rounded to the output dtype first."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < INTER
    src = gate_up_ptr + t * (2 * INTER) + offs
    gate = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(src + INTER, mask=ok, other=0.0).to(tl.float32)
    act = _round(gate / (1.0 + tl.exp(-gate)), out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * INTER + offs, act * up, mask=ok)


# ---- launchers (inputs checked by paged_ref.models.fused) --------------------------------------


def add_rms_norm_triton(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(h + delta, rmsnorm(h + delta) * weight)`` for contiguous ``[T, hidden]`` rows."""
    x = torch.empty(h.shape, dtype=torch.promote_types(weight.dtype, h.dtype), device=h.device)
    h_out = h if delta is None else torch.empty_like(h)
    if h.shape[0]:
        block = triton.next_power_of_2(h.shape[1])
        launch(add_rms_norm_kernel, (h.shape[0],),
            h, h if delta is None else delta, weight, h_out, x, eps, HIDDEN=h.shape[1],
            BLOCK=block, HAS_DELTA=delta is not None, num_warps=min(16, max(1, block // 256)))
    return h_out, x


def rope_write_triton(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      num_q_heads: int) -> torch.Tensor:
    """Rotated q ``[T, num_q_heads, head_dim]``; rotated k and v stored at ``slot_mapping``.
    ``qkv`` ``[T, (Hq + 2 Hkv) * D]`` and ``cos``/``sin`` ``[T, D]`` have unit last stride;
    the caches are contiguous ``[..., Hkv, D]`` (any leading shape: row ``slot`` is
    ``[Hkv, D]``)."""
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    q = torch.empty(qkv.shape[0], num_q_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if qkv.shape[0]:
        launch(rope_write_kernel, (qkv.shape[0],),
            qkv, cos, sin, q, k_cache, v_cache, slot_mapping, qkv.stride(0), cos.stride(0),
            NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
            Q_HEADS_PAD=triton.next_power_of_2(num_q_heads),
            KV_HEADS_PAD=triton.next_power_of_2(num_kv_heads),
            HALF_PAD=triton.next_power_of_2(head_dim // 2), num_warps=4)
    return q


def silu_mul_triton(gate_up: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """``silu(gate_up[:, :I]) * gate_up[:, I:]``, ``[T, I]``, for contiguous ``[T, 2I]``."""
    inter = gate_up.shape[1] // 2
    out = torch.empty(gate_up.shape[0], inter, dtype=gate_up.dtype, device=gate_up.device)
    if gate_up.shape[0]:
        block = min(block, triton.next_power_of_2(inter))
        launch(silu_mul_kernel, (gate_up.shape[0], triton.cdiv(inter, block)),
            gate_up, out, INTER=inter, BLOCK=block, num_warps=4)
    return out


__all__ = ["add_rms_norm_kernel", "add_rms_norm_triton", "rope_write_kernel",
           "rope_write_triton", "silu_mul_kernel", "silu_mul_triton"]
