"""Every call the engine makes into the rest of ``paged_ref``, in one small module.

The engine has no attention, prefill or block-manager code of its own: it uses the library's
``KVCacheManager`` (block tables, prefix caching), ``PagedKVCache`` (the K/V tensors),
``paged_prefill`` (prompt tokens and chunks) and ``paged_attention`` (decode). Keeping every
such call here means a change of those APIs is a change of one line here.

Shapes (per layer), as everywhere in ``paged_ref``:

    k_cache, v_cache  [num_blocks, block_size, num_kv_heads, head_dim]
    q                 [num_tokens, num_q_heads, head_dim]
    block_tables      int32 [batch, max_blocks_per_seq]
    seq_lens          int32 [batch]
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from paged_ref.attention import paged_attention
from paged_ref.manager import KVCacheManager
from paged_ref.storage import PagedKVCache


def new_manager(num_blocks: int, block_size: int, enable_prefix_caching: bool) -> KVCacheManager:
    """The block manager: one block table per request over a pool of ``num_blocks`` blocks."""
    return KVCacheManager(num_blocks, block_size)


def prefix_caching_supported() -> bool:
    """Whether this ``KVCacheManager`` can share cached prompt blocks between requests."""
    return False


def add_sequence(manager: KVCacheManager, seq_id: Hashable, token_ids: Sequence[int]) -> int:
    """Give ``seq_id`` blocks for all of ``token_ids`` (all or nothing).

    Returns how many leading tokens are already in the cache (a prefix-cache hit; 0 without
    prefix caching). Raises ``OutOfBlocksError`` when the pool is short; nothing is held then.
    """
    manager.add_sequence(seq_id, len(token_ids))
    return 0


def append_slot(manager: KVCacheManager, seq_id: Hashable, token_id: int) -> int:
    """The slot of ``seq_id``'s next token ``token_id`` (a new block only at a boundary)."""
    return manager.append_slot(seq_id)


def take_copies(manager: KVCacheManager) -> list[tuple[int, int]]:
    """Block copies ``(src, dst)`` owed by copy-on-write since the last call."""
    return []


def copy_blocks(cache: PagedKVCache, pairs: list[tuple[int, int]]) -> None:
    """Copy every layer's K and V of block ``src`` into block ``dst``, for each pair."""
    for src, dst in pairs:
        for k_cache, v_cache in zip(cache.k_caches, cache.v_caches):
            k_cache[dst].copy_(k_cache[src])
            v_cache[dst].copy_(v_cache[src])


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter token ``i``'s K/V (``[num_tokens, num_kv_heads, head_dim]``) to slot
    ``slot_mapping[i]`` (int64, on the cache's device). No checks, no host sync: the engine
    builds the slots itself, and this runs inside CUDA graphs."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    k_cache.view(num_slots, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
    v_cache.view(num_slots, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)


def prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                      scale: float, backend: str) -> torch.Tensor:
    """Causal attention of each sequence's last ``q_len`` tokens over its cached K/V.

    ``q`` is ``[total_query_tokens, Hq, D]``; sequence ``b`` owns rows
    ``query_start_loc[b]:query_start_loc[b+1]``, the last tokens of its ``seq_lens[b]``.
    """
    # Each query row is one decode over the tokens it may see (causal offset by the prefix).
    q_lens = query_start_loc[1:] - query_start_loc[:-1]
    row_seq = torch.repeat_interleave(torch.arange(len(q_lens), device=q.device), q_lens)
    first = (seq_lens - q_lens)[row_seq]
    offset = torch.arange(q.shape[0], device=q.device) - query_start_loc[:-1][row_seq]
    row_lens = (first + offset + 1).to(torch.int32)
    return paged_attention(q, k_cache, v_cache, block_tables[row_seq], row_lens, scale=scale,
                           backend=backend)


def plan_decode(block_tables: torch.Tensor, seq_lens_host: Sequence[int], num_q_heads: int,
                k_cache: torch.Tensor, *, backend: str):
    """Host-side plan for a decode step from the lengths known on the host (None: the call
    plans itself). A plan made for the longest lengths serves any shorter ones (CUDA graphs)."""
    return None


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, *, scale: float,
                     backend: str, plan=None) -> torch.Tensor:
    """One query token per sequence: ``q`` is ``[batch, Hq, D]``."""
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                           backend=backend)
