"""The quantising K/V write as one Triton kernel: what :func:`paged_ref.quant.write_slots` does
with ~20 torch ops a tensor (scales, codes, packing, two or three scatters), in one launch for
K and V together. The engine's decode step on an INT4 cache went from 9.5 kernels a layer
(plain cache) to 52 (measured on the H200); the quantising write was the difference.

The codes and scales are *bit for bit* those of ``write_slots`` (the tests compare bytes), so
every reader decodes the same values whichever path wrote them. That takes care with rounding:

* divisions are IEEE (``tl.math.div_rn``), as torch's float32 ``/``;
* float32 -> e4m3 is rounded to nearest even here, by hand: the value is snapped to its e4m3
  grid (a power-of-two quantum per binade, ``2^-9`` below ``2^-6``) and only then cast, so the
  cast is exact on a GPU (round to nearest) and in the interpreter (which truncates);
* INT4's ``round`` is half-to-even (``torch.round``), from ``floor`` and the exact fraction.

Layout (per layer, as :class:`paged_ref.QuantizedKV` keeps it): codes ``[num_blocks,
block_size, Hkv, D]`` (fp8) or ``[..., D // 2]`` (uint8, channel i low nibble, i + D/2 high);
scales ``[num_blocks, block_size, Hkv]`` (fp8 per token-head, float32) or ``[..., groups]``
(INT4 scale and zero, float16). A slot ``s`` is row ``s`` of the first two dims flattened.
Any head_dim the formats store (fp8: any; INT4: even): a head, or an INT4 half, is padded to a
power of two of lanes (Triton's blocks) and masked, as the attention kernels do.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_ref.kernels.triton.launch import launch
from paged_ref.quant import QuantizedKV

FP8_TENSOR, FP8_TOKEN_HEAD, INT4 = 0, 1, 2


@triton.jit
def _e4m3_grid(v):
    """float32 ``v`` (|v| <= 448) rounded to the nearest e4m3 value, ties to even: a multiple
    of its binade's quantum ``2^(e - 3)`` (``2^-9`` for subnormals, |v| < 2^-6)."""
    bits = v.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127  # floor(log2 |v|) for normal floats
    e = tl.maximum(e, -6)  # e4m3's subnormals share the quantum of its smallest binade
    quantum = ((e - 3 + 127) << 23).to(tl.float32, bitcast=True)
    per_quantum = ((3 - e + 127) << 23).to(tl.float32, bitcast=True)  # 1 / quantum, exactly
    snapped = _round_half_even(v * per_quantum) * quantum  # (powers of two: products exact)
    return tl.where(snapped == 0.0, v * 0.0, snapped)  # -0.0 for a negative v, as torch's cast


@triton.jit
def _round_half_even(y):
    """``torch.round``: to the nearest integer, halves to the even one (exact for float32)."""
    r = tl.floor(y)
    frac = y - r  # exact
    odd = (r - 2.0 * tl.floor(r * 0.5)) == 1.0
    return r + tl.where((frac > 0.5) | ((frac == 0.5) & odd), 1.0, 0.0)


@triton.jit
def _int4_scale_zero(x, ok):
    """float16 (scale, zero) of the INT4 group ``x`` [H_PAD, N] over the lanes ``ok``, per
    head: ``zero = min``, ``scale = max((max - min) / 15, 2^-24)``, as ``int4_scale_zero``."""
    low = tl.min(tl.where(ok, x, float("inf")), axis=1)
    high = tl.max(tl.where(ok, x, float("-inf")), axis=1)
    scale = tl.maximum(tl.math.div_rn(high - low, 15.0), 2.0**-24)
    return scale.to(tl.float16), low.to(tl.float16)


@triton.jit
def _int4_codes(x, scale16, zero16):
    """Codes ``round((x - zero) / scale)`` in 0..15 (uint8) from the float16 scale and zero."""
    codes = _round_half_even(tl.math.div_rn(x - zero16.to(tl.float32)[:, None],
                                            scale16.to(tl.float32)[:, None]))
    return tl.minimum(tl.maximum(codes, 0.0), 15.0).to(tl.uint8)


@triton.jit
def _write_int4(src, data_ptr, scale_ptr, zero_ptr, slot, stride_dt, stride_dh, stride_st,
                stride_sh, H_PAD: tl.constexpr, NUM_HEADS: tl.constexpr,
                HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, GROUPS: tl.constexpr):
    """One token's heads (``src``: pointers to their first channels, [H_PAD, 1]) into INT4
    slot ``slot``: byte ``i`` = code ``i`` | code ``i + D/2`` << 4, a (scale, zero) per half
    (``GROUPS`` 2) or per head (1). Halves are loaded apart, padded to ``HALF_PAD`` lanes and
    masked, so any even head_dim works."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_h = tl.arange(0, H_PAD)
    offs_j = tl.arange(0, HALF_PAD)
    ok = (offs_h < NUM_HEADS)[:, None] & (offs_j < HALF)[None, :]
    lo = tl.load(src + offs_j[None, :], mask=ok, other=0.0).to(tl.float32)
    hi = tl.load(src + HALF + offs_j[None, :], mask=ok, other=0.0).to(tl.float32)
    s_ptrs = slot * stride_st + offs_h * stride_sh
    head_ok = offs_h < NUM_HEADS
    if GROUPS == 2:
        s_lo, z_lo = _int4_scale_zero(lo, ok)
        s_hi, z_hi = _int4_scale_zero(hi, ok)
        tl.store(scale_ptr + s_ptrs + 1, s_hi, mask=head_ok)
        tl.store(zero_ptr + s_ptrs + 1, z_hi, mask=head_ok)
    else:  # one group: the two halves side by side
        both = tl.join(lo, hi)  # [H_PAD, HALF_PAD, 2]
        both_ok = tl.join(ok, ok)
        s_lo, z_lo = _int4_scale_zero(tl.reshape(both, (H_PAD, 2 * HALF_PAD)),
                                      tl.reshape(both_ok, (H_PAD, 2 * HALF_PAD)))
        s_hi, z_hi = s_lo, z_lo
    tl.store(scale_ptr + s_ptrs, s_lo, mask=head_ok)
    tl.store(zero_ptr + s_ptrs, z_lo, mask=head_ok)
    packed = _int4_codes(lo, s_lo, z_lo) | (_int4_codes(hi, s_hi, z_hi) << 4)
    tl.store(data_ptr + slot * stride_dt + offs_h[:, None] * stride_dh + offs_j[None, :],
             packed, mask=ok)


@triton.jit
def _write_fp8(src, data_ptr, scale_ptr, tensor_scale_ptr, slot, stride_dt, stride_dh,
               stride_st, stride_sh, KIND: tl.constexpr, H_PAD: tl.constexpr,
               NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """One token's heads (``src`` as for :func:`_write_int4`) into e4m3 slot ``slot``: a
    float32 scale per head (``KIND`` FP8_TOKEN_HEAD: amax / 448, 1 for an all-zero head) or
    the layer's one scale. ``D_PAD`` lanes, masked past ``HEAD_DIM``."""
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, D_PAD)
    head_ok = offs_h < NUM_HEADS
    ok = head_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    x = tl.load(src + offs_d[None, :], mask=ok, other=0.0).to(tl.float32)
    if KIND == 1:
        amax = tl.max(tl.abs(x), axis=1)  # (padded lanes are 0: they change no maximum)
        scale = tl.where(amax > 0, tl.math.div_rn(amax, 448.0), 1.0)
        tl.store(scale_ptr + slot * stride_st + offs_h * stride_sh, scale, mask=head_ok)
        y = tl.math.div_rn(x, scale[:, None])
    else:
        y = tl.math.div_rn(x, tl.load(tensor_scale_ptr))
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    tl.store(data_ptr + slot * stride_dt + offs_h[:, None] * stride_dh + offs_d[None, :],
             _e4m3_grid(y).to(tl.float8e4nv), mask=ok)


@triton.jit
def quant_write_kernel(k_ptr, v_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                       kd_ptr, ks_ptr, kz_ptr, vd_ptr, vs_ptr, vz_ptr, k_tensor_scale_ptr,
                       v_tensor_scale_ptr, stride_dt, stride_dh, stride_st, stride_sh,
                       KIND: tl.constexpr, NUM_HEADS: tl.constexpr, H_PAD: tl.constexpr,
                       HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, HALF_PAD: tl.constexpr,
                       GROUPS: tl.constexpr):
    """Grid (num_tokens,): token ``t``'s K and V, all heads, into slot ``slots[t]``."""
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    offs_h = tl.arange(0, H_PAD)[:, None]
    k = k_ptr + t * stride_kt + offs_h * stride_kh
    v = v_ptr + t * stride_vt + offs_h * stride_vh
    if KIND == 2:
        _write_int4(k, kd_ptr, ks_ptr, kz_ptr, slot, stride_dt, stride_dh, stride_st,
                    stride_sh, H_PAD, NUM_HEADS, HEAD_DIM, HALF_PAD, GROUPS)
        _write_int4(v, vd_ptr, vs_ptr, vz_ptr, slot, stride_dt, stride_dh, stride_st,
                    stride_sh, H_PAD, NUM_HEADS, HEAD_DIM, HALF_PAD, GROUPS)
    else:
        _write_fp8(k, kd_ptr, ks_ptr, k_tensor_scale_ptr, slot, stride_dt, stride_dh,
                   stride_st, stride_sh, KIND, H_PAD, NUM_HEADS, HEAD_DIM, D_PAD)
        _write_fp8(v, vd_ptr, vs_ptr, v_tensor_scale_ptr, slot, stride_dt, stride_dh,
                   stride_st, stride_sh, KIND, H_PAD, NUM_HEADS, HEAD_DIM, D_PAD)


def _slot_strides(cache: QuantizedKV, name: str) -> tuple[int, int]:
    """(slot, head) strides of ``cache.<name>``, whose first two dims must flatten to slots."""
    t = getattr(cache, name)
    if t.stride(0) != t.shape[1] * t.stride(1) or t.stride(-1) != 1:
        raise ValueError(f"{name} [{tuple(t.shape)}] with strides {t.stride()}: its blocks and "
                         "slots must flatten to rows, its last dim contiguous")
    return t.stride(1), t.stride(2)


def quant_write_triton(k_cache: QuantizedKV, v_cache: QuantizedKV, k: torch.Tensor,
                       v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Quantise token ``i``'s ``k[i]``, ``v[i]`` (``[num_tokens, Hkv, D]``, float16 / bfloat16
    / float32, last dim contiguous) into slot ``slot_mapping[i]`` (int64 ``[num_tokens]``) of
    both caches, one launch; the same bytes as ``write_slots`` on each. Unchecked values (as
    ``write_slots``: no read-back, so it runs inside a CUDA graph); the layouts are checked."""
    fmt = k_cache.format
    if v_cache.format != fmt or k_cache.data.shape != v_cache.data.shape:
        raise ValueError("k_cache and v_cache must share one format and shape")
    num_tokens, num_heads, head_dim = k.shape
    if k.stride(-1) != 1 or v.stride(-1) != 1 or v.shape != k.shape:
        raise ValueError("k and v must be [num_tokens, Hkv, D] with the last dim contiguous")
    if num_tokens == 0:
        return
    kind = INT4 if fmt.kind == "int4" else FP8_TOKEN_HEAD if fmt.scale_per == "token_head" \
        else FP8_TENSOR
    groups = head_dim // fmt.group(head_dim) if kind == INT4 else 1
    stride_dt, stride_dh = _slot_strides(k_cache, "data")
    per_token = kind != FP8_TENSOR
    stride_st, stride_sh = _slot_strides(k_cache, "scale") if per_token else (0, 0)
    # V's layout must be K's: one set of strides serves both
    if _slot_strides(v_cache, "data") != (stride_dt, stride_dh) or (
            per_token and _slot_strides(v_cache, "scale") != (stride_st, stride_sh)):
        raise ValueError("k_cache and v_cache must have the same strides")
    scales = (k_cache.scale, k_cache.zero if kind == INT4 else k_cache.scale,
              v_cache.scale, v_cache.zero if kind == INT4 else v_cache.scale)
    launch(quant_write_kernel, (num_tokens,),
        k, v, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.data, scales[0], scales[1], v_cache.data, scales[2], scales[3],
        k_cache.scale, v_cache.scale, stride_dt, stride_dh, stride_st, stride_sh,
        KIND=kind, NUM_HEADS=num_heads, H_PAD=triton.next_power_of_2(num_heads),
        HEAD_DIM=head_dim, D_PAD=triton.next_power_of_2(head_dim),
        HALF_PAD=triton.next_power_of_2(max(1, head_dim // 2)), GROUPS=groups)

