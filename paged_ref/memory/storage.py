"""Paged K/V storage: the tensors that the block tables point into.

One K tensor and one V tensor per layer, each in the layout of docs/contract.md::

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
tokens as they enter, ``gather`` de-quantises, ``layer`` returns the pair that
``paged_attention`` takes as it is, and ``copy_blocks`` copies codes and scales together.
"""

from __future__ import annotations

import torch

from paged_ref.cache_math import blocks_needed, kv_bytes_per_token, token_slots
from paged_ref.memory.allocator import check_int
from paged_ref.quant import FP8_DTYPE, KVFormat, QuantizedKV, check_tensor_scale, write_slots
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
        k_scale, v_scale: fp8 per tensor only: every layer's K and V scale (floats; as vLLM,
            default 1.0; calibrate as ``amax / 448``). Values beyond ``448 * scale`` saturate.
        num_host_blocks: blocks of a host tier for the prefix cache's spills (0 = none):
            ``host_kv``, ``[num_host_blocks, 2, num_layers, block_size, Hkv, D]`` in CPU memory
            (each host block one contiguous piece: K and V of all layers), pinned when CUDA is
            available, so each block crosses PCIe as one direct copy.
        disk_tier: the :class:`~paged_ref.memory.disk_tier.DiskTier` under the host tier (the
            manager's; needs ``num_host_blocks > 0``, its ``block_shape`` and ``dtype`` this
            cache's): :meth:`apply_block_ops` writes the blocks moved down into its file.

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
        num_host_blocks: int = 0,
        kv_format: str | KVFormat | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        disk_tier=None,
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
        self.num_host_blocks = check_int("num_host_blocks", num_host_blocks)
        # One tensor [2 (K, V), num_layers, num_blocks, block_size, Hkv, D]; each layer's K and
        # V are contiguous views of it, so one indexed copy moves a block in every layer.
        # Quantised: one such tensor per part (codes, scales, zeros), see _quantised_parts.
        shape = (2, num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        if self.kv_format is None:
            self.kv = torch.zeros(shape, dtype=dtype, device=device)
            self.parts = [self.kv]
            self.k_caches: list = list(self.kv[0].unbind(0))
            self.v_caches: list = list(self.kv[1].unbind(0))
        else:
            self.kv = None
            self.parts = self._quantised_parts(shape, device, k_scale, v_scale)
            self.k_caches, self.v_caches = (
                [QuantizedKV(*(p[kv, i] if p is not None else None for p in self.parts),
                             self.kv_format) for i in range(num_layers)] for kv in (0, 1))
        self.device = self.parts[0].device  # "cuda" resolved to "cuda:0"
        self.host_kv = torch.zeros(
            (self.num_host_blocks, 2, num_layers, block_size, num_kv_heads, head_dim),
            dtype=dtype, pin_memory=torch.cuda.is_available() and self.num_host_blocks > 0)
        host_block = tuple(self.host_kv.shape[1:])
        if disk_tier is not None and not (self.num_host_blocks and disk_tier.dtype == dtype
                                          and disk_tier.block_shape == host_block):
            raise ValueError(f"disk_tier must hold this cache's host blocks (num_host_blocks > 0, "
                             f"block_shape {host_block}, dtype {dtype}), got {disk_tier!r}")
        self.disk_tier = disk_tier
        self._resume: tuple = (None, 0)  # (ops, the move it raised in): apply_block_ops

    @property
    def num_slots(self) -> int:
        """Token slots per layer: ``num_blocks * block_size``."""
        return self.num_blocks * self.block_size

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes over all layers, K and V:
        ``2 * num_layers * num_kv_heads * head_dim * element_size``.
        Quantised: codes and per-token scales (:func:`~paged_ref.cache_math.kv_bytes_per_token`
        of the ``kv_format``)."""
        stored_as = self.k_caches[0].element_size() if self.kv_format is None else self.kv_format
        return kv_bytes_per_token(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                                  head_dim=self.head_dim, dtype=stored_as)

    @property
    def nbytes(self) -> int:
        """Bytes of all K and V tensors (codes and scales when quantised)."""
        return sum(p.nbytes for p in self.parts if p is not None)

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
            k, v: ``[seq_len, num_kv_heads, head_dim]`` in the cache's dtype.
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

    def copy_blocks(self, pairs) -> None:
        """Copy block ``src`` to block ``dst`` for each ``(src, dst)`` in ``pairs``, in every
        layer's K and V: one batched gather + scatter on the cache's device (what
        ``KVCacheManager.take_copies()`` returns after copy-on-writes). An empty list does
        nothing. All sources are read before any destination is written.

        Raises:
            TypeError: ``pairs`` is not a list/tuple of ``(int, int)`` pairs.
            ValueError: an id outside ``[0, num_blocks)``, a pair copying a block onto
                itself, or two pairs writing the same ``dst``. Nothing is copied then.
        """
        src, dst = self._pairs(pairs, self.num_blocks, self.num_blocks, same_pool=True)
        if src:
            src, dst = self._index(src), self._index(dst)
            for part in self.parts:  # values, or codes and per-token scales alike
                if part is not None and part.dim() > 2:  # (a per-tensor scale has no blocks)
                    part = part.view(torch.uint8) if part.dtype == FP8_DTYPE else part
                    part[:, :, dst] = part[:, :, src]

    def swap_out(self, pairs) -> None:
        """Copy device block ``src`` to host slot ``dst`` for each ``(src, dst)``, every layer's
        K and V (a spill of an evicted cached block). Same checks as :meth:`copy_blocks`."""
        src, dst = self._pairs(pairs, self.num_blocks, self.num_host_blocks)
        if src:  # one gather on the device, then one contiguous copy per block
            staged = self.kv[:, :, self._index(src)].permute(2, 0, 1, 3, 4, 5).contiguous()
            for i, slot in enumerate(dst):
                self.host_kv[slot].copy_(staged[i], non_blocking=True)

    def swap_in(self, pairs) -> None:
        """Copy host slot ``src`` to device block ``dst`` for each ``(src, dst)``, every layer's
        K and V (a prefix-cache hit in the host tier). Same checks as :meth:`copy_blocks`."""
        src, dst = self._pairs(pairs, self.num_host_blocks, self.num_blocks)
        self._scatter_in([self.host_kv[slot] for slot in src], dst)

    def swap_in_blocks(self, pairs) -> None:
        """Copy ``block`` into device block ``dst`` for each ``(block, dst)``, every layer's K
        and V: ``block`` is a CPU tensor ``[2, num_layers, block_size, Hkv, D]`` of this
        cache's dtype (a prefix-cache hit read back from the disk tier). Checks ``dst`` as
        :meth:`copy_blocks` does, and each block's shape and dtype (ValueError)."""
        blocks = [b for b, _ in pairs]
        # (the indices stand in for the sources: only the destinations are checked here)
        _, dst = self._pairs([(i, d) for i, (_, d) in enumerate(pairs)], len(pairs),
                             self.num_blocks)
        for i, b in enumerate(blocks):
            if tuple(b.shape) != tuple(self.host_kv.shape[1:]) or b.dtype != self.dtype:
                raise ValueError(f"pairs[{i}] block must be {tuple(self.host_kv.shape[1:])} of "
                                 f"{self.dtype}, got {tuple(b.shape)} of {b.dtype}")
        self._scatter_in(blocks, dst)

    def _scatter_in(self, blocks: list[torch.Tensor], dst: list[int]) -> None:
        """Host blocks ``[2, num_layers, block_size, Hkv, D]`` into device blocks ``dst``: one
        contiguous copy per block into a staging buffer, then one scatter."""
        if blocks:
            staged = torch.empty((len(blocks), *self.host_kv.shape[1:]), dtype=self.dtype,
                                 device=self.device)
            for i, block in enumerate(blocks):
                staged[i].copy_(block, non_blocking=True)
            self.kv[:, :, self._index(dst)] = staged.permute(1, 2, 0, 3, 4, 5)

    def _disk_moves(self, ops) -> None:
        """The disk tier's writes of ``ops`` (host slot -> disk slot, device block -> disk
        slot), before the other moves overwrite their sources; a failed write drops its hash
        (:meth:`DiskTier.write`)."""
        to_disk, device_to_disk = ops.to_disk, ops.device_to_disk
        if (to_disk or device_to_disk or ops.from_disk) and self.disk_tier is None:
            raise ValueError("ops move blocks to or from a disk tier but this cache has none "
                             "(PagedKVCache(..., disk_tier=...))")
        for slot, disk_slot in to_disk:
            self.disk_tier.write(disk_slot, self.host_kv[slot])
        if device_to_disk:  # one gather on the device, one copy to the host, then the writes
            blocks, disk_slots = zip(*device_to_disk, strict=True)
            staged = self.kv[:, :, self._index(list(blocks))].permute(2, 0, 1, 3, 4, 5)
            for disk_slot, block in zip(disk_slots, staged.contiguous().cpu(), strict=True):
                self.disk_tier.write(disk_slot, block)

    # ---- quantised storage ------------------------------------------------------------------

    def _quantised_parts(self, shape, device, k_scale, v_scale) -> list:
        """``[codes, scales, zeros or None]``, each ``[2 (K, V), num_layers, ...]``: codes as
        ``kv_format.data_shape``, scales as ``scale_shape`` (an fp8 per-tensor scale: one per
        layer, ``k_scale`` / ``v_scale``). All zero: a slot never written reads as 0."""
        fmt = self.kv_format
        fmt.check_head_dim(self.head_dim)
        if self.num_host_blocks:
            raise ValueError("num_host_blocks: the host tier holds plain caches only, not "
                             f"kv_format={fmt.name!r}")
        if fmt.scale_per != "tensor" and (k_scale != 1.0 or v_scale != 1.0):
            raise ValueError(f"k_scale/v_scale are for fp8 per tensor only; {fmt.name} computes "
                             "its scales as it writes")
        codes = torch.zeros((*shape[:2], *fmt.data_shape(shape[2:])), dtype=torch.uint8,
                            device=device).view(fmt.data_dtype)
        if fmt.scale_per == "tensor":
            scales = torch.stack([check_tensor_scale(k_scale, device, "k_scale"),
                                  check_tensor_scale(v_scale, device, "v_scale")])
            scales = scales[:, None].repeat(1, shape[1])  # [2, num_layers]
        else:
            scales = torch.zeros((*shape[:2], *fmt.scale_shape(shape[2:])),
                                 dtype=fmt.scale_dtype, device=device)
        zeros = torch.zeros_like(scales) if fmt.kind == "int4" else None
        return [codes, scales, zeros]

    def _rows(self, cache, slots: torch.Tensor) -> torch.Tensor:
        """Rows ``slots`` of a layer's cache, in the cache's dtype."""
        if isinstance(cache, QuantizedKV):
            return cache.take_slots(slots).dequantize(self.dtype)
        return cache.flatten(0, 1)[slots]

    def apply_block_ops(self, ops) -> None:
        """Run what ``KVCacheManager.take_block_ops()`` returned: writes to the disk tier,
        spills to the host, copies back from the disk and the host, then copy-on-writes (that
        order: a block moved down may be reused as the destination of the others). Run again
        on the same ``ops`` after it raised, it resumes at the kind of move that raised (a
        spill run again after a copy back into its block would spill the new K/V)."""
        moves = [(self._disk_moves, ops), (self.swap_out, ops.swap_out),
                 (self.swap_in_blocks, ops.from_disk), (self.swap_in, ops.swap_in),
                 (self.copy_blocks, ops.copies)]
        done = self._resume[1] if self._resume[0] is ops else 0
        for i, (move, pairs) in enumerate(moves[done:], done):
            self._resume = (ops, i)  # (until it returns)
            move(pairs)
        self._resume = (None, 0)

    # ---- argument checks

    def _index(self, ids: list[int]) -> torch.Tensor:
        return torch.tensor(ids, dtype=torch.long, device=self.device)

    @staticmethod
    def _pairs(pairs, num_src: int, num_dst: int, *, same_pool: bool = False):
        """Checked ``(src, dst)`` pairs as two lists of ids."""
        if not isinstance(pairs, (list, tuple)):
            raise TypeError(f"pairs must be a list of (src, dst) pairs, got {type(pairs).__name__}")
        src, dst = [], []
        for i, pair in enumerate(pairs):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise TypeError(f"pairs[{i}] must be a (src, dst) pair, got {pair!r}")
            for name, block_id, out, limit in (("src", pair[0], src, num_src),
                                               ("dst", pair[1], dst, num_dst)):
                block_id = check_int(f"pairs[{i}] {name}", block_id)
                if block_id >= limit:
                    raise ValueError(f"pairs[{i}] {name} = {block_id} is outside [0, {limit})")
                out.append(block_id)
            if same_pool and src[-1] == dst[-1]:
                raise ValueError(f"pairs[{i}] copies block {src[-1]} onto itself")
        if len(set(dst)) != len(dst):
            raise ValueError(f"pairs writes a destination block twice: {list(pairs)!r}")
        return src, dst

    # ---- checks of single arguments -----------------------------------------------------

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
            raise TypeError(f"{name} must be a list of ints or a 1-D integer tensor, got "
                            f"{type(values).__name__}")
        return [check_int(f"{name}[{i}]", x, minimum=None) for i, x in enumerate(values)]

    def _slots(self, slot_mapping, num_tokens: int) -> torch.Tensor:
        """Checked ``slot_mapping`` as a long tensor on the cache's device."""
        slots = self._int_list("slot_mapping", slot_mapping)
        if len(slots) != num_tokens:
            raise ValueError(f"slot_mapping has {len(slots)} entries but k and v have "
                             f"{num_tokens} tokens")
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
