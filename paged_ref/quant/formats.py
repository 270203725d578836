"""What a quantised KV cache is: FP8 (e4m3) or INT4 codes plus the scales that decode them.

Decode reads every cached byte once per step, so a cache with fewer bytes per value is a
faster cache. Two formats, each described by a :class:`KVFormat`:

``fp8`` (``KVFormat.fp8(per="tensor")``, as vLLM's ``kv_cache_dtype="fp8"``)
    one byte per value, ``torch.float8_e4m3fn`` (1 sign, 4 exponent, 3 mantissa bits; finite
    values up to +-448, relative spacing 2^-3). ``x ~= scale * code``. The scale is one float32
    for the whole layer (``per="tensor"``: fixed before anything is written, e.g. calibrated
    as ``amax / 448``) or one per token and KV head (``per="token_head"``: ``amax / 448`` of
    that head's vector, computed as the token is written).

``int4`` (``KVFormat.int4()``: a pair per half head; ``KVFormat.int4(group_size)``)
    half a byte per value: unsigned codes ``0..15``, two a byte (byte ``i`` holds channel ``i``
    in its low nibble and channel ``i + head_dim / 2`` in its high nibble). Each group of
    ``group_size`` consecutive channels of one token-head has its own float16 ``scale`` and
    ``zero``: ``x ~= zero + scale * code`` (``zero`` is the group's minimum and
    ``scale = (max - min) / 15``: an asymmetric code). ``group_size`` is ``head_dim`` (one pair
    per token-head) or ``head_dim / 2`` (one per nibble half: the kernels then apply each
    scale to a whole half, never element by element).

A quantised cache and its scales travel together in a :class:`QuantizedKV`, which every
``paged_attention`` backend accepts in place of a ``k_cache`` / ``v_cache`` tensor:

=========  ==========================================  =====================================
format     ``data``                                    ``scale`` (``zero``)
=========  ==========================================  =====================================
fp8 tensor float8_e4m3fn ``[blocks, bs, Hkv, D]``       float32 ``[]`` (0-d)
fp8 token  float8_e4m3fn ``[blocks, bs, Hkv, D]``       float32 ``[blocks, bs, Hkv]``
int4       uint8 ``[blocks, bs, Hkv, D // 2]``          float16 ``[blocks, bs, Hkv, D // G]``
                                                       (``zero``: the same, float16)
=========  ==========================================  =====================================

    fmt = KVFormat.parse("int4")                 # or KVFormat.int4(); "int4_g128": one pair
    kq = quantize(k_cache, fmt)                  # QuantizedKV (paged_ref.quant.encode)
    k_back = dequantize(kq)                      # float32, same shape as k_cache
    paged_attention(q, kq, vq, block_tables, seq_lens)   # q: float16/bfloat16/float32
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_ref.quant.codes import FP8_DTYPE, dequantize_fp8, int4_decode

#: Formats by name, for ``KVFormat.parse`` (``int4_g32`` etc. pick other group sizes).
FORMAT_NAMES = ("fp8", "fp8_token_head", "int4", "int4_g<N>")
#: dtypes that quantised caches are written from and attended with (q's dtype).
COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class KVFormat:
    """How a K or V cache is stored.

    kind:       ``"fp8"`` (e4m3, one byte a value) or ``"int4"`` (half a byte a value).
    scale_per:  fp8: ``"tensor"`` (one scale per layer) or ``"token_head"``; int4: ``"group"``.
    group_size: int4 only: channels per (scale, zero) pair: head_dim or head_dim / 2;
                0 (the default, name ``"int4"``) means head_dim / 2 for any head_dim.
    """

    kind: str
    scale_per: str
    group_size: int = 0

    def __post_init__(self) -> None:
        allowed = {"fp8": ("tensor", "token_head"), "int4": ("group",)}
        if self.kind not in allowed:
            raise ValueError(f"kind must be 'fp8' or 'int4', got {self.kind!r}")
        if self.scale_per not in allowed[self.kind]:
            raise ValueError(
                f"scale_per for {self.kind} must be one of {allowed[self.kind]}, "
                f"got {self.scale_per!r}"
            )
        if self.kind == "int4":
            g = self.group_size
            if isinstance(g, bool) or not isinstance(g, int):
                raise TypeError(f"group_size must be an int, got {type(g).__name__}")
            if g < 0:
                raise ValueError(f"group_size must be >= 1 (or 0: half the head), got {g}")
        elif self.group_size:
            raise ValueError(f"group_size is for int4 only, got {self.group_size} for fp8")

    @staticmethod
    def fp8(per: str = "tensor") -> KVFormat:
        """FP8 e4m3 with one scale per layer (``"tensor"``) or per token-head."""
        return KVFormat("fp8", per)

    @staticmethod
    def int4(group_size: int = 0) -> KVFormat:
        """INT4, two codes a byte, a float16 (scale, zero) per ``group_size`` channels
        (0: per half head, whatever head_dim is)."""
        return KVFormat("int4", "group", group_size)

    @staticmethod
    def parse(name: str | KVFormat) -> KVFormat:
        """``"fp8"``, ``"fp8_token_head"``, ``"int4"`` (a pair per half head) or ``"int4_g32"``
        (a pair per 32 channels) etc."""
        if isinstance(name, KVFormat):
            return name
        if not isinstance(name, str):
            raise TypeError(f"kv_format must be a str or KVFormat, got {type(name).__name__}")
        if name == "fp8":
            return KVFormat.fp8("tensor")
        if name == "fp8_token_head":
            return KVFormat.fp8("token_head")
        if name == "int4":
            return KVFormat.int4()
        if name.startswith("int4_g") and name[6:].isdigit() and int(name[6:]) > 0:
            return KVFormat.int4(int(name[6:]))
        raise ValueError(f"kv_format must be one of {FORMAT_NAMES}, got {name!r}")

    @property
    def name(self) -> str:
        """The name :meth:`parse` reads back."""
        if self.kind == "fp8":
            return "fp8" if self.scale_per == "tensor" else "fp8_token_head"
        return "int4" if self.group_size == 0 else f"int4_g{self.group_size}"

    @property
    def data_dtype(self) -> torch.dtype:
        """Element type of the codes: float8_e4m3fn or uint8 (two INT4 codes a byte)."""
        return FP8_DTYPE if self.kind == "fp8" else torch.uint8

    def group(self, head_dim: int) -> int:
        """int4: channels per (scale, zero) pair for this head_dim."""
        return self.group_size or head_dim // 2

    def check_head_dim(self, head_dim: int) -> None:
        """ValueError unless ``head_dim`` can be stored in this format (int4: group_size is
        head_dim or head_dim / 2)."""
        if self.kind == "int4" and (head_dim % 2 or self.group(head_dim) not in (
                head_dim, head_dim // 2)):
            raise ValueError(
                f"int4 needs an even head_dim and group_size = head_dim or head_dim / 2 (the "
                f"two nibble halves of a byte); got head_dim {head_dim}, group_size "
                f"{self.group_size}"
            )

    def bytes_per_token_head(self, head_dim: int) -> float:
        """Bytes one token's K (or V) of one KV head takes, scales included.

        fp8 tensor: ``head_dim`` (the layer's one scale is not counted per token);
        fp8 token_head: ``head_dim + 4``; int4: ``head_dim / 2 + 4 * head_dim / group_size``.
        """
        if self.kind == "fp8":
            return head_dim + (4 if self.scale_per == "token_head" else 0)
        return head_dim / 2 + 4 * head_dim / self.group(head_dim)

    def data_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of ``data`` for values of ``shape`` (last dim = head_dim)."""
        return (*shape[:-1], shape[-1] // 2) if self.kind == "int4" else tuple(shape)

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of ``scale`` (and int4's ``zero``) for values of ``shape``."""
        if self.kind == "int4":
            return (*shape[:-1], shape[-1] // self.group(shape[-1]))
        return tuple(shape[:-1]) if self.scale_per == "token_head" else ()

    @property
    def scale_dtype(self) -> torch.dtype:
        """float32 for fp8 scales, float16 for int4's scale and zero."""
        return torch.float16 if self.kind == "int4" else torch.float32


@dataclass(frozen=True, eq=False)
class QuantizedKV:
    """Quantised K (or V) values and the scales that decode them; see the module docstring.

    data:   codes, ``format.data_shape(shape)``, ``format.data_dtype``.
    scale:  ``format.scale_shape(shape)``, ``format.scale_dtype``.
    zero:   int4 only (else None): like ``scale``.
    format: the :class:`KVFormat`.

    ``shape`` is the shape of the values it stands for (``[..., head_dim]``); ``device``,
    ``dim()`` and ``is_contiguous()`` answer as for a tensor of that shape. Constructing one
    checks every part: a TypeError or ValueError names the part that is wrong.
    """

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    format: KVFormat

    def __post_init__(self) -> None:
        fmt = self.format
        if not isinstance(fmt, KVFormat):
            raise TypeError(f"format must be a KVFormat, got {type(fmt).__name__}")
        if not isinstance(self.data, torch.Tensor):
            raise TypeError(f"data must be a torch.Tensor, got {type(self.data).__name__}")
        if self.data.dtype != fmt.data_dtype:
            raise TypeError(f"data for {fmt.name} must be {fmt.data_dtype}, got {self.data.dtype}")
        if self.data.dim() < 1:
            raise ValueError("data must have at least one dimension (head_dim)")
        fmt.check_head_dim(self.shape[-1])
        parts = [("scale", self.scale)] + ([("zero", self.zero)] if fmt.kind == "int4" else [])
        if fmt.kind == "fp8" and self.zero is not None:
            raise ValueError("zero is for int4 only; fp8 caches have zero=None")
        want_shape = fmt.scale_shape(self.shape)
        for name, t in parts:
            if not isinstance(t, torch.Tensor):
                raise TypeError(
                    f"{name} must be a {fmt.scale_dtype} tensor of shape {want_shape} for "
                    f"{fmt.name}, got {type(t).__name__}"
                )
            if t.dtype != fmt.scale_dtype:
                raise TypeError(f"{name} for {fmt.name} must be {fmt.scale_dtype}, got {t.dtype}")
            if tuple(t.shape) != want_shape:
                raise ValueError(
                    f"{name} for {fmt.name} must have shape {want_shape} (data shape "
                    f"{tuple(self.data.shape)}), got {tuple(t.shape)}"
                )
            if t.device != self.data.device:
                raise ValueError(f"{name} is on {t.device} but data is on {self.data.device}")

    @property
    def shape(self) -> torch.Size:
        """Shape of the values: ``data``'s, with the last dim = head_dim."""
        d = self.data.shape
        return torch.Size((*d[:-1], d[-1] * 2)) if self.format.kind == "int4" else d

    @property
    def device(self) -> torch.device:
        return self.data.device

    def dim(self) -> int:
        return self.data.dim()

    def is_contiguous(self) -> bool:
        """True when data, scale (and zero) are all contiguous."""
        return all(t.is_contiguous() for t in self.tensors())

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """``(data, scale)`` or ``(data, scale, zero)``."""
        return (self.data, self.scale) if self.zero is None else (self.data, self.scale, self.zero)

    @property
    def nbytes(self) -> int:
        """Bytes of codes and scales."""
        return sum(t.nbytes for t in self.tensors())

    def take_slots(self, slots: torch.Tensor) -> QuantizedKV:
        """Rows ``slots`` (any shape, long) of a cache ``[num_blocks, block_size, ...]`` seen as
        ``[num_slots, ...]``: codes and per-token scales taken alike, a per-tensor scale kept."""
        data, scale, zero = (t if t is None or t.dim() == 0 else t.flatten(0, 1)[slots]
                             for t in (self.data, self.scale, self.zero))
        return QuantizedKV(data, scale, zero, self.format)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The values, ``shape``, in ``dtype``."""
        return dequantize(self, dtype)

    def __repr__(self) -> str:
        return f"QuantizedKV({self.format.name}, shape={tuple(self.shape)}, device={self.device})"


def dequantize(qkv: QuantizedKV, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values a quantised cache stands for.

    Args:
        qkv: a :class:`QuantizedKV` of values ``shape``.
        dtype: the result's dtype.

    Returns:
        ``qkv.shape`` values in ``dtype`` (computed in float32).

    Raises:
        TypeError: ``qkv`` is not a QuantizedKV.
    """
    if not isinstance(qkv, QuantizedKV):
        raise TypeError(f"qkv must be a QuantizedKV, got {type(qkv).__name__}")
    fmt = qkv.format
    if fmt.kind == "fp8":
        return dequantize_fp8(qkv.data, qkv.scale).to(dtype)
    return int4_decode(qkv.data, qkv.scale, qkv.zero, fmt.group(qkv.shape[-1])).to(dtype)


__all__ = ["COMPUTE_DTYPES", "FORMAT_NAMES", "KVFormat", "QuantizedKV", "dequantize"]
