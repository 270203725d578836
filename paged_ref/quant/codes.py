"""The number formats' arithmetic: e4m3 and INT4 codes from values, and values from codes.

Torch ops on plain tensors; nothing here knows what a cache is (that is
:mod:`paged_ref.quant.formats`). The Triton write kernel (``kernels/triton/quant_write.py``)
computes the very same bytes, so every step is written to round the way a kernel can repeat:

    s = fp8_scale(x, "token_head")       # float32 amax / 448 per vector
    c = fp8_encode(x, s)                 # float8_e4m3fn codes, saturated at +-448
    x_back = dequantize_fp8(c, s)        # float32 s * c

    scale, zero = int4_scale_zero(x, 64)          # float16 per 64 channels
    packed = int4_encode(x, scale, zero, 64)      # uint8 [..., D // 2]
    x_back = int4_decode(packed, scale, zero, 64) # float32 zero + scale * code
"""

from __future__ import annotations

import torch

#: Largest finite float8_e4m3fn value.
FP8_MAX = 448.0
#: Largest INT4 code (codes are unsigned, 0..15).
INT4_MAX = 15
#: Element type of FP8 codes.
FP8_DTYPE = torch.float8_e4m3fn


# ---- FP8 ------------------------------------------------------------------------------------


def fp8_scale(x: torch.Tensor, per: str = "tensor") -> torch.Tensor:
    """The e4m3 scale ``amax / 448`` of ``x``; an all-zero slice gets scale 1.

    Args:
        x: values ``[..., D]``, any float dtype.
        per: ``"tensor"`` (one scale for all of ``x``) or ``"token_head"`` (one per vector
            along the last dim).

    Returns:
        float32 scale: 0-d for ``"tensor"``, ``x.shape[:-1]`` for ``"token_head"``.
    """
    a = x.detach().float().abs()
    amax = a.amax() if per == "tensor" else a.amax(dim=-1)
    # NOTE: a tensor divisor: on a GPU, torch divides by a Python number as a multiply by its
    # reciprocal, one ulp off IEEE division at times; this way every device, and the Triton
    # write kernel, computes the same scale.
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def fp8_encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes ``x / scale`` rounded to the nearest e4m3 value, saturating at +-448.

    Args:
        x: values ``[..., D]``, any float dtype.
        scale: float32, 0-d or ``x.shape[:-1]`` (one per vector).

    Returns:
        float8_e4m3fn codes, ``x.shape``.
    """
    s = scale if scale.dim() == 0 else scale[..., None]
    # NOTE: torch's cast turns values past 448 into NaN, hence the clamp.
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Values ``scale * code``.

    Args:
        codes: float8_e4m3fn ``[..., D]``.
        scale: float32, 0-d or ``codes.shape[:-1]``.

    Returns:
        float32 ``[..., D]``.
    """
    s = scale if scale.dim() == 0 else scale[..., None]
    return codes.float() * s


# ---- INT4 -----------------------------------------------------------------------------------


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes a byte: byte ``i`` holds channel ``i`` in its low nibble and channel
    ``i + D // 2`` in its high nibble (the first half of the head low, the second half high,
    so a kernel unpacks each half with one AND or one shift).

    Args:
        codes: uint8 codes 0..15, ``[..., D]``, D even.

    Returns:
        uint8 ``[..., D // 2]``.
    """
    half = codes.shape[-1] // 2
    return (codes[..., :half] | (codes[..., half:] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`.

    Args:
        packed: uint8 ``[..., D // 2]``.

    Returns:
        uint8 codes 0..15, ``[..., D]``.
    """
    return torch.cat([packed & 0xF, packed >> 4], dim=-1)


def int4_scale_zero(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The asymmetric INT4 code's ``(scale, zero)`` per group of ``group_size`` channels:
    ``zero = min``, ``scale = (max - min) / 15`` (at least 2^-24, so a constant group decodes
    exactly).

    Args:
        x: values ``[..., D]``, D a multiple of ``group_size``.
        group_size: channels per group.

    Returns:
        float16 ``(scale, zero)``, each ``[..., D // group_size]``.
    """
    g = x.detach().float().unflatten(-1, (-1, group_size))
    low, high = g.amin(dim=-1), g.amax(dim=-1)
    # (a tensor divisor, as in fp8_scale)
    scale = ((high - low) / torch.full_like(high, INT4_MAX)).clamp(min=2.0**-24)
    return scale.to(torch.float16), low.to(torch.float16)


def int4_encode(x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """Packed codes ``round((x - zero) / scale)`` clamped to 0..15 (half to even, as
    ``torch.round``), from the float16 ``scale`` / ``zero`` as stored, so decoding reproduces
    the nearest code.

    Args:
        x: values ``[..., D]``.
        scale, zero: float16 ``[..., D // group_size]`` (from :func:`int4_scale_zero`).
        group_size: channels per group.

    Returns:
        uint8 ``[..., D // 2]`` (:func:`pack_int4`).
    """
    g = x.float().unflatten(-1, (-1, group_size))
    codes = torch.round((g - zero.float()[..., None]) / scale.float()[..., None])
    return pack_int4(codes.clamp(0, INT4_MAX).to(torch.uint8).flatten(-2))


def int4_decode(packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor,
                group_size: int) -> torch.Tensor:
    """Values ``zero + scale * code`` per group.

    Args:
        packed: uint8 ``[..., D // 2]``.
        scale, zero: float16 ``[..., D // group_size]``.
        group_size: channels per group.

    Returns:
        float32 ``[..., D]``.
    """
    codes = unpack_int4(packed).float().unflatten(-1, (-1, group_size))
    return (zero.float()[..., None] + scale.float()[..., None] * codes).flatten(-2)


__all__ = ["FP8_DTYPE", "FP8_MAX", "INT4_MAX", "dequantize_fp8", "fp8_encode", "fp8_scale",
           "int4_decode", "int4_encode", "int4_scale_zero", "pack_int4", "unpack_int4"]
