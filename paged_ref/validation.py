"""Input checks for ``paged_attention``: a clear exception instead of a crash or wrong numbers.

``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape, device, layout or
value. Every message names the argument and says what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_ref.quant import QuantizedKV, check_quantized_pair

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Block tables up to this many entries (4 MiB) are checked on the host after one copy.
HOST_CHECK_MAX_ENTRIES = 1 << 20


@dataclass(frozen=True)
class Shapes:
    """Sizes read off valid inputs."""

    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int


def _tensor(name: str, x, rank: int, layout: str, quantized_ok: bool = False) -> None:
    if not isinstance(x, (torch.Tensor, QuantizedKV) if quantized_ok else torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if x.dim() != rank:
        raise ValueError(
            f"{name} must have {rank} dimensions {layout}, got shape {tuple(x.shape)}"
        )


def check_shapes(q, k_cache, v_cache, block_tables, seq_lens, scale=None) -> Shapes:
    """Types, ranks, dtypes, shapes, devices and layout; reads no tensor values (no sync).

    ``k_cache`` / ``v_cache`` may both be :class:`paged_ref.QuantizedKV` (one format, their
    parts already checked when built); their ``shape`` is the shape of the values."""
    _tensor("q", q, 3, "[batch, num_q_heads, head_dim]")
    kv_format = check_quantized_pair(q, k_cache, v_cache)
    _tensor("k_cache", k_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]", True)
    _tensor("v_cache", v_cache, 4, "[num_blocks, block_size, num_kv_heads, head_dim]", True)
    _tensor("block_tables", block_tables, 2, "[batch, max_blocks_per_seq]")
    _tensor("seq_lens", seq_lens, 1, "[batch]")

    if kv_format is None:  # (a quantised cache takes q in any of CACHE_DTYPES)
        if k_cache.dtype not in CACHE_DTYPES:
            raise TypeError(f"k_cache dtype must be one of {CACHE_DTYPES}, got {k_cache.dtype}")
        if v_cache.dtype != k_cache.dtype:
            raise TypeError(
                f"v_cache dtype {v_cache.dtype} must match k_cache dtype {k_cache.dtype}")
        if q.dtype != k_cache.dtype:
            raise TypeError(f"q dtype {q.dtype} must match the cache dtype {k_cache.dtype}")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be torch.int32, got {t.dtype} (use .to(torch.int32))")

    if v_cache.shape != k_cache.shape:
        raise ValueError(
            f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape {tuple(k_cache.shape)}"
        )
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    batch, num_q_heads, q_dim = q.shape
    if block_size < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(f"k_cache has an empty dimension: shape {tuple(k_cache.shape)}")
    if q_dim != head_dim:
        raise ValueError(f"q head_dim {q_dim} must equal the cache head_dim {head_dim}")
    if num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"q num_q_heads ({num_q_heads}) must be a positive multiple of the cache's "
            f"num_kv_heads ({num_kv_heads})"
        )
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, q has batch {batch}")
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, q has batch {batch}")

    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)):
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous (call .contiguous())")

    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
        if not (float(scale) == float(scale) and abs(float(scale)) != float("inf")):
            raise ValueError(f"scale must be finite, got {scale}")
    return Shapes(batch, num_q_heads, num_kv_heads, head_dim, num_blocks, block_size,
                  block_tables.shape[1])


@dataclass(frozen=True)
class Lengths:
    """What the checks read back about ``seq_lens``: the longest sequence and the sum."""

    max_len: int
    total_tokens: int


def check_values(block_tables: torch.Tensor, seq_lens: torch.Tensor, shapes: Shapes) -> Lengths:
    """Lengths and used table entries; returns the longest and total length.

    Reads values back from the device once (one sync): small tables are copied to the host and
    checked there; large ones are reduced on the device to one small tensor. Only when a check
    fails is the offending entry looked up for the message.
    """
    if shapes.batch == 0:
        return Lengths(0, 0)
    if seq_lens.is_cuda and block_tables.numel() <= HOST_CHECK_MAX_ENTRIES:
        # One copy to the host, then the checks there: a few CPU ops cost less than a
        # dozen tiny GPU launches. (Large tables stay on the device.)
        packed = torch.cat([seq_lens, block_tables.flatten()]).cpu()
        seq_lens, block_tables = packed[: shapes.batch], packed[shapes.batch :].view(
            shapes.batch, shapes.max_blocks_per_seq)
    first_token = torch.arange(0, shapes.max_blocks_per_seq * shapes.block_size,
                               shapes.block_size, device=seq_lens.device)
    used = first_token[None, :] < seq_lens[:, None]  # [B, max_blocks]: block j holds tokens
    outside = block_tables.clamp(0, shapes.num_blocks - 1) != block_tables
    bad_entries = (used & outside).sum()
    shortest, longest, total, bad = torch.stack(
        [seq_lens.min().long(), seq_lens.max().long(), seq_lens.sum(), bad_entries]
    ).tolist()
    capacity = shapes.max_blocks_per_seq * shapes.block_size
    if shortest < 0:
        b = int((seq_lens < 0).nonzero()[0])
        raise ValueError(f"seq_lens[{b}] = {int(seq_lens[b])} is negative")
    if longest > capacity:
        b = int((seq_lens > capacity).nonzero()[0])
        raise ValueError(
            f"seq_lens[{b}] = {int(seq_lens[b])} needs more blocks than block_tables holds "
            f"({shapes.max_blocks_per_seq} blocks x block_size {shapes.block_size} = {capacity})"
        )
    if bad:
        b, j = (int(i) for i in (used & outside).nonzero()[0])
        raise ValueError(
            f"block_tables[{b}, {j}] = {int(block_tables[b, j])} is outside [0, num_blocks="
            f"{shapes.num_blocks}) but sequence {b} uses it (seq_lens[{b}] = {int(seq_lens[b])})"
        )
    return Lengths(int(longest), int(total))
