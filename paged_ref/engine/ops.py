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
from paged_ref.kv_write import write_kv_torch
from paged_ref.memory.manager import KVCacheManager
from paged_ref.memory.storage import PagedKVCache
from paged_ref.plan import plan_decode as _plan_decode
from paged_ref.prefill import paged_prefill
from paged_ref.quant import QuantizedKV, write_slots


def new_manager(num_blocks: int, block_size: int, enable_prefix_caching: bool,
                num_host_blocks: int = 0) -> KVCacheManager:
    """The block manager: one block table per request over a pool of ``num_blocks`` blocks;
    with ``num_host_blocks``, evicted cached blocks spill to a host (CPU) tier of that size."""
    return KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                          num_host_blocks=num_host_blocks)


def add_sequence(manager: KVCacheManager, seq_id: Hashable, token_ids: Sequence[int]) -> int:
    """Give ``seq_id`` blocks for all of ``token_ids`` (all or nothing).

    Returns how many leading tokens are already in the cache (a prefix-cache hit, a multiple
    of the block size, less than ``len(token_ids)``; 0 without prefix caching). Raises
    ``OutOfBlocksError`` when the pool is short; nothing is held then.
    """
    return manager.add_sequence(seq_id, token_ids=token_ids)


def append_token(manager: KVCacheManager, seq_id: Hashable, token_id: int) -> int:
    """The slot of ``seq_id``'s next token ``token_id`` (a new block only at a boundary)."""
    return manager.append_slot(seq_id, token_id)


def take_block_ops(manager: KVCacheManager):
    """Block moves owed since the last call: spills to the host tier, copies back from it,
    copy-on-writes (a ``BlockOps``)."""
    return manager.take_block_ops()


def apply_block_ops(cache: PagedKVCache, block_ops) -> None:
    """Perform ``block_ops`` on the K/V tensors, before the step writes any K/V."""
    if block_ops.swap_out or block_ops.swap_in or block_ops.copies:
        cache.apply_block_ops(block_ops)


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter token ``i``'s K/V (``[num_tokens, num_kv_heads, head_dim]``) to slot
    ``slot_mapping[i]`` (int64, on the cache's device). The unchecked path (no read-back):
    the engine builds the slots itself, and this runs inside CUDA graphs. A quantised cache
    (:class:`paged_ref.QuantizedKV`) quantises the tokens on the way in: on a GPU in one Triton
    kernel for K and V (the same bytes as ``write_slots``, which a CPU runs)."""
    if isinstance(k_cache, QuantizedKV):
        if k_cache.data.is_cuda:  # (imported here: Triton is only needed where a GPU is)
            from paged_ref.kernels.triton.quant_write import quant_write_triton

            quant_write_triton(k_cache, v_cache, k, v, slot_mapping)
        else:
            write_slots(k_cache, k, slot_mapping)
            write_slots(v_cache, v, slot_mapping)
        return
    write_kv_torch(k, v, k_cache, v_cache, slot_mapping)


def prefill_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                      scale: float, backend: str) -> torch.Tensor:
    """Causal attention of each sequence's last ``q_len`` tokens over its cached K/V.

    ``q`` is ``[total_query_tokens, Hq, D]``; sequence ``b`` owns rows
    ``query_start_loc[b]:query_start_loc[b+1]``, the last tokens of its ``seq_lens[b]``.
    A quantised cache is read by the same kernels (de-quantised in registers).
    """
    return paged_prefill(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                         scale=scale, backend=backend)


def plan_decode(seq_lens_host: Sequence[int], k_cache: torch.Tensor, *, dtype: torch.dtype,
                num_q_heads: int, scale: float, backend: str, max_seq_len: int | None = None):
    """Host-side plan for a decode step from the lengths known on the host. A plan made with
    ``max_seq_len`` serves any lengths up to it (what CUDA graph replays need). ``dtype`` is
    q's (the model's): a quantised cache's codes are not. A quantised cache's format goes with
    it, so ``"auto"`` runs the CUDA FP8 / INT4 kernels where they read it."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    return _plan_decode(seq_lens_host, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                        head_dim=head_dim, block_size=block_size, dtype=dtype,
                        device=k_cache.device, max_seq_len=max_seq_len, scale=scale,
                        backend=backend, kv_format=getattr(k_cache, "format", None))


def decode_attention(q, k_cache, v_cache, block_tables, seq_lens, *, plan) -> torch.Tensor:
    """One query token per sequence (``q`` is ``[batch, Hq, D]``), planned by
    :func:`plan_decode`: no read-back, CUDA-graph capturable."""
    return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, plan=plan)
