"""Fresh random paged-attention inputs, built the way a serving engine leaves its cache.

Tests, notebooks and the benchmark all draw inputs here, so every kernel is checked on the
same kinds of traps: ragged lengths, shuffled physical blocks, garbage in unused table entries
and in the unused slots of the cache (random large values, or NaN), never ``arange`` or zeros.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import torch

from paged_ref.cache_math import blocks_needed, kv_bytes_per_token, tokens_in_block
from paged_ref.quant import KVFormat, QuantizedKV, quantize
from paged_ref.reference import gather_kv, paged_attention_reference

#: Values written into cache slots that no sequence owns: a kernel that reads them gives
#: visibly wrong numbers ("large") or NaN ("nan").
POISON_VALUES = ("large", "nan")


@dataclass
class PagedInputs:
    """One decode step's inputs in the layout of docs/contract.md.

    q:            [batch, num_q_heads, head_dim]
    k_cache:      [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache:      same as k_cache
    block_tables: [batch, max_blocks_per_seq] int32; entries past a sequence's blocks are garbage
    seq_lens:     [batch] int32
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        """Positional arguments for ``paged_attention``."""
        return self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens

    def reference(self, scale: float | None = None) -> torch.Tensor:
        """The float64 answer, [batch, num_q_heads, head_dim]."""
        return paged_attention_reference(*self.args(), scale=scale)

    @property
    def kv_bytes(self) -> int:
        """Bytes of K and V that a decode step must read: every cached token, both caches
        (codes and per-token scales for a quantised cache)."""
        _, _, num_kv_heads, head_dim = self.k_cache.shape
        quantized = isinstance(self.k_cache, QuantizedKV)
        per_token = kv_bytes_per_token(
            num_layers=1, num_kv_heads=num_kv_heads, head_dim=head_dim,
            dtype=self.k_cache.format if quantized else self.k_cache.element_size())
        return int(self.seq_lens.sum().item()) * per_token

    def quantized(self, kv_format: str | KVFormat) -> PagedInputs:
        """The same inputs with K and V stored in ``kv_format`` (q unchanged). An fp8
        per-tensor scale is ``amax / 448`` of the cached tokens (unused slots ignored)."""
        fmt = KVFormat.parse(kv_format)
        caches = []
        for cache in (self.k_cache, self.v_cache):
            scale = None
            if fmt.scale_per == "tensor":
                max_len = int(self.seq_lens.max()) if self.seq_lens.numel() else 0
                k, _, valid = gather_kv(cache, cache, self.block_tables, self.seq_lens, max_len)
                amax = k[valid].abs().amax() if valid.any() else torch.tensor(0.0)
                scale = float(amax) / 448.0 if amax > 0 else 1.0
            caches.append(quantize(cache, fmt, scale=scale))
        return PagedInputs(self.q, caches[0], caches[1], self.block_tables, self.seq_lens)


def make_paged_inputs(
    seq_lens: list[int],
    *,
    num_q_heads: int = 8,
    num_kv_heads: int = 2,
    head_dim: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
    spare_columns: int = 1,
    poison: str = "large",
) -> PagedInputs:
    """Random decode inputs for sequences of the given lengths.

    Physical blocks are handed out in a shuffled order (so a kernel that ignores the table
    fails), ``spare_blocks`` blocks belong to no sequence, and each table row has
    ``spare_columns`` extra entries. Unused table entries hold -1, huge values and
    random ids. Slots no sequence owns hold ``poison`` ("large": values around 1e3;
    "nan": NaN).
    """
    if poison not in POISON_VALUES:
        raise ValueError(f"poison must be one of {POISON_VALUES}, got {poison!r}")
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)  # draw on the target device
    lens = [int(n) for n in seq_lens]
    blocks_per_seq = [blocks_needed(n, block_size) for n in lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    width = max(blocks_per_seq, default=0) + spare_columns
    batch = len(lens)

    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen, device=device)
    v = torch.randn(shape, generator=gen, device=device)
    q = torch.randn(batch, num_q_heads, head_dim, generator=gen, device=device)

    # Garbage everywhere first, then the real block ids in a shuffled order.
    garbage = torch.randint(-(2**31), 2**31 - 1, (batch, max(width, 1)), generator=gen,
                            device=device)
    garbage[:, ::3] = -1
    garbage[:, 1::3] = num_blocks + torch.randint(0, 2**20, (batch, 1), generator=gen,
                                                  device=device)
    table = garbage[:, :width].clone()
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=device)
    order = torch.randperm(num_blocks, generator=gen, device=device)
    next_block = 0
    for b, (n, nb) in enumerate(zip(lens, blocks_per_seq, strict=True)):
        ids = order[next_block : next_block + nb]
        next_block += nb
        table[b, :nb] = ids
        if nb:
            owned[ids[:-1]] = True  # full blocks
            owned[ids[-1], : tokens_in_block(n, nb - 1, block_size)] = True  # last, maybe partial

    fill = float("nan") if poison == "nan" else 1e3
    poison_k = torch.rand(shape, generator=gen, device=device) * fill
    poison_v = torch.rand(shape, generator=gen, device=device) * fill
    free = ~owned[:, :, None, None]
    k = torch.where(free, poison_k, k)
    v = torch.where(free, poison_v, v)

    def put(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype).contiguous()

    return PagedInputs(
        q=put(q),
        k_cache=put(k),
        v_cache=put(v),
        block_tables=table.to(device=device, dtype=torch.int32).contiguous(),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
    )


def ragged_lengths(batch: int, low: int, high: int, seed: int = 0) -> list[int]:
    """``batch`` lengths drawn uniformly from ``[low, high]`` with a fixed seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, (batch,), generator=gen).tolist()


def stack_padded(seqs: list[torch.Tensor], length: int, fill: float = float("nan")) -> torch.Tensor:
    """Per-request ``[len_b, ...]`` tensors stacked into ``[batch, length, ...]``; positions past
    a request's end hold ``fill`` (NaN by default: a kernel that reads them shows it)."""
    out = torch.full((len(seqs), length, *seqs[0].shape[1:]), fill, dtype=seqs[0].dtype)
    for b, s in enumerate(seqs):
        out[b, : len(s)] = s
    return out


def interleaved_cache(lens: list[int], *, block_size: int, num_q_heads: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A manager and a one-layer cache in which the requests grew one token at a time, in
    turns, so their blocks interleave (as in a server), filled with fresh random K/V.

    Returns ``(manager, cache, q, ks, vs)``: :class:`paged_ref.KVCacheManager`,
    :class:`paged_ref.PagedKVCache`, ``q [batch, num_q_heads, head_dim]`` and the K and V
    written for each request (``[len_b, num_kv_heads, head_dim]`` each), all in ``dtype``.
    """
    from paged_ref.memory.manager import KVCacheManager
    from paged_ref.memory.storage import PagedKVCache

    gen = torch.Generator().manual_seed(seed)
    manager = KVCacheManager(sum(blocks_needed(n, block_size) for n in lens) + 2, block_size)
    for s in range(len(lens)):
        manager.add_sequence(s, 0)
    for t in range(max(lens, default=0)):
        manager.append_slots([s for s, n in enumerate(lens) if t < n])
    cache = PagedKVCache(1, manager.num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    ks = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in lens]
    vs = [torch.randn(n, num_kv_heads, head_dim, generator=gen).to(dtype) for n in lens]
    for s in range(len(lens)):
        cache.write(0, ks[s], vs[s], manager.slot_mapping(s))
    q = torch.randn(len(lens), num_q_heads, head_dim, generator=gen).to(dtype)
    return manager, cache, q, ks, vs


@dataclass
class PrefillInputs:
    """One prefill step's inputs: the cache of :class:`PagedInputs` plus packed query rows.

    q:               [total_query_tokens, num_q_heads, head_dim]
    query_start_loc: [batch + 1] int32; sequence b owns q rows query_start_loc[b]:[b+1],
                     its last ``query_lens[b]`` tokens (already in the cache)
    """

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor

    def args(self) -> tuple[torch.Tensor, ...]:
        """Positional arguments for ``paged_prefill``."""
        return (self.q, self.k_cache, self.v_cache, self.block_tables, self.seq_lens,
                self.query_start_loc)

    def reference(self, scale: float | None = None, causal: bool = True) -> torch.Tensor:
        """The float64 answer, [total_query_tokens, num_q_heads, head_dim]."""
        from paged_ref.prefill import paged_prefill_reference

        return paged_prefill_reference(*self.args(), scale=scale, causal=causal)

    def quantized(self, kv_format: str | KVFormat) -> PrefillInputs:
        """The same inputs with K and V stored in ``kv_format`` (as
        :meth:`PagedInputs.quantized`; q unchanged)."""
        cache = PagedInputs(self.q, self.k_cache, self.v_cache, self.block_tables,
                            self.seq_lens).quantized(kv_format)
        return replace(self, k_cache=cache.k_cache, v_cache=cache.v_cache)


def make_prefill_inputs(
    seq_lens: list[int], query_lens: list[int], *, seed: int = 0, **kwargs
) -> PrefillInputs:
    """Random prefill inputs: sequence b has ``seq_lens[b]`` cached tokens, of which the last
    ``query_lens[b]`` are queries. Cache, tables and poison as in :func:`make_paged_inputs`
    (same keyword arguments)."""
    if len(query_lens) != len(seq_lens):
        raise ValueError(f"query_lens has {len(query_lens)} entries, seq_lens {len(seq_lens)}")
    cache = make_paged_inputs(seq_lens, seed=seed, **kwargs)
    total = sum(query_lens)
    device = cache.q.device
    gen = torch.Generator(device=device).manual_seed(seed + 1)
    q = torch.randn(total, cache.q.shape[1], cache.q.shape[2], generator=gen, device=device)
    starts = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32,
                          device=device)
    return PrefillInputs(q.to(cache.q.dtype), cache.k_cache, cache.v_cache, cache.block_tables,
                         cache.seq_lens, starts)
