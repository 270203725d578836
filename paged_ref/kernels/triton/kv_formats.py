"""How the Triton kernels read a quantised cache: de-quantising loads, in registers.

The kernels take a compile-time ``KV_FORMAT`` (the cache's bytes never pass through another
buffer; only the arithmetic after the load changes):

* ``KV_PLAIN`` (0): float16 / bfloat16 / float32 values, loaded as they are.
* ``KV_FP8_TENSOR`` (1): e4m3 codes, one scale per layer. The codes are converted to the dot's
  type and the scales fold into the softmax: ``q . (s_k c) = s_k (q . c)``, so ``s_k`` joins
  the score scale and ``s_v`` multiplies the output once at the end.
* ``KV_FP8_TOKEN_HEAD`` (2): e4m3 codes, a scale per token-head: the same, with ``s_k[t]``
  multiplying column ``t`` of the scores and ``s_v[t]`` the weight ``p[t]`` before ``p @ V``.
* ``KV_INT4`` (3): bytes holding two 4-bit codes (channel ``i`` low, channel ``i + D/2`` high);
  see :func:`attend_tokens_int4`. Each half of the head has its own (scale, zero) per token
  (or both halves share one pair: ``INT4_GROUPS`` 2 or 1), so the affine de-quantisation
  ``x = z + s c`` also moves out of the ``[TILE, D]`` tile into ``[GROUP, TILE]`` scores:
  ``q . x = s (q . c) + z sum(q)`` and ``sum_t p_t x_t = (p s) @ c + sum_t p_t z_t``.

So the only per-element work is turning a code into a number: one conversion for e4m3 (a
hardware instruction on recent GPUs), one AND or shift plus a bit trick for INT4.

:func:`kv_kernel_args` turns a cache (tensor or :class:`~paged_ref.QuantizedKV`) into the
extra kernel arguments.
"""

from __future__ import annotations

import triton
import triton.language as tl

from paged_ref.quant import QuantizedKV

KV_PLAIN = tl.constexpr(0)
KV_FP8_TENSOR = tl.constexpr(1)
KV_FP8_TOKEN_HEAD = tl.constexpr(2)
KV_INT4 = tl.constexpr(3)


def kv_format_code(cache) -> int:
    """The ``KV_FORMAT`` number for a cache (tensor or QuantizedKV)."""
    if not isinstance(cache, QuantizedKV):
        return 0
    fmt = cache.format
    if fmt.kind == "int4":
        return 3
    return 1 if fmt.scale_per == "tensor" else 2


def kv_kernel_args(k_cache, v_cache) -> tuple[tuple, dict]:
    """The kernels' arguments for a cache pair.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` tensors, or QuantizedKV caches
            of one format.

    Returns:
        ``(args, constexprs)``. args: ``(k_data, v_data, k_scale, v_scale, k_zero, v_zero,
        stride_sb, stride_st, stride_sh)``: the code (or value) tensors, the scale tensors (the
        data tensors stand in where a format has none; they are never read) and the strides of
        the scales' first three dims (block, token-in-block, head; 0 for a per-tensor scale).
        constexprs: ``KV_FORMAT`` and ``INT4_GROUPS`` ((scale, zero) pairs per token-head).
    """
    code = kv_format_code(k_cache)
    if code == 0:
        return (k_cache, v_cache, k_cache, v_cache, k_cache, v_cache, 0, 0, 0), dict(
            KV_FORMAT=0, INT4_GROUPS=1)
    k_zero = k_cache.zero if k_cache.zero is not None else k_cache.data
    v_zero = v_cache.zero if v_cache.zero is not None else v_cache.data
    s = k_cache.scale
    strides = (s.stride(0), s.stride(1), s.stride(2)) if s.dim() >= 3 else (0, 0, 0)
    groups = s.shape[-1] if code == 3 else 1
    return (k_cache.data, v_cache.data, k_cache.scale, v_cache.scale, k_zero, v_zero,
            *strides), dict(KV_FORMAT=code, INT4_GROUPS=groups)


@triton.jit
def int4_halves(packed, DOT_UPCAST: tl.constexpr):
    """uint8 bytes ``[TILE, D/2]`` -> codes of the low and high nibbles, as numbers.

    float32 when ``DOT_UPCAST``; else float16 by a bit trick (no integer-to-float conversion
    instruction): ``0x6400 | c`` read as a float16 is ``1024 + c`` exactly, minus 1024.
    """
    low = packed & 0xF
    high = packed >> 4
    if DOT_UPCAST:  # (one return for both branches: the compiler wants one return type)
        low = low.to(tl.float32)
        high = high.to(tl.float32)
    else:
        low = (low.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
        high = (high.to(tl.int16) | 0x6400).to(tl.float16, bitcast=True) - 1024.0
    return low, high


@triton.jit
def load_scale_zero(scale_ptr, zero_ptr, srow, group, t_mask):
    """float32 (scale, zero) of ``group`` for each token of the tile: ``[TILE]`` each."""
    s = tl.load(scale_ptr + srow + group, mask=t_mask, other=0.0).to(tl.float32)
    z = tl.load(zero_ptr + srow + group, mask=t_mask, other=0.0).to(tl.float32)
    return s, z


@triton.jit
def token_slots(table_row_ptr, t0, end, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr):
    """Logical -> physical for tokens ``[t0, t0 + TILE)`` of one sequence: the block holding
    each token (int64, from the block table; 0 past ``end``), its place in that block, and
    ``t_mask`` (token < end). ``[TILE]`` each."""
    tok = t0 + tl.arange(0, TILE)
    t_mask = tok < end
    block = tl.load(table_row_ptr + tok // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    return block, tok % BLOCK_SIZE, t_mask


@triton.jit
def load_int4_tile(
    k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, t0, end, stride_kb, stride_kt, stride_kh,
    k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr, stride_sb, stride_st, stride_sh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr,
    INT4_GROUPS: tl.constexpr,
):
    """Packed K and V codes of tokens ``[t0, t0 + TILE)`` (``[TILE, HEAD_DIM / 2]`` uint8, 0
    past ``end``), each half's float32 (scale, zero) per token (``[TILE]`` each: K low, K high,
    V low, V high) and ``t_mask`` (token < end): 11 values."""
    HALF: tl.constexpr = HEAD_DIM // 2
    HIGH: tl.constexpr = INT4_GROUPS - 1  # group of the high half: 1, or 0 when one pair
    offs_h = tl.arange(0, HALF)
    block, slot, t_mask = token_slots(table_row_ptr, t0, end, BLOCK_SIZE, TILE)
    row = block * stride_kb + slot * stride_kt + kv_head * stride_kh
    srow = block * stride_sb + slot * stride_st + kv_head * stride_sh
    pk = tl.load(k_cache_ptr + row[:, None] + offs_h[None, :], mask=t_mask[:, None], other=0)
    pv = tl.load(v_cache_ptr + row[:, None] + offs_h[None, :], mask=t_mask[:, None], other=0)
    ks_lo, kz_lo = load_scale_zero(k_scale_ptr, k_zero_ptr, srow, 0, t_mask)
    ks_hi, kz_hi = load_scale_zero(k_scale_ptr, k_zero_ptr, srow, HIGH, t_mask)
    vs_lo, vz_lo = load_scale_zero(v_scale_ptr, v_zero_ptr, srow, 0, t_mask)
    vs_hi, vz_hi = load_scale_zero(v_scale_ptr, v_zero_ptr, srow, HIGH, t_mask)
    return pk, pv, ks_lo, kz_lo, ks_hi, kz_hi, vs_lo, vz_lo, vs_hi, vz_hi, t_mask


@triton.jit
def attend_tokens_int4(
    q,  # [GROUP_PAD, HEAD_DIM] queries (HEAD_DIM a power of two)
    k_cache_ptr, v_cache_ptr,  # uint8 [num_blocks, block_size, Hkv, HEAD_DIM / 2]
    table_row_ptr, kv_head, start, end, qk_scale,
    stride_kb, stride_kt, stride_kh,  # strides of the code tensors (bytes)
    k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr,  # float16 [..., INT4_GROUPS]
    stride_sb, stride_st, stride_sh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr,
    TILE: tl.constexpr, DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    INT4_GROUPS: tl.constexpr, PREFETCH: tl.constexpr,
):
    """:func:`~paged_ref.kernels.triton.decode.attend_tokens` for an INT4 cache: the same
    online softmax, with each tile's codes used directly in the dots and each half's
    (scale, zero) applied to ``[GROUP_PAD, TILE]`` scores and weights. Same return values.
    ``PREFETCH``: the next tile is loaded (into registers) before this one is used."""
    HALF: tl.constexpr = HEAD_DIM // 2
    q_low, q_high = tl.split(tl.permute(tl.reshape(q, (GROUP_PAD, 2, HALF)), (0, 2, 1)))
    q_low = q_low.to(tl.float32 if DOT_UPCAST else tl.float16)
    q_high = q_high.to(tl.float32 if DOT_UPCAST else tl.float16)
    q_low_sum = tl.sum(q_low.to(tl.float32), axis=1)  # [GROUP_PAD]: for the zero term
    q_high_sum = tl.sum(q_high.to(tl.float32), axis=1)
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc_low = tl.zeros([GROUP_PAD, HALF], dtype=tl.float32)
    acc_high = tl.zeros([GROUP_PAD, HALF], dtype=tl.float32)
    AHEAD: tl.constexpr = TILE if PREFETCH else 0  # as in attend_tokens
    if PREFETCH:
        nxt = load_int4_tile(
            k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, start, end,
            stride_kb, stride_kt, stride_kh, k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr,
            stride_sb, stride_st, stride_sh, BLOCK_SIZE, HEAD_DIM, TILE, INT4_GROUPS)
    for t0 in range(start, end, TILE):
        loaded = load_int4_tile(
            k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, t0 + AHEAD, end,
            stride_kb, stride_kt, stride_kh, k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr,
            stride_sb, stride_st, stride_sh, BLOCK_SIZE, HEAD_DIM, TILE, INT4_GROUPS)
        if PREFETCH:
            tile, nxt = nxt, loaded
        else:
            tile = loaded
        pk, pv, ks_lo, kz_lo, ks_hi, kz_hi, vs_lo, vz_lo, vs_hi, vz_hi, t_mask = tile
        k_low, k_high = int4_halves(pk, DOT_UPCAST)
        # q . (z + s c) = s (q . c) + z sum(q), for each half
        scores = tl.dot(q_low, tl.trans(k_low), input_precision=DOT_PRECISION) * ks_lo[None, :]
        scores += q_low_sum[:, None] * kz_lo[None, :]
        scores += tl.dot(q_high, tl.trans(k_high), input_precision=DOT_PRECISION) * ks_hi[None, :]
        scores += q_high_sum[:, None] * kz_hi[None, :]
        scores = tl.where(t_mask[None, :], scores * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: add nothing
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v_low, v_high = int4_halves(pv, DOT_UPCAST)
        # sum_t p_t (z_t + s_t c_t) = (p s) @ c + sum_t p_t z_t, for each half
        acc_low = acc_low * alpha[:, None] + tl.dot(
            (p * vs_lo[None, :]).to(v_low.dtype), v_low, input_precision=DOT_PRECISION)
        acc_low += tl.sum(p * vz_lo[None, :], axis=1)[:, None]
        acc_high = acc_high * alpha[:, None] + tl.dot(
            (p * vs_hi[None, :]).to(v_high.dtype), v_high, input_precision=DOT_PRECISION)
        acc_high += tl.sum(p * vz_hi[None, :], axis=1)[:, None]
        m = m_new
    acc = tl.reshape(tl.permute(tl.join(acc_low, acc_high), (0, 2, 1)), (GROUP_PAD, HEAD_DIM))
    return acc, m, l


__all__ = ["attend_tokens_int4", "kv_format_code", "kv_kernel_args"]
