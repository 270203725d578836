"""The ``torch`` backend: gather K/V through the block table, then dense attention.

Three functions, from most to least obviously correct:

* :func:`paged_attention_reference` — float64, one token at a time in Python: the answer every
  backend is checked against.
* :func:`contiguous_attention` — attention over ordinary ``[batch, max_len, heads, dim]`` K/V
  (what you would write with no paging), for comparison.
* :func:`paged_attention_torch` — the ``backend="torch"`` implementation: gather the cached
  K/V into contiguous tensors (a full copy of every cached token), then attend.

And :func:`split_partials_reference`: the per-chunk partial outputs and log-sum-exps that a
split-KV kernel's first stage computes, in float64 (lesson 05).
"""

from __future__ import annotations

import torch

from paged_ref.cache_math import cdiv, default_scale, token_slots  # noqa: F401 (re-export)
from paged_ref.quant import QuantizedKV


def float64_slots(q, k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the float64 references compute with.

    Args:
        q: ``[..., Hq, D]``, any dtype and device.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` tensors or
            :class:`~paged_ref.QuantizedKV` caches (de-quantised first).

    Returns:
        ``(q, k, v)`` in float64 on the CPU, the caches flattened to one row per slot
        (``[num_blocks * block_size, Hkv, D]``, so that ``k[slot]`` is a token's K).
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]

    def slots(cache):
        if isinstance(cache, QuantizedKV):  # the answer for the values the codes stand for
            cache = cache.dequantize()
        return cache.detach().to("cpu", torch.float64).reshape(-1, num_kv_heads, head_dim)

    return q.detach().to("cpu", torch.float64), slots(k_cache), slots(v_cache)


def paged_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Decode attention in float64, one sequence and head at a time: written for clarity,
    not speed. The answer every backend is checked against.

    Args:
        q: ``[B, Hq, D]``, any float dtype.
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]``, or
            :class:`~paged_ref.QuantizedKV` caches (the answer for the values they stand for).
        block_tables: int ``[B, max_blocks]``.
        seq_lens: int ``[B]``.
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        float64 ``[B, Hq, D]`` on the CPU; rows with ``seq_len == 0``, or whose every key
        scores ``-inf``, are zeros.
    """
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    batch, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    scale = default_scale(head_dim, scale)
    q64, k_flat, v_flat = float64_slots(q, k_cache, v_cache)
    out = torch.zeros(batch, num_q_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        n = int(seq_lens[b])
        if n == 0:
            continue
        slots = torch.tensor(token_slots(block_tables[b].tolist(), n, block_size))
        for h in range(num_q_heads):
            kv_head = h // group
            k = k_flat[slots, kv_head]  # [n, D]
            v = v_flat[slots, kv_head]
            scores = (k @ q64[b, h]) * scale  # [n]
            if (scores == float("-inf")).all():
                continue  # every key scores -inf: no weight anywhere, zeros (as an empty row)
            out[b, h] = torch.softmax(scores, dim=0) @ v
    return out


def gather_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Copy every cached token into contiguous K/V.

    Table entries past a sequence's used blocks are never dereferenced.

    Args:
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` tensors, or
            :class:`~paged_ref.QuantizedKV` caches (their codes and scales are gathered, then
            de-quantised: only the gathered tokens).
        block_tables: int ``[B, max_blocks]``.
        seq_lens: int ``[B]``.
        max_len: the longest length (at least ``max(seq_lens)``).

    Returns:
        ``(k, v, valid)``: k, v ``[B, max_len, Hkv, D]`` in the cache's dtype (float32 for a
        quantised cache; positions past a sequence's length hold an arbitrary cached token),
        ``valid`` bool ``[B, max_len]``.
    """
    block_size = k_cache.shape[1]
    pos = torch.arange(max_len, device=k_cache.device)
    valid = pos[None, :] < seq_lens[:, None].long()  # [B, max_len]
    block = block_tables.long()[:, pos // block_size]  # [B, max_len] physical block per token
    block = torch.where(valid, block, 0)  # never follow an unused entry
    slots = block * block_size + pos % block_size  # [B, max_len]: cache_math.slot_of
    k, v = (c.take_slots(slots).dequantize() if isinstance(c, QuantizedKV)
            else c.flatten(0, 1)[slots] for c in (k_cache, v_cache))
    return k, v, valid


def contiguous_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    valid: torch.Tensor,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Masked decode attention over contiguous K/V (no paging), GQA by head groups.

    Args:
        q: ``[B, Hq, D]``.
        k, v: ``[B, L, Hkv, D]``.
        valid: bool ``[B, L]`` (False: masked out; such positions may hold anything).
        scale: softmax scale, default ``head_dim ** -0.5``.

    Returns:
        ``[B, Hq, D]`` in q's dtype, accumulated in float32 (float64 for float64 inputs);
        rows with no valid token, or whose every key scores ``-inf``, are zeros.
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    group = num_q_heads // num_kv_heads
    scale = default_scale(head_dim, scale)
    acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for float64 inputs
    qg = q.to(acc).view(batch, num_kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,bthd->bhgt", qg, k.to(acc)) * scale  # [B, Hkv, G, L]
    scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
    # softmax of an all -inf row is NaN: give such rows (empty ones, or ones whose every key
    # scores -inf) weight 0 instead, as the Triton kernels do. Only those rows: a NaN in a real
    # token still shows up in the output rather than being zeroed.
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where((scores == float("-inf")).all(dim=-1, keepdim=True), 0.0, probs)
    v = torch.where(valid[:, :, None, None], v.to(acc), 0.0)  # unused slots may hold NaN
    out = torch.einsum("bhgt,bthd->bhgd", probs, v)
    return out.reshape(batch, num_q_heads, head_dim).to(q.dtype)


def paged_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """``backend="torch"``: gather through the block table (:func:`gather_kv`), then
    :func:`contiguous_attention`. Inputs are assumed valid (``paged_attention`` checks them).

    Args:
        q, k_cache, v_cache, block_tables, seq_lens, scale: as for ``paged_attention``.
        max_len: at least the longest length (a plan's bound will do); given, ``seq_lens`` is
            not read back from the device.

    Returns:
        ``[B, Hq, D]`` in q's dtype, contiguous.
    """
    if max_len is None:
        max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    k, v, valid = gather_kv(k_cache, v_cache, block_tables, seq_lens, max_len)
    return contiguous_attention(q, k, v, valid, scale=scale)


def split_partials_reference(q, k_cache, v_cache, block_tables, seq_lens, chunk_size: int, *,
                             scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The partial results a split-KV kernel's first stage computes, in float64 (lesson 05).

    Args:
        q, k_cache, v_cache, block_tables, seq_lens, scale: as for
            :func:`paged_attention_reference`.
        chunk_size: tokens per chunk.

    Returns:
        ``(outs, lses)``: float64 ``[C, B, Hq, D]`` (softmax-weighted values of each chunk's
        tokens; NaN for an empty chunk) and ``[C, B, Hq]`` (natural-log log-sum-exp of its
        scores; -inf if empty), ``C = max(1, ceil(max_len / chunk_size))``. Merged with
        weights ``softmax(lses, dim=0)`` they give the attention output.
    """
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    num_chunks = max(1, cdiv(max_len, chunk_size))
    k, v, valid = gather_kv(k_cache, v_cache, block_tables, seq_lens, max_len)
    batch, num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[2]
    k = k.double().repeat_interleave(group, dim=2)  # [B, L, Hq, D]
    v = torch.where(valid[:, :, None, None], v.double(), 0.0).repeat_interleave(group, dim=2)
    scores = torch.einsum("bhd,blhd->bhl", q.double(), k) * default_scale(head_dim, scale)
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    outs, lses = [], []
    for c in range(num_chunks):
        span = slice(c * chunk_size, (c + 1) * chunk_size)
        lses.append(torch.logsumexp(scores[:, :, span], -1))  # -inf if empty
        outs.append(torch.einsum("bhl,blhd->bhd", torch.softmax(scores[:, :, span], -1),
                                 v[:, span]))  # NaN if empty
    return torch.stack(outs), torch.stack(lses)
