"""Values into a quantised cache: :func:`quantize` (a whole tensor) and :func:`write_slots`
(new tokens into their slots, what a serving step does). The arithmetic is
:mod:`paged_ref.quant.codes`; the layouts are :mod:`paged_ref.quant.formats`.
"""

from __future__ import annotations

import numbers

import torch

from paged_ref.quant.codes import (
    FP8_DTYPE,
    fp8_encode,
    fp8_scale,
    int4_encode,
    int4_scale_zero,
)
from paged_ref.quant.formats import COMPUTE_DTYPES, KVFormat, QuantizedKV


def quantize(x: torch.Tensor, kv_format: str | KVFormat, *,
             scale: torch.Tensor | float | None = None) -> QuantizedKV:
    """Quantise values into codes and the scales that decode them.

    Args:
        x: values ``[..., head_dim]``, float16 / bfloat16 / float32.
        kv_format: a :class:`KVFormat` or its name (``"fp8"``, ``"fp8_token_head"``,
            ``"int4"``, ``"int4_g64"``, ...).
        scale: fp8 per tensor only: the layer's scale (a positive finite number or a 0-d
            tensor); default ``amax(|x|) / 448``. Every other format computes its scales.

    Returns:
        QuantizedKV of ``x.shape`` values.

    Raises:
        TypeError: ``x`` is not a float tensor of a compute dtype.
        ValueError: head_dim the format cannot store, or ``scale`` for a format without one.
    """
    fmt = KVFormat.parse(kv_format)
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in COMPUTE_DTYPES:
        raise TypeError(f"x must be one of {COMPUTE_DTYPES}, got {x.dtype}")
    if x.dim() < 1:
        raise ValueError("x must have at least one dimension (head_dim)")
    fmt.check_head_dim(x.shape[-1])
    if scale is not None and fmt.scale_per != "tensor":
        raise ValueError(f"scale= is for fp8 per tensor only; {fmt.name} computes its own")
    if fmt.kind == "int4":
        g = fmt.group(x.shape[-1])
        s, z = int4_scale_zero(x, g)
        return QuantizedKV(int4_encode(x, s, z, g), s, z, fmt)
    s = fp8_scale(x, fmt.scale_per) if scale is None else check_tensor_scale(scale, x.device)
    return QuantizedKV(fp8_encode(x, s), s, None, fmt)


def write_slots(cache: QuantizedKV, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantise ``values`` and store them, codes and per-token scales, in rows ``slots`` of
    ``cache`` (an fp8 per-tensor scale is used as it is).

    Unchecked (the callers check); no value is read back, so it runs inside a CUDA graph.

    Args:
        cache: QuantizedKV ``[num_blocks, block_size, Hkv, D]``, written in place.
        values: ``[n, Hkv, D]`` float16 / bfloat16 / float32.
        slots: int64 ``[n]`` on the cache's device, distinct, in ``[0, num_blocks *
            block_size)``.
    """
    fmt = cache.format
    if fmt.kind == "int4":
        g = fmt.group(values.shape[-1])
        scale, zero = int4_scale_zero(values, g)
        parts = ((cache.data, int4_encode(values, scale, zero, g)),
                 (cache.scale, scale), (cache.zero, zero))
    elif fmt.scale_per == "token_head":
        scale = fp8_scale(values, "token_head")
        parts = ((cache.data, fp8_encode(values, scale)), (cache.scale, scale))
    else:
        parts = ((cache.data, fp8_encode(values, cache.scale)),)
    for target, new in parts:
        if target.dtype == FP8_DTYPE:  # NOTE: index_copy_ has no float8 kernel on every device
            target, new = target.view(torch.uint8), new.view(torch.uint8)
        target.flatten(0, 1).index_copy_(0, slots, new)


def check_tensor_scale(scale, device, name: str = "scale") -> torch.Tensor:
    """A per-tensor fp8 scale, checked.

    Args:
        scale: a positive finite real number (Python or NumPy scalar) or a one-element tensor.
        device: where the returned tensor lives.
        name: the argument's name, for the messages.

    Returns:
        0-d float32 tensor on ``device``.

    Raises:
        TypeError: not a number or tensor (a bool is not a scale).
        ValueError: more than one number, or not positive and finite.
    """
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.Tensor)):
        raise TypeError(f"{name} must be a float or a 0-d tensor, got {type(scale).__name__}")
    s = torch.as_tensor(scale, dtype=torch.float32).to(device)
    if s.numel() != 1:
        raise ValueError(f"{name} must be one number, got shape {tuple(s.shape)}")
    s = s.reshape(())
    value = float(s)
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return s


__all__ = ["check_tensor_scale", "quantize", "write_slots"]
