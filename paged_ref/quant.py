"""Quantised KV caches: FP8 (e4m3) and INT4 codes plus the scales that give them meaning.

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
    kq = quantize(k_cache, fmt)                  # QuantizedKV
    k_back = dequantize(kq)                      # float32, same shape as k_cache
    paged_attention(q, kq, vq, block_tables, seq_lens)   # q: float16/bfloat16/float32
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Largest finite float8_e4m3fn value.
FP8_MAX = 448.0
#: Largest INT4 code (codes are unsigned, 0..15).
INT4_MAX = 15
#: Element type of FP8 codes.
FP8_DTYPE = torch.float8_e4m3fn
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


# ---- FP8 ------------------------------------------------------------------------------------


def fp8_scale(x: torch.Tensor, per: str = "tensor") -> torch.Tensor:
    """float32 scale ``amax / 448`` over the whole tensor (0-d) or over the last dim
    (``per="token_head"``, shape ``x.shape[:-1]``); an all-zero slice gets scale 1."""
    a = x.detach().float().abs()
    amax = a.amax() if per == "tensor" else a.amax(dim=-1)
    # (A tensor divisor: on a GPU, torch divides by a Python number as a multiply by its
    # reciprocal, one ulp off IEEE division at times; this way every device, and the Triton
    # write kernel, computes the same scale.)
    return torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))


def fp8_encode(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Codes ``x / scale`` rounded to the nearest e4m3 value, saturating at +-448.

    ``scale``: 0-d, or ``x.shape[:-1]`` (one per vector). Returns float8_e4m3fn, ``x.shape``.
    (torch's cast turns values past 448 into NaN, hence the clamp.)
    """
    s = scale if scale.dim() == 0 else scale[..., None]
    return (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float32 ``scale * code`` (``scale`` 0-d or ``codes.shape[:-1]``)."""
    s = scale if scale.dim() == 0 else scale[..., None]
    return codes.float() * s


# ---- INT4 -----------------------------------------------------------------------------------


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes 0..15 ``[..., D]`` -> bytes ``[..., D // 2]``: byte ``i`` holds channel ``i``
    in its low nibble and channel ``i + D // 2`` in its high nibble (first half of the head low,
    second half high, so a kernel unpacks each half with one AND or one shift)."""
    half = codes.shape[-1] // 2
    return (codes[..., :half] | (codes[..., half:] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: bytes ``[..., D // 2]`` -> uint8 codes ``[..., D]``."""
    return torch.cat([packed & 0xF, packed >> 4], dim=-1)


def int4_scale_zero(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 ``(scale, zero)`` per group of ``group_size`` channels: ``zero = min``,
    ``scale = (max - min) / 15`` (at least 2^-24, so a constant group decodes exactly)."""
    g = x.detach().float().unflatten(-1, (-1, group_size))
    low, high = g.amin(dim=-1), g.amax(dim=-1)
    scale = ((high - low) / torch.full_like(high, INT4_MAX)).clamp(min=2.0**-24)  # (fp8_scale)
    return scale.to(torch.float16), low.to(torch.float16)


def int4_encode(
    x: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Packed codes ``round((x - zero) / scale)`` clamped to 0..15, ``[..., D // 2]`` uint8.

    Uses the float16 ``scale`` / ``zero`` as stored, so decoding reproduces the nearest code.
    """
    g = x.float().unflatten(-1, (-1, group_size))
    codes = torch.round((g - zero.float()[..., None]) / scale.float()[..., None])
    return pack_int4(codes.clamp(0, INT4_MAX).to(torch.uint8).flatten(-2))


def int4_decode(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> torch.Tensor:
    """float32 ``zero + scale * code`` per group, ``[..., D]``."""
    codes = unpack_int4(packed).float().unflatten(-1, (-1, group_size))
    return (zero.float()[..., None] + scale.float()[..., None] * codes).flatten(-2)


# ---- any format -----------------------------------------------------------------------------


def quantize(
    x: torch.Tensor, kv_format: str | KVFormat, *, scale: torch.Tensor | float | None = None
) -> QuantizedKV:
    """Quantise values ``x`` ``[..., head_dim]`` (float16/bfloat16/float32).

    ``scale``: fp8 per tensor only: the layer's scale (a float or 0-d tensor); default
    ``amax(|x|) / 448``. Every other format computes its scales from ``x``.
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
    if scale is None:
        s = fp8_scale(x, fmt.scale_per)
    else:
        s = check_tensor_scale(scale, x.device)
    return QuantizedKV(fp8_encode(x, s), s, None, fmt)


def dequantize(qkv: QuantizedKV, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values a :class:`QuantizedKV` stands for, in ``dtype``."""
    if not isinstance(qkv, QuantizedKV):
        raise TypeError(f"qkv must be a QuantizedKV, got {type(qkv).__name__}")
    fmt = qkv.format
    if fmt.kind == "fp8":
        return dequantize_fp8(qkv.data, qkv.scale).to(dtype)
    return int4_decode(qkv.data, qkv.scale, qkv.zero, fmt.group(qkv.shape[-1])).to(dtype)


def write_slots(cache: QuantizedKV, values: torch.Tensor, slots: torch.Tensor) -> None:
    """Quantise ``values`` ``[n, Hkv, D]`` and store them in rows ``slots`` (long ``[n]``, on
    the cache's device) of ``cache`` ``[num_blocks, block_size, Hkv, D]``: codes and per-token
    scales; an fp8 per-tensor scale is used as it is. Unchecked (the callers check), no value
    is read back, so it runs inside a CUDA graph."""
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
        if target.dtype == FP8_DTYPE:  # (index_copy_ has no float8 kernel on every device)
            target, new = target.view(torch.uint8), new.view(torch.uint8)
        target.flatten(0, 1).index_copy_(0, slots, new)


def check_tensor_scale(scale, device, name: str = "scale") -> torch.Tensor:
    """A per-tensor fp8 scale as a 0-d float32 tensor on ``device``; positive and finite."""
    if isinstance(scale, bool) or not isinstance(scale, (int, float, torch.Tensor)):
        raise TypeError(f"{name} must be a float or a 0-d tensor, got {type(scale).__name__}")
    s = torch.as_tensor(scale, dtype=torch.float32).to(device)
    if s.numel() != 1:
        raise ValueError(f"{name} must be one number, got shape {tuple(s.shape)}")
    s = s.reshape(())
    value = float(s)
    if not (value > 0 and value != float("inf")):
        raise ValueError(f"{name} must be positive and finite, got {value}")
    return s


def check_quantized_pair(q: torch.Tensor, k_cache, v_cache) -> KVFormat | None:
    """Checks for ``paged_attention``'s caches: both plain tensors (returns None), or both
    :class:`QuantizedKV` of one format (returns it), with q in a compute dtype.

    A bare float8 / uint8 tensor is a cache without its scales: TypeError naming it.
    """
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if isinstance(c, torch.Tensor) and c.dtype in (FP8_DTYPE, torch.uint8, torch.int8):
            raise TypeError(
                f"{name} is a bare {c.dtype} tensor: a quantised cache needs its scales; pass "
                f"paged_ref.QuantizedKV(data, scale, zero, format) (see paged_ref.quant)"
            )
    quantized = [isinstance(c, QuantizedKV) for c in (k_cache, v_cache)]
    if not any(quantized):
        return None
    if not all(quantized):
        plain = "v_cache" if quantized[0] else "k_cache"
        raise TypeError(f"{plain} must be a QuantizedKV too: k_cache and v_cache share a format")
    if k_cache.format != v_cache.format:
        raise TypeError(
            f"v_cache format {v_cache.format.name} must equal k_cache format {k_cache.format.name}"
        )
    if isinstance(q, torch.Tensor) and q.dtype not in COMPUTE_DTYPES:
        raise TypeError(f"q dtype must be one of {COMPUTE_DTYPES} with a quantised cache, "
                        f"got {q.dtype}")
    return k_cache.format


def kernels_read(cache) -> bool:
    """Whether the Triton kernels read this cache: any plain tensor or fp8 cache; an int4 cache
    when head_dim is a power of two >= 32 (two halves of >= 16 channels, for the dots)."""
    if not isinstance(cache, QuantizedKV) or cache.format.kind != "int4":
        return True
    head_dim = cache.shape[-1]
    return head_dim >= 32 and not head_dim & (head_dim - 1)


def check_kernel_format(k_cache) -> None:
    """ValueError for a quantised cache the Triton kernels cannot read (the torch backend can)."""
    if not kernels_read(k_cache):
        raise ValueError(
            f"k_cache: the Triton kernels read int4 caches with head_dim a power of two >= 32; "
            f"got head_dim {k_cache.shape[-1]} (use backend='torch')"
        )
