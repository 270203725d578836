"""``write_kv(backend="triton")``: store new tokens' K/V into their cache slots.

One program per token: it reads the token's ``num_kv_heads * head_dim`` K and V values
(contiguous in the cache row) and writes them at ``slot * row_stride``. The same job as vLLM's
``reshape_and_cache_flash``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from paged_ref.kernels.triton.launch import launch


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                    stride_kt, stride_kh, stride_vt, stride_vh,
                    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, ROW_PAD: tl.constexpr):
    """Grid (num_tokens,): cache row ``slot_mapping[t]`` = k[t] (and v[t])."""
    t = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + t).to(tl.int64)
    offs = tl.arange(0, ROW_PAD)  # heads x dims of one token, flattened
    ok = offs < NUM_KV_HEADS * HEAD_DIM
    head, dim = offs // HEAD_DIM, offs % HEAD_DIM
    row = slot * (NUM_KV_HEADS * HEAD_DIM)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + head * stride_kh + dim, mask=ok)
    tl.store(k_cache_ptr + row + offs, k, mask=ok)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + head * stride_vh + dim, mask=ok)
    tl.store(v_cache_ptr + row + offs, v, mask=ok)


def write_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Launch :func:`store_kv_kernel`: token ``i``'s K/V into slot ``slot_mapping[i]``.

    Args:
        k, v: ``[num_tokens, Hkv, D]``, the caches' dtype, any strides (a copy when head_dim's
            stride is not 1).
        k_cache, v_cache: contiguous ``[num_blocks, block_size, Hkv, D]``, written in place.
        slot_mapping: int32 / int64 ``[num_tokens]``, distinct valid slots (already checked).
    """
    if k.shape[0] == 0:
        return
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    launch(store_kv_kernel, (k.shape[0],),
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        ROW_PAD=triton.next_power_of_2(num_kv_heads * head_dim), num_warps=4,
    )


__all__ = ["store_kv_kernel", "write_kv_triton"]
