"""Lesson 10: quantised KV caches, FP8 (e4m3) and INT4.

* Ex 10.1 :func:`quantize_fp8`      FP8 e4m3 codes with one scale per token-head
* Ex 10.2 :func:`quantize_int4`     INT4 codes, two a byte, a (scale, zero) per half head
* Ex 10.3 :func:`dequant_int4_kernel`  the de-quantising load in Triton: read one sequence's
                                      INT4 K (or V) of one head through the block table and
                                      write it back as float32 numbers
* given   :func:`dequantize_fp8`, :func:`dequantize_int4`, :func:`gather_dequant_int4`
          (launches 10.3)

Formats (as in :mod:`paged_ref.quant`, so your codes can go straight into
``paged_ref.QuantizedKV`` and ``paged_attention``)::

    fp8  per token-head  x ~= scale * code        code float8_e4m3fn, scale float32 = amax / 448
    int4 per half head   x ~= zero + scale * code code 0..15, scale = (max - min) / 15 and
                                                  zero = min, both float16, one pair for
                                                  channels [0, D/2) and one for [D/2, D)
    int4 packing         byte i = code[i] | code[i + D/2] << 4   (low nibble: first half)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 10.1: FP8 e4m3 codes of ``x`` with one scale per vector (token-head).

    Args:
        x: ``[..., D]`` float16 / bfloat16 / float32 values (e.g. ``[tokens, heads, D]``).

    Returns:
        codes: ``[..., D]`` ``torch.float8_e4m3fn``, ``x / scale`` rounded to the nearest e4m3.
        scale: ``[...]`` float32, ``amax(|x|) / 448`` over the last dim, so the largest value of
            each vector lands on 448, the largest finite e4m3; 1.0 for an all-zero vector.

    Hints:
        * Compute in float32 (``x.float()``).
        * ``torch.where(amax > 0, amax / FP8_MAX, 1.0)``-style guard for zero vectors.
        * torch's cast to float8_e4m3fn turns anything past 448 into NaN: clamp to
          ``[-448, 448]`` before ``.to(torch.float8_e4m3fn)`` (float rounding can push
          ``amax / scale`` a hair past 448).
    """
    # BEGIN SOLUTION
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    codes = (x / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale
    # END SOLUTION


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``scale * code``: codes ``[..., D]``, scale ``[...]``."""
    return codes.float() * scale[..., None]


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exercise 10.2: INT4 codes of ``x``, two a byte, with a float16 (scale, zero) per half.

    Args:
        x: ``[..., D]`` values, ``D`` even.

    Returns:
        packed: ``[..., D // 2]`` uint8; byte ``i`` holds the code of channel ``i`` in its low
            4 bits and the code of channel ``i + D // 2`` in its high 4 bits.
        scale:  ``[..., 2]`` float16, ``(max - min) / 15`` of each half (at least ``2**-24``,
            so that a constant half never divides by zero).
        zero:   ``[..., 2]`` float16, the minimum of each half.

    Each code is ``round((x - zero) / scale)`` clamped to ``0..15``, computed with the
    float16 ``scale`` and ``zero`` you return (so de-quantising gives the nearest code's
    value): ``x ~= zero + scale * code``.

    Hints:
        * ``x.float().unflatten(-1, (2, D // 2))`` puts the halves on their own dim.
        * ``torch.round``, then ``.clamp(0, 15).to(torch.uint8)``.
        * Pack with ``low | (high << 4)`` on uint8 tensors.
    """
    # BEGIN SOLUTION
    halves = x.float().unflatten(-1, (2, x.shape[-1] // 2))  # [..., 2, D/2]
    low, high = halves.amin(dim=-1), halves.amax(dim=-1)
    scale = ((high - low) / 15).clamp(min=2.0**-24).to(torch.float16)
    zero = low.to(torch.float16)
    codes = torch.round((halves - zero.float()[..., None]) / scale.float()[..., None])
    codes = codes.clamp(0, 15).to(torch.uint8)
    packed = codes[..., 0, :] | (codes[..., 1, :] << 4)
    return packed, scale, zero
    # END SOLUTION


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """float32 values ``[..., D]`` from :func:`quantize_int4`'s output."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-2).float()  # [..., 2, D/2]
    return (zero.float()[..., None] + scale.float()[..., None] * codes).flatten(-2)


@triton.jit
def dequant_int4_kernel(
    out_ptr,  # float32 [seq_len, HEAD_DIM]
    packed_ptr,  # uint8 [num_blocks, block_size, num_kv_heads, HEAD_DIM // 2] (contiguous)
    scale_ptr,  # float16 [num_blocks, block_size, num_kv_heads, 2]
    zero_ptr,  # float16, like scale
    table_ptr,  # int32 [max_blocks]: this sequence's block table
    seq_len,
    kv_head,
    num_kv_heads,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    TILE: tl.constexpr,
):
    """Exercise 10.3: the de-quantising load. One program handles tokens
    ``[pid * TILE, pid * TILE + TILE)`` of the sequence: for each token ``t < seq_len``

    * its slot is ``table[t // BLOCK_SIZE] * BLOCK_SIZE + t % BLOCK_SIZE``;
    * its bytes are ``packed[slot, kv_head, :]`` (``HEAD_DIM // 2`` of them), its pair of
      scales ``scale[slot, kv_head, 0:2]`` and zeros likewise;
    * write ``out[t, i] = zero_0 + scale_0 * (byte_i & 15)`` and
      ``out[t, i + HEAD_DIM // 2] = zero_1 + scale_1 * (byte_i >> 4)`` for ``i < HEAD_DIM // 2``.

    Hints:
        * ``offs_t = pid * TILE + tl.arange(0, TILE)``, ``t_mask = offs_t < seq_len``;
          load the table entries with that mask (entries past the sequence hold garbage).
        * Use int64 for the slot offsets (``.to(tl.int64)``): big caches pass 2**31 bytes.
        * Element offsets: bytes at ``(slot * num_kv_heads + kv_head) * (HEAD_DIM // 2) + i``,
          scales at ``(slot * num_kv_heads + kv_head) * 2 + half``.
        * ``& 15`` and ``>> 4`` work on uint8 tensors; ``.to(tl.float32)`` then does the rest.
        * Store the two halves with two ``tl.store`` calls (columns ``i`` and ``i + D/2``).
    """
    # BEGIN SOLUTION
    HALF: tl.constexpr = HEAD_DIM // 2
    offs_t = tl.program_id(0) * TILE + tl.arange(0, TILE)
    t_mask = offs_t < seq_len
    offs_i = tl.arange(0, HALF)
    block = tl.load(table_ptr + offs_t // BLOCK_SIZE, mask=t_mask, other=0).to(tl.int64)
    token_head = (block * BLOCK_SIZE + offs_t % BLOCK_SIZE) * num_kv_heads + kv_head
    mask = t_mask[:, None]
    packed = tl.load(packed_ptr + token_head[:, None] * HALF + offs_i[None, :], mask=mask,
                     other=0)
    s0 = tl.load(scale_ptr + token_head * 2, mask=t_mask, other=0.0).to(tl.float32)
    s1 = tl.load(scale_ptr + token_head * 2 + 1, mask=t_mask, other=0.0).to(tl.float32)
    z0 = tl.load(zero_ptr + token_head * 2, mask=t_mask, other=0.0).to(tl.float32)
    z1 = tl.load(zero_ptr + token_head * 2 + 1, mask=t_mask, other=0.0).to(tl.float32)
    low = z0[:, None] + s0[:, None] * (packed & 15).to(tl.float32)
    high = z1[:, None] + s1[:, None] * (packed >> 4).to(tl.float32)
    out_row = out_ptr + offs_t.to(tl.int64)[:, None] * HEAD_DIM + offs_i[None, :]
    tl.store(out_row, low, mask=mask)
    tl.store(out_row + HALF, high, mask=mask)
    # END SOLUTION


def gather_dequant_int4(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                        block_table: torch.Tensor, seq_len: int, kv_head: int,
                        tile: int = 16) -> torch.Tensor:
    """float32 ``[seq_len, D]``: K (or V) of ``kv_head`` for tokens ``0..seq_len-1`` of one
    sequence, de-quantised by :func:`dequant_int4_kernel`. ``packed`` ``[num_blocks,
    block_size, Hkv, D // 2]`` uint8, ``scale`` / ``zero`` ``[num_blocks, block_size, Hkv, 2]``
    float16, ``block_table`` int32 ``[max_blocks]``, all on the Triton device."""
    _, block_size, num_kv_heads, half = packed.shape
    out = torch.empty(seq_len, 2 * half, dtype=torch.float32, device=packed.device)
    if seq_len:
        dequant_int4_kernel[(triton.cdiv(seq_len, tile),)](
            out, packed, scale, zero, block_table, seq_len, kv_head, num_kv_heads,
            BLOCK_SIZE=block_size, HEAD_DIM=2 * half, TILE=tile)
    return out
