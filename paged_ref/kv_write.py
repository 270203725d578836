"""``write_kv``: put new tokens' K and V into the paged cache through the slot mapping.

Before ``paged_prefill`` (or decode) runs, a model's attention layer has computed K and V for
the step's new tokens; they go into their slots (``slot = block_id * block_size + offset``,
from :meth:`paged_ref.KVCacheManager.slot_mapping` / ``append_slot``)::

    k, v          [num_tokens, num_kv_heads, head_dim], the cache's dtype
    k_cache       [num_blocks, block_size, num_kv_heads, head_dim]  (viewed as
                  [num_slots, num_kv_heads, head_dim]: one row per slot)
    slot_mapping  int32/int64 [num_tokens], distinct slots in [0, num_blocks * block_size)

Backends: ``"torch"`` (``index_copy_`` on the slot view), ``"triton"`` (a store kernel, one
program per token, as vLLM's ``reshape_and_cache_flash``), ``"auto"`` (``"triton"`` on a GPU,
``"torch"`` elsewhere: on the H200, 16,384 tokens of K/V into shuffled slots, the store kernel
runs at 3.5 TB/s and ``index_copy_`` at 1.2 TB/s; ``results/h200/prefill.json``). Unlike
:meth:`paged_ref.PagedKVCache.write` (lists of Python ints, for lessons) this takes tensors and
reads the slots back once for the checks.
"""

from __future__ import annotations

import torch

from paged_ref.prefill import choose_prefill_backend
from paged_ref.validation import CACHE_DTYPES, _tensor

WRITE_BACKENDS = ("auto", "torch", "triton")


def check_write_inputs(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Types, shapes, dtypes, devices and slot values (one read-back); raises TypeError /
    ValueError naming the argument."""
    layout = "[num_blocks, block_size, num_kv_heads, head_dim]"
    _tensor("k_cache", k_cache, 4, layout)
    _tensor("v_cache", v_cache, 4, layout)
    if k_cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"k_cache dtype must be one of {CACHE_DTYPES}, got {k_cache.dtype}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("v_cache must have k_cache's shape and dtype")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    expected = f"[num_tokens, num_kv_heads={num_kv_heads}, head_dim={head_dim}]"
    for name, t in (("k", k), ("v", v)):
        _tensor(name, t, 3, expected)
        if tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must match the cache dtype {k_cache.dtype}")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    _tensor("slot_mapping", slot_mapping, 1, "[num_tokens]")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but k has {k.shape[0]} tokens")
    for name, t in (("k", k), ("v", v), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but k_cache is on {k_cache.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous())")
    slots = slot_mapping.cpu()
    num_slots = num_blocks * block_size
    outside = (slots < 0) | (slots >= num_slots)
    if outside.any():
        i = int(outside.nonzero()[0])
        raise ValueError(f"slot_mapping[{i}] = {int(slots[i])} is outside [0, num_blocks * "
                         f"block_size = {num_slots})")
    if torch.unique(slots).numel() != slots.numel():
        raise ValueError("slot_mapping writes some slot more than once")


def write_kv(k, v, k_cache, v_cache, slot_mapping, *, backend: str = "auto") -> None:
    """Store token ``i``'s K and V in slot ``slot_mapping[i]`` of ``k_cache`` / ``v_cache``.

    Checks everything first (nothing is written on bad input). See the module docstring.
    """
    if backend not in WRITE_BACKENDS:
        raise ValueError(f"backend must be one of {WRITE_BACKENDS}, got {backend!r}")
    check_write_inputs(k, v, k_cache, v_cache, slot_mapping)
    if backend == "auto":
        backend = "triton" if choose_prefill_backend(k) == "triton" else "torch"
    if backend == "triton":
        from paged_ref.kernels.triton.store import write_kv_triton
        from paged_ref.plan import check_backend_usable

        check_backend_usable(backend, k.device)
        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        write_kv_torch(k, v, k_cache, v_cache, slot_mapping)


def write_kv_torch(k, v, k_cache, v_cache, slot_mapping) -> None:
    """``backend="torch"``: ``index_copy_`` into the caches viewed as one row per slot."""
    rows = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, rows, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, rows, v)


__all__ = ["WRITE_BACKENDS", "check_write_inputs", "write_kv", "write_kv_torch"]
