"""Input checks for ``paged_attention``: a clear exception instead of a crash or wrong numbers.

``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape, device, layout or
value. Every message names the argument and says what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from paged_ref import _device
from paged_ref.quant import QuantizedKV, check_quantized_pair

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Largest ``abs(scale)`` accepted. Scores are float32; a scale far beyond any model's
#: (``head_dim ** -0.5`` is ~0.09; temperature-like scales stay below ~100) overflows them to
#: inf for ordinary inputs (scale=1e38 with |q.k| >= 4), and softmax of inf is NaN. So a
#: larger scale is a ValueError, never a silent NaN.
MAX_ABS_SCALE = 1e4
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

    check_scale(scale)
    return Shapes(batch, num_q_heads, num_kv_heads, head_dim, num_blocks, block_size,
                  block_tables.shape[1])


def check_out(out: torch.Tensor | None, q: torch.Tensor) -> torch.Tensor:
    """A new output like ``q``, or ``out`` after checking it can take the result."""
    if out is None:
        return torch.empty_like(q)
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} like q, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if out.shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError("out must have stride 1 in its last dimension (head_dim)")
    return out


def check_scale(scale) -> None:
    """``scale`` is None or a finite number with ``abs(scale) <= MAX_ABS_SCALE``."""
    if scale is None:
        return
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    try:
        value = float(scale)
    except OverflowError:  # an int too large for a float, e.g. 10**400
        raise ValueError(f"scale must be finite, got an int of {len(str(scale))} digits") from None
    if value != value or abs(value) == float("inf"):
        raise ValueError(f"scale must be finite, got {scale}")
    if abs(value) > MAX_ABS_SCALE:
        raise ValueError(f"scale must satisfy abs(scale) <= {MAX_ABS_SCALE:g} (larger ones "
                         f"overflow the float32 scores to inf, then NaN), got {scale}")


@dataclass(frozen=True)
class Lengths:
    """What the checks read back about ``seq_lens``: the longest sequence and the sum."""

    max_len: int
    total_tokens: int


def check_values(block_tables: torch.Tensor, seq_lens: torch.Tensor, shapes: Shapes) -> Lengths:
    """Lengths and used table entries; returns the longest and total length.

    Reads values back from the device once (one sync). On a GPU one Triton kernel
    (:mod:`paged_ref.kernels.triton.checks`) reduces them to four numbers per 16 sequences.
    Otherwise tables up to ``HOST_CHECK_MAX_ENTRIES`` entries go to the host in one copy and are
    checked there with NumPy (a dozen tiny torch ops cost ten times that); larger ones are
    reduced with torch ops to one small tensor. Either way the checks see the tensors' logical
    values (any strides); a failed check then looks up the offending entry for its message.
    """
    if shapes.batch == 0:
        return Lengths(0, 0)
    if checks_on_device(seq_lens):  # one kernel
        from paged_ref.kernels.triton.checks import length_stats

        return lengths_from_stats(
            length_stats(block_tables, seq_lens, shapes.block_size, shapes.num_blocks),
            block_tables, seq_lens, shapes)
    return _check_on_host(block_tables, seq_lens, shapes)


def checks_on_device(seq_lens: torch.Tensor) -> bool:
    """Are the value checks done by the Triton check kernel (on a GPU, compiled Triton)?"""
    return seq_lens.is_cuda and _device.HAS_TRITON and not _device.INTERPRET


def lengths_from_stats(stats: tuple[int, int, int, int], block_tables: torch.Tensor,
                       seq_lens: torch.Tensor, shapes: Shapes) -> Lengths:
    """The check kernel's verdict ``(shortest, longest, total, bad used entries)`` as
    ``Lengths``; when a check failed, the host checks find the offending entry and raise."""
    shortest, longest, total, num_bad = stats
    if shortest >= 0 and longest <= shapes.max_blocks_per_seq * shapes.block_size \
            and num_bad == 0:
        return Lengths(longest, total)
    return _check_on_host(block_tables, seq_lens, shapes)


def _check_on_host(block_tables: torch.Tensor, seq_lens: torch.Tensor, shapes: Shapes) -> Lengths:
    """The checks with NumPy on the host (one copy), or torch ops for very large tables."""
    if block_tables.numel() <= HOST_CHECK_MAX_ENTRIES:
        if seq_lens.is_cuda:  # one copy to the host for both tensors
            packed = torch.cat([seq_lens, block_tables.flatten()]).cpu().numpy()
            lens, table = packed[: shapes.batch], packed[shapes.batch :]
        else:
            lens, table = seq_lens.numpy(), block_tables.numpy()
        table = table.reshape(shapes.batch, shapes.max_blocks_per_seq)
        used = np.arange(shapes.max_blocks_per_seq) * shapes.block_size < lens[:, None]
        bad = used & ((table < 0) | (table >= shapes.num_blocks))
        lens64 = lens.astype(np.int64)
        return _lengths_or_raise(int(lens64.min()), int(lens64.max()), int(lens64.sum()),
                                 bool(bad.any()), lens, table, bad, shapes)
    first_token = torch.arange(0, shapes.max_blocks_per_seq * shapes.block_size,
                               shapes.block_size, device=seq_lens.device)
    used = first_token[None, :] < seq_lens[:, None]  # [B, max_blocks]: block j holds tokens
    bad = used & ((block_tables < 0) | (block_tables >= shapes.num_blocks))
    shortest, longest, total, num_bad = torch.stack(
        [seq_lens.min().long(), seq_lens.max().long(), seq_lens.sum(), bad.sum()]
    ).tolist()
    return _lengths_or_raise(shortest, longest, total, num_bad > 0, seq_lens, block_tables, bad,
                             shapes)


def _lengths_or_raise(shortest, longest, total, any_bad, lens, table, bad, shapes) -> Lengths:
    """The error for the first failed check (looking up the offending entry), else Lengths."""
    capacity = shapes.max_blocks_per_seq * shapes.block_size
    if shortest < 0:
        b = int((lens < 0).nonzero()[0][0])
        raise ValueError(f"seq_lens[{b}] = {int(lens[b])} is negative")
    if longest > capacity:
        b = int((lens > capacity).nonzero()[0][0])
        raise ValueError(
            f"seq_lens[{b}] = {int(lens[b])} needs more blocks than block_tables holds "
            f"({shapes.max_blocks_per_seq} blocks x block_size {shapes.block_size} = {capacity})"
        )
    if any_bad:
        bad = bad.cpu().numpy() if isinstance(bad, torch.Tensor) else bad
        b, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"block_tables[{b}, {j}] = {int(table[b, j])} is outside [0, num_blocks="
            f"{shapes.num_blocks}) but sequence {b} uses it (seq_lens[{b}] = {int(lens[b])})"
        )
    return Lengths(int(longest), int(total))
