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
runs at 3.5 TB/s and ``index_copy_`` at 1.2 TB/s). Unlike :meth:`paged_ref.PagedKVCache.write`
(lists of Python ints, for lessons) this takes tensors and reads the slots back once for the
checks. The engine writes through its own unchecked path (``write_kv_torch`` and the fused
kernels), whose slots it builds itself.
"""

from __future__ import annotations

import torch

from paged_ref import _device
from paged_ref.validation import CACHE_DTYPES, CACHE_LAYOUT, check_device, check_tensor

WRITE_BACKENDS = ("auto", "torch", "triton")


def _byte_range(t: torch.Tensor) -> tuple[int, int, int]:
    """``(storage address, first byte, one past the last byte)`` that ``t``'s elements span
    in their storage (a bounding range: a strided ``t`` need not touch every byte of it)."""
    start = t.storage_offset() * t.element_size()
    span = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    end = start + span * t.element_size() if t.numel() else start
    return t.untyped_storage().data_ptr(), start, end


def _overlap(a: torch.Tensor, b: torch.Tensor) -> tuple[int, int] | None:
    """The bytes of ``b``'s range (relative to ``b``'s first byte) that ``a`` may share, or
    None when they share none. Metadata only: no value is read, nothing waits."""
    (pa, a0, a1), (pb, b0, b1) = _byte_range(a), _byte_range(b)
    if pa != pb or a0 == a1 or b0 == b1 or a1 <= b0 or b1 <= a0:
        return None
    return max(a0, b0) - b0, min(a1, b1) - b0


def check_aliasing(k, v, k_cache, v_cache, slots: torch.Tensor) -> None:
    """Refuse writes whose result would depend on the order of the stores: one tensor as both
    caches, or a source that shares memory with a slot it is written to.

    Args:
        k, v, k_cache, v_cache: the call's tensors (shapes checked, caches contiguous).
        slots: the slot mapping, on the host (int64 ``[num_tokens]``).

    Raises:
        ValueError: naming the two arguments that share memory.
    """
    if _overlap(k_cache, v_cache) is not None:
        raise ValueError("k_cache and v_cache share memory (one tensor passed as both?): V "
                         "would overwrite K; pass two caches")
    row_bytes = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()  # one slot
    for src_name, src in (("k", k), ("v", v)):
        for cache_name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
            shared = _overlap(src, cache)
            if shared is None:
                continue
            first, last = shared[0] // row_bytes, (shared[1] - 1) // row_bytes
            hit = ((slots >= first) & (slots <= last)).nonzero()
            if hit.numel():
                i = int(hit[0])
                raise ValueError(
                    f"{src_name} is a view of {cache_name} that overlaps the slots it is "
                    f"written to (slot_mapping[{i}] = {int(slots[i])}): the result would "
                    f"depend on the order of the stores; pass {src_name}.clone()")


def check_write_inputs(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Types, shapes, dtypes, devices, aliasing and slot values (one read-back).

    Args:
        k, v, k_cache, v_cache, slot_mapping: as for :func:`write_kv`.

    Raises:
        TypeError: a wrong type or dtype. ValueError: a wrong shape or device, a slot outside
        the pool or written twice, or memory shared where stores would collide (named).
    """
    check_tensor("k_cache", k_cache, 4, CACHE_LAYOUT)
    check_tensor("v_cache", v_cache, 4, CACHE_LAYOUT)
    if k_cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"k_cache dtype must be one of {CACHE_DTYPES}, got {k_cache.dtype}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError("v_cache must have k_cache's shape and dtype")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    expected = f"[num_tokens, num_kv_heads={num_kv_heads}, head_dim={head_dim}]"
    for name, t in (("k", k), ("v", v)):
        check_tensor(name, t, 3, expected)
        if tuple(t.shape[1:]) != (num_kv_heads, head_dim):
            raise ValueError(f"{name} must have shape {expected}, got {tuple(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} dtype {t.dtype} must match the cache dtype {k_cache.dtype}")
    if v.shape != k.shape:
        raise ValueError(f"v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    check_tensor("slot_mapping", slot_mapping, 1, "[num_tokens]")
    if slot_mapping.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"slot_mapping must be int32 or int64, got {slot_mapping.dtype}")
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(
            f"slot_mapping has {slot_mapping.shape[0]} entries but k has {k.shape[0]} tokens")
    for name, t in (("k", k), ("v", v), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but k_cache is on {k_cache.device}")
    check_device("k_cache", k_cache.device)
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous())")
    slots = slot_mapping.cpu().long()
    num_slots = num_blocks * block_size
    outside = (slots < 0) | (slots >= num_slots)
    if outside.any():
        i = int(outside.nonzero()[0])
        raise ValueError(f"slot_mapping[{i}] = {int(slots[i])} is outside [0, num_blocks * "
                         f"block_size = {num_slots})")
    if torch.unique(slots).numel() != slots.numel():
        raise ValueError("slot_mapping writes some slot more than once")
    check_aliasing(k, v, k_cache, v_cache, slots)


def write_kv(k, v, k_cache, v_cache, slot_mapping, *, backend: str = "auto") -> None:
    """Store token ``i``'s K and V in slot ``slot_mapping[i]`` of ``k_cache`` / ``v_cache``.

    Checks everything first: nothing is written on bad input.

    Args:
        k, v: ``[num_tokens, num_kv_heads, head_dim]``, the cache's dtype, any strides; they
            may be views of the caches' other slots, not of the slots they are written to.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` float16 /
            bfloat16 / float32, contiguous, two distinct tensors; written in place.
        slot_mapping: int32 / int64 ``[num_tokens]``, distinct slots in ``[0, num_blocks *
            block_size)``.
        backend: ``"auto"`` (default), ``"torch"`` or ``"triton"``.

    Raises:
        TypeError, ValueError: as :func:`check_write_inputs`; ValueError also for a Triton
        backend on tensors it cannot run on here.
    """
    if backend not in WRITE_BACKENDS:
        raise ValueError(f"backend must be one of {WRITE_BACKENDS}, got {backend!r}")
    check_write_inputs(k, v, k_cache, v_cache, slot_mapping)
    if backend == "auto":
        backend = "triton" if _device.compiled_triton_on(k.device) else "torch"
    if backend == "triton":
        _device.check_triton_device(backend, "k", k.device)
        from paged_ref.kernels.triton.store import write_kv_triton

        write_kv_triton(k, v, k_cache, v_cache, slot_mapping)
        return
    # NOTE: index_copy_ refuses a source that shares memory with its destination anywhere,
    # even away from the slots written (the checks refused those): copy such a source first.
    k, v = (t.clone() if _overlap(t, k_cache) is not None or _overlap(t, v_cache) is not None
            else t for t in (k, v))
    write_kv_torch(k, v, k_cache, v_cache, slot_mapping)


def write_kv_torch(k, v, k_cache, v_cache, slot_mapping) -> None:
    """``backend="torch"``, unchecked (the engine's path): ``index_copy_`` into the caches
    viewed as one row per slot. Shapes as for :func:`write_kv`; ``slot_mapping`` on the
    caches' device."""
    rows = slot_mapping.long()
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, rows, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, rows, v)


__all__ = ["WRITE_BACKENDS", "check_aliasing", "check_write_inputs", "write_kv",
           "write_kv_torch"]
