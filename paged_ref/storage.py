"""Paged K/V storage: the tensors that the block tables point into.

One K tensor and one V tensor per layer, each in the layout of DESIGN.md::

    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]

Flattening the first two dimensions gives ``[num_blocks * block_size, num_kv_heads, head_dim]``,
one row per *slot*: slot ``block_id * block_size + offset`` holds one token's K (or V) for all
KV heads. :meth:`PagedKVCache.write` scatters new tokens into slots (what a model's attention
layer does after computing K and V); :meth:`PagedKVCache.gather` reads a sequence back in
token order through its block table (what the reference attention does).

    cache = PagedKVCache(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=16)
    cache.write(0, k, v, manager.slot_mapping("a"))       # k, v: [tokens, 2, 16]
    k_a, v_a = cache.gather(0, manager.block_table("a"), manager.seq_len("a"))

With ``kv_format="fp8"`` / ``"fp8_token_head"`` / ``"int4"`` (see :mod:`paged_ref.quant`) each
layer's K and V are :class:`~paged_ref.QuantizedKV` (codes + scales): ``write`` quantises the
tokens as they enter, ``gather`` de-quantises, and ``layer`` returns the pair that
``paged_attention`` takes as it is.
"""

from __future__ import annotations

import torch

from paged_ref.allocator import check_int
from paged_ref.cache_math import blocks_needed, token_slots
from paged_ref.quant import KVFormat, QuantizedKV, check_tensor_scale, quantize, write_slots
from paged_ref.validation import CACHE_DTYPES


class PagedKVCache:
    """Per-layer K and V caches of ``num_blocks`` blocks of ``block_size`` tokens.

    Args:
        num_layers: transformer layers (one K and one V tensor each).
        num_blocks, block_size: the pool's shape, as in :class:`paged_ref.KVCacheManager`.
        num_kv_heads, head_dim: per-token K/V shape.
        dtype: float16 (default), bfloat16 or float32: the dtype of the K/V that ``write``
            takes, ``gather`` returns and ``q`` has.
        device: where the tensors live.
        kv_format: None (store ``dtype`` values) or a quantised format: ``"fp8"``,
            ``"fp8_token_head"``, ``"int4"``, ``"int4_g32"``... or a :class:`KVFormat`.
        k_scale, v_scale: fp8 per tensor only: each layer's K and V scale (floats; as vLLM,
            default 1.0; calibrate as ``amax / 448``). Values beyond ``448 * scale`` saturate.

    The tensors start as zeros, so a slot never written reads as 0 (deterministic, easy to
    draw). Tests and lessons write fresh random K/V before reading anything.
    ``write`` needs K/V in the cache's dtype; it never casts silently (call ``.to(dtype)``).
    """

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cpu",
        kv_format: str | KVFormat | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
    ) -> None:
        num_layers = self.num_layers = check_int("num_layers", num_layers, minimum=1)
        num_blocks = self.num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        block_size = self.block_size = check_int("block_size", block_size, minimum=1)
        num_kv_heads = self.num_kv_heads = check_int("num_kv_heads", num_kv_heads, minimum=1)
        head_dim = self.head_dim = check_int("head_dim", head_dim, minimum=1)
        if dtype not in CACHE_DTYPES:
            raise TypeError(f"dtype must be one of {CACHE_DTYPES}, got {dtype!r}")
        self.dtype = dtype
        self.kv_format = None if kv_format is None else KVFormat.parse(kv_format)
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        if self.kv_format is None:
            self.k_caches: list = [torch.zeros(shape, dtype=dtype, device=device)
                                   for _ in range(num_layers)]
            self.v_caches: list = [torch.zeros(shape, dtype=dtype, device=device)
                                   for _ in range(num_layers)]
        else:
            self.kv_format.check_head_dim(head_dim)
            if self.kv_format.scale_per != "tensor" and (k_scale != 1.0 or v_scale != 1.0):
                raise ValueError(f"k_scale/v_scale are for fp8 per tensor only; "
                                 f"{self.kv_format.name} computes its scales as it writes")
            scales = (check_tensor_scale(k_scale, device, "k_scale"),
                      check_tensor_scale(v_scale, device, "v_scale"))
            zeros = torch.zeros(shape, dtype=dtype, device=device)
            self.k_caches, self.v_caches = (
                [self._quantize(zeros, s) for _ in range(num_layers)] for s in scales)
        self.device = self._parts(self.k_caches[0])[0].device  # "cuda" resolved to "cuda:0"

    @property
    def num_slots(self) -> int:
        """Token slots per layer: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes over all layers, K and V:
        ``2 * num_layers * num_kv_heads * head_dim * element_size``.
        Quantised: ``2 * num_layers * num_kv_heads * kv_format.bytes_per_token_head``
        (codes and per-token scales; a per-tensor scale is not counted)."""
        if self.kv_format is not None:
            per_head = self.kv_format.bytes_per_token_head(self.head_dim)
            return int(2 * self.num_layers * self.num_kv_heads * per_head)
        element = self.k_caches[0].element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * element

    @property
    def nbytes(self) -> int:
        """Bytes of all K and V tensors (codes and scales when quantised)."""
        return sum(t.nbytes for c in self.k_caches + self.v_caches for t in self._parts(c))

    def layer(self, layer: int) -> tuple:
        """``(k_cache, v_cache)`` of ``layer``, each ``[num_blocks, block_size, Hkv, D]``
        (tensors, or :class:`~paged_ref.QuantizedKV` when the cache is quantised)."""
        self._check_layer(layer)
        return self.k_caches[layer], self.v_caches[layer]

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping) -> None:
        """Store token ``i``'s K and V in slot ``slot_mapping[i]`` of ``layer``.

        Args:
            k, v: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype and device;
                quantised on the way in when the cache has a ``kv_format``.
            slot_mapping: ``num_tokens`` distinct slots in ``[0, num_blocks * block_size)``,
                a list of ints or a 1-D integer tensor.

        Raises ``TypeError``/``ValueError`` naming the argument; nothing is written then.
        """
        self._check_layer(layer)
        expected = f"[num_tokens, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}]"
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor {expected}, got {type(t).__name__}")
            if t.dim() != 3 or tuple(t.shape[1:]) != (self.num_kv_heads, self.head_dim):
                raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise TypeError(
                    f"{name} dtype {t.dtype} must match the cache dtype {self.dtype} "
                    f"(call {name}.to({self.dtype}))"
                )
            if t.device != self.device:
                raise ValueError(f"{name} is on {t.device} but the cache is on {self.device}")
        if v.shape != k.shape:
            raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
        slots = self._slots(slot_mapping, k.shape[0])
        for cache, new in ((self.k_caches[layer], k), (self.v_caches[layer], v)):
            if isinstance(cache, QuantizedKV):
                write_slots(cache, new, slots)  # quantised on the way in
            else:
                cache.flatten(0, 1)[slots] = new

    def gather(
        self, layer: int, block_table, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of tokens ``0 .. seq_len-1`` of one sequence, in token order (copies).

        Args:
            block_table: the sequence's block ids (a list or 1-D integer tensor); entries past
                ``ceil(seq_len / block_size)`` are ignored.
            seq_len: tokens to read.

        Returns:
            k, v: ``[seq_len, num_kv_heads, head_dim]`` in the cache's dtype (de-quantised
            when the cache is quantised).
        """
        self._check_layer(layer)
        seq_len = check_int("seq_len", seq_len)
        table = self._int_list("block_table", block_table)
        used = blocks_needed(seq_len, self.block_size)
        if used > len(table):
            raise ValueError(
                f"seq_len {seq_len} needs {used} blocks of {self.block_size} tokens but "
                f"block_table has {len(table)}"
            )
        for j, block_id in enumerate(table[:used]):
            if not 0 <= block_id < self.num_blocks:
                raise ValueError(
                    f"block_table[{j}] = {block_id} is outside [0, num_blocks={self.num_blocks})"
                )
        slots = torch.tensor(
            token_slots(table, seq_len, self.block_size), dtype=torch.long, device=self.device
        )
        return tuple(self._rows(c, slots) for c in (self.k_caches[layer], self.v_caches[layer]))

    # ---- quantised storage ------------------------------------------------------------------

    def _quantize(self, values: torch.Tensor, tensor_scale: torch.Tensor) -> QuantizedKV:
        """``values`` in the cache's format (fp8 per tensor uses the layer's fixed scale)."""
        scale = tensor_scale if self.kv_format.scale_per == "tensor" else None
        return quantize(values, self.kv_format, scale=scale)

    @staticmethod
    def _parts(cache) -> tuple[torch.Tensor, ...]:
        return cache.tensors() if isinstance(cache, QuantizedKV) else (cache,)

    def _rows(self, cache, slots: torch.Tensor) -> torch.Tensor:
        """Rows ``slots`` of a layer's cache, in the cache's dtype."""
        if isinstance(cache, QuantizedKV):
            return cache.take_slots(slots).dequantize(self.dtype)
        return cache.flatten(0, 1)[slots]

    # ---- argument checks --------------------------------------------------------------------

    def _check_layer(self, layer) -> None:
        check_int("layer", layer, minimum=None)
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"layer {layer} is outside [0, num_layers={self.num_layers})")

    @staticmethod
    def _int_list(name: str, values) -> list[int]:
        """A list of ints from a list/tuple of ints or a 1-D integer tensor."""
        if isinstance(values, torch.Tensor):
            if values.dim() != 1:
                raise ValueError(f"{name} must be 1-D, got shape {tuple(values.shape)}")
            if values.dtype.is_floating_point or values.dtype.is_complex or (
                values.dtype == torch.bool
            ):
                raise TypeError(f"{name} must hold integers, got dtype {values.dtype}")
            return [int(x) for x in values.tolist()]
        if not isinstance(values, (list, tuple)):
            raise TypeError(
                f"{name} must be a list of ints or a 1-D integer tensor, "
                f"got {type(values).__name__}"
            )
        return [check_int(f"{name}[{i}]", x, minimum=None) for i, x in enumerate(values)]

    def _slots(self, slot_mapping, num_tokens: int) -> torch.Tensor:
        """Checked ``slot_mapping`` as a long tensor on the cache's device."""
        slots = self._int_list("slot_mapping", slot_mapping)
        if len(slots) != num_tokens:
            raise ValueError(
                f"slot_mapping has {len(slots)} entries but k and v have {num_tokens} tokens"
            )
        for i, s in enumerate(slots):
            if not 0 <= s < self.num_slots:
                raise ValueError(
                    f"slot_mapping[{i}] = {s} is outside [0, num_blocks * block_size = "
                    f"{self.num_slots})"
                )
        if len(set(slots)) != len(slots):
            seen: set[int] = set()
            dup = next(s for s in slots if s in seen or seen.add(s))
            raise ValueError(f"slot_mapping writes slot {dup} more than once")
        return torch.tensor(slots, dtype=torch.long, device=self.device)

    def __repr__(self) -> str:
        return (
            f"PagedKVCache(num_layers={self.num_layers}, num_blocks={self.num_blocks}, "
            f"block_size={self.block_size}, num_kv_heads={self.num_kv_heads}, "
            f"head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}"
            + (f", kv_format={self.kv_format.name!r})" if self.kv_format else ")")
        )
