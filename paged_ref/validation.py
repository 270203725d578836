"""Input checks for the attention calls: a clear exception instead of a crash or wrong numbers.

``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape, device, layout or
value. Every message names the argument and says what was expected. Two kinds of check:

* :func:`check_shapes` (and :func:`check_out`, :func:`check_scale`): what the tensors' metadata
  says (types, ranks, dtypes, shapes, devices, layouts); no tensor value is read, no sync;
* :func:`check_values`: the lengths and the used block-table entries, on the host (one copy).
  On a GPU the layer above (:mod:`paged_ref.attention`) runs the same checks as one Triton
  kernel (:mod:`paged_ref.kernels.triton.checks`) and hands its verdict to
  :func:`check_values`, which names the offending entry when a check failed.

:func:`check_prefill_inputs` is both kinds for :func:`paged_ref.paged_prefill`. This module
imports no kernel: the checked sizes go down to the kernels, nothing comes back up.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import numpy as np
import torch

from paged_ref.quant import COMPUTE_DTYPES, FP8_DTYPE, QuantizedKV

CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: Largest ``abs(scale)`` accepted. Scores are float32; a scale far beyond any model's
#: (``head_dim ** -0.5`` is ~0.09; temperature-like scales stay below ~100) overflows them to
#: inf for ordinary inputs (scale=1e38 with |q.k| >= 4), and softmax of inf is NaN. So a
#: larger scale is a ValueError, never a silent NaN.
MAX_ABS_SCALE = 1e4
#: Block tables up to this many entries (4 MiB) are checked on the host after one copy.
HOST_CHECK_MAX_ENTRIES = 1 << 20
CACHE_LAYOUT = "[num_blocks, block_size, num_kv_heads, head_dim]"


@dataclass(frozen=True)
class Shapes:
    """Sizes read off valid inputs (ints)."""

    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    num_blocks: int
    block_size: int
    max_blocks_per_seq: int


@dataclass(frozen=True)
class Lengths:
    """What the value checks read back about ``seq_lens``: the longest sequence and the sum."""

    max_len: int
    total_tokens: int


@dataclass(frozen=True)
class PrefillLengths:
    """What the prefill checks read back (host ints): per sequence its cache length and query
    rows; ``shapes`` of the call (None when built by hand)."""

    seq_lens: list[int]
    query_lens: list[int]
    shapes: Shapes | None = None

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)


def check_tensor(name: str, x, rank: int, layout: str, quantized_ok: bool = False) -> None:
    """``x`` is a tensor (or a :class:`~paged_ref.QuantizedKV` where ``quantized_ok``) of
    ``rank`` dimensions; ``layout`` (e.g. ``"[batch]"``) goes into the messages."""
    if not isinstance(x, (torch.Tensor, QuantizedKV) if quantized_ok else torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {layout}, got {type(x).__name__}")
    if len(x.shape) != rank:
        raise ValueError(f"{name} must have {rank} dimensions {layout}, got shape "
                         f"{tuple(x.shape)}")


def _parts(cache) -> tuple[torch.Tensor, ...]:
    """The tensors a cache is made of: itself, or a QuantizedKV's codes and scales."""
    if isinstance(cache, QuantizedKV):
        return tuple(t for t in (cache.data, cache.scale, cache.zero) if t is not None)
    return (cache,)


def _check_cache_types(q, k_cache, v_cache) -> None:
    """Both caches plain tensors of q's dtype, or both QuantizedKV of one format with q in a
    compute dtype. A bare float8 / uint8 tensor is a cache without its scales."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if isinstance(c, torch.Tensor) and c.dtype in (FP8_DTYPE, torch.uint8, torch.int8):
            raise TypeError(
                f"{name} is a bare {c.dtype} tensor: a quantised cache needs its scales; pass "
                f"paged_ref.QuantizedKV(data, scale, zero, format) (see paged_ref.quant)")
    check_tensor("k_cache", k_cache, 4, CACHE_LAYOUT, quantized_ok=True)
    check_tensor("v_cache", v_cache, 4, CACHE_LAYOUT, quantized_ok=True)
    quantized = isinstance(k_cache, QuantizedKV), isinstance(v_cache, QuantizedKV)
    if quantized[0] != quantized[1]:
        plain = "v_cache" if quantized[0] else "k_cache"
        raise TypeError(f"{plain} must be a QuantizedKV too: k_cache and v_cache share a format")
    if quantized[0]:
        if k_cache.format != v_cache.format:
            raise TypeError(f"v_cache format {v_cache.format.name} must equal k_cache format "
                            f"{k_cache.format.name}")
        if q.dtype not in COMPUTE_DTYPES:
            raise TypeError(f"q dtype must be one of {COMPUTE_DTYPES} with a quantised cache, "
                            f"got {q.dtype}")
        return
    if k_cache.dtype not in CACHE_DTYPES:
        raise TypeError(f"k_cache dtype must be one of {CACHE_DTYPES}, got {k_cache.dtype}")
    if v_cache.dtype != k_cache.dtype:
        raise TypeError(f"v_cache dtype {v_cache.dtype} must match k_cache dtype {k_cache.dtype}")
    if q.dtype != k_cache.dtype:
        raise TypeError(f"q dtype {q.dtype} must match the cache dtype {k_cache.dtype}")


def check_device(name: str, device: torch.device) -> None:
    """A device that holds values: ``meta`` tensors have none to attend over or write."""
    if device.type == "meta":
        raise ValueError(f"{name} is on meta, a device that holds no values (only shapes): "
                         "create the tensors on the CPU or a GPU")


def check_shapes(q, k_cache, v_cache, block_tables, seq_lens, scale=None) -> Shapes:
    """The metadata checks of ``paged_attention``; reads no tensor value (no sync).

    Args:
        q: ``[batch, num_q_heads, head_dim]``, the cache's dtype (any compute dtype for a
            quantised cache), any strides.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` contiguous
            tensors, or both :class:`~paged_ref.QuantizedKV` of one format (``shape`` is then
            the values' shape).
        block_tables: int32 ``[batch, max_blocks_per_seq]``.
        seq_lens: int32 ``[batch]``.
        scale: as for :func:`check_scale`.

    Returns:
        Shapes: the sizes, for the plan and the value checks.

    Raises:
        TypeError: a wrong type or dtype. ValueError: a wrong rank, shape, device or layout.
    """
    check_tensor("q", q, 3, "[batch, num_q_heads, head_dim]")
    _check_cache_types(q, k_cache, v_cache)
    check_tensor("block_tables", block_tables, 2, "[batch, max_blocks_per_seq]")
    check_tensor("seq_lens", seq_lens, 1, "[batch]")
    for name, t in (("block_tables", block_tables), ("seq_lens", seq_lens)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be torch.int32, got {t.dtype} (use .to(torch.int32))")

    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache shape {tuple(v_cache.shape)} must equal k_cache shape "
                         f"{tuple(k_cache.shape)}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    batch, num_q_heads, q_dim = q.shape
    if block_size < 1 or num_kv_heads < 1 or head_dim < 1:
        raise ValueError(f"k_cache has an empty dimension: shape {tuple(k_cache.shape)}")
    if q_dim != head_dim:
        raise ValueError(f"q head_dim {q_dim} must equal the cache head_dim {head_dim}")
    if num_q_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"q num_q_heads ({num_q_heads}) must be a positive multiple of the "
                         f"cache's num_kv_heads ({num_kv_heads})")
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, q has batch {batch}")
    if seq_lens.shape[0] != batch:
        raise ValueError(f"seq_lens has {seq_lens.shape[0]} entries, q has batch {batch}")

    for name, t in (("k_cache", k_cache), ("v_cache", v_cache), ("block_tables", block_tables),
                    ("seq_lens", seq_lens)):
        for part in _parts(t):
            if part.device != q.device:
                raise ValueError(f"{name} is on {part.device} but q is on {q.device}")
    check_device("q", q.device)
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not all(part.is_contiguous() for part in _parts(cache)):
            raise ValueError(f"{name} must be contiguous (call .contiguous())")
    check_scale(scale)
    return Shapes(batch, num_q_heads, num_kv_heads, head_dim, num_blocks, block_size,
                  block_tables.shape[1])


def check_out(out, q: torch.Tensor) -> None:
    """``out`` is None, or a tensor that can take the result of ``q``'s call.

    Args:
        out: None, or ``q``'s shape, dtype and device with a unit stride in head_dim (other
            strides are the caller's: the result is written through them).
        q: the call's queries.

    Raises:
        TypeError: not a tensor. ValueError: another shape, dtype, device or head_dim stride.
    """
    if out is None:
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} like q, got "
                         f"{tuple(out.shape)} {out.dtype} on {out.device}")
    if out.shape[-1] > 1 and out.stride(-1) != 1:
        raise ValueError(f"out must have stride 1 in its last dimension (head_dim), got strides "
                         f"{out.stride()}: pass out=None (a new contiguous output) or a "
                         "contiguous tensor")


def check_scale(scale) -> float | None:
    """The softmax scale as a Python float.

    Args:
        scale: None (the default ``head_dim ** -0.5``), or a real number: a Python int or
            float, or a NumPy scalar (``np.float32(0.25)``), finite, ``abs(scale) <=
            MAX_ABS_SCALE``; negative and zero scales are allowed. A tensor is refused, even
            0-d: reading it would be a read-back (a sync, and no CUDA graph).

    Returns:
        ``float(scale)``, or None.

    Raises:
        TypeError: not a real number (a bool, a str, a tensor). ValueError: not finite, or
        too large.
    """
    if scale is None:
        return None
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
        raise TypeError(f"scale must be a float (or a NumPy scalar) or None, got "
                        f"{type(scale).__name__}")
    try:
        value = float(scale)
    except OverflowError:  # an int too large for a float, e.g. 10**400
        raise ValueError(f"scale must be finite, got an int of {len(str(scale))} digits") from None
    if value != value or abs(value) == float("inf"):
        raise ValueError(f"scale must be finite, got {scale}")
    if abs(value) > MAX_ABS_SCALE:
        raise ValueError(f"scale must satisfy abs(scale) <= {MAX_ABS_SCALE:g} (larger ones "
                         f"overflow the float32 scores to inf, then NaN), got {scale}")
    return value


def check_values(block_tables: torch.Tensor, seq_lens: torch.Tensor, shapes: Shapes,
                 stats: tuple[int, int, int, int] | None = None) -> Lengths:
    """The lengths and the used table entries.

    ``stats`` is the verdict of the check kernel (:mod:`paged_ref.kernels.triton.checks`,
    which the layer above runs on a GPU): when every check passed it is all this needs.
    Otherwise the checks run on the host: tables up to ``HOST_CHECK_MAX_ENTRIES`` entries go
    there in one copy (one sync on a GPU) and are checked with NumPy (a dozen tiny torch ops
    cost ten times that); larger ones are reduced with torch ops to one small tensor. Either
    way the checks see the tensors' logical values (any strides); a failed check then looks
    up the offending entry for its message.

    Args:
        block_tables: int32 ``[batch, max_blocks_per_seq]``, through :func:`check_shapes`.
        seq_lens: int32 ``[batch]``.
        shapes: from :func:`check_shapes`.
        stats: None, or ``(shortest, longest, total, bad used entries)`` over the batch.

    Returns:
        Lengths: the longest and the total length.

    Raises:
        ValueError: a negative length, one longer than the table holds, or a used entry that
        is no block id, named by its index.
    """
    if shapes.batch == 0:
        return Lengths(0, 0)
    capacity = shapes.max_blocks_per_seq * shapes.block_size
    if stats is not None and stats[0] >= 0 and stats[1] <= capacity and stats[3] == 0:
        return Lengths(stats[1], stats[2])
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
    first_token = torch.arange(0, capacity, shapes.block_size, device=seq_lens.device)
    used = first_token[None, :] < seq_lens[:, None]  # [B, max_blocks]: block j holds tokens
    bad = used & ((block_tables < 0) | (block_tables >= shapes.num_blocks))
    shortest, longest, total, num_bad = torch.stack(
        [seq_lens.min().long(), seq_lens.max().long(), seq_lens.sum(), bad.sum()]).tolist()
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
            f"({shapes.max_blocks_per_seq} blocks x block_size {shapes.block_size} = {capacity})")
    if any_bad:
        bad = bad.cpu().numpy() if isinstance(bad, torch.Tensor) else bad
        b, j = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"block_tables[{b}, {j}] = {int(table[b, j])} is outside [0, num_blocks="
            f"{shapes.num_blocks}) but sequence {b} uses it (seq_lens[{b}] = {int(lens[b])})")
    return Lengths(int(longest), int(total))


def check_prefill_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                         scale=None) -> PrefillLengths:
    """Every check of ``paged_attention`` plus those of ``query_start_loc``, for
    :func:`paged_ref.paged_prefill` (see it for the layouts).

    Reads values back from the device once (one copy; a table of more than
    ``HOST_CHECK_MAX_ENTRIES`` entries is checked on the device).

    Returns:
        PrefillLengths: host lists of cache lengths and query rows, and the Shapes.

    Raises:
        TypeError: a wrong type or dtype. ValueError: a wrong shape, device or value, named.
    """
    check_tensor("q", q, 3, "[total_query_tokens, num_q_heads, head_dim]")
    check_tensor("block_tables", block_tables, 2, "[batch, max_blocks_per_seq]")
    check_tensor("seq_lens", seq_lens, 1, "[batch]")
    check_tensor("query_start_loc", query_start_loc, 1, "[batch + 1]")
    if query_start_loc.dtype != torch.int32:
        raise TypeError(f"query_start_loc must be torch.int32, got {query_start_loc.dtype} "
                        "(use .to(torch.int32))")
    batch = seq_lens.shape[0]
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, seq_lens has {batch}")
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(f"query_start_loc must have batch + 1 = {batch + 1} entries (one per "
                         f"sequence plus the end), got {query_start_loc.shape[0]}")
    if query_start_loc.device != q.device:
        raise ValueError(f"query_start_loc is on {query_start_loc.device} but q is on {q.device}")
    # NOTE: check_shapes validates a decode-shaped q [batch, Hq, D]: hand it a stand-in with
    # q's dtype, device, heads and head_dim (one element, expanded: nothing is copied).
    q_like = q.new_empty(()).expand(batch, q.shape[1], q.shape[2])
    shapes = check_shapes(q_like, k_cache, v_cache, block_tables, seq_lens, scale)
    if block_tables.numel() <= HOST_CHECK_MAX_ENTRIES:
        # One copy to the host of everything the checks read, then the checks there.
        packed = torch.cat([query_start_loc, seq_lens, block_tables.flatten()]).cpu()
        query_start_loc, seq_lens = packed[: batch + 1], packed[batch + 1 : 2 * batch + 1]
        block_tables = packed[2 * batch + 1 :].view(block_tables.shape)
    check_values(block_tables, seq_lens, shapes)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    if starts[0] != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {starts[0]}")
    if starts[-1] != q.shape[0]:
        raise ValueError(f"query_start_loc[-1] = {starts[-1]} must equal the rows of q "
                         f"({q.shape[0]})")
    query_lens = [starts[b + 1] - starts[b] for b in range(batch)]
    for b, n in enumerate(query_lens):
        if n < 0:
            raise ValueError(
                f"query_start_loc must be non-decreasing, but query_start_loc[{b + 1}] = "
                f"{starts[b + 1]} < query_start_loc[{b}] = {starts[b]}")
    for b, n in enumerate(query_lens):
        if n > lens[b]:
            raise ValueError(
                f"sequence {b} has {n} query rows (query_start_loc[{b + 1}] - "
                f"query_start_loc[{b}]) but only seq_lens[{b}] = {lens[b]} tokens in the cache; "
                "the queries are the last tokens of the sequence, so their K/V must be cached")
    return PrefillLengths(lens, query_lens, shapes)


__all__ = ["CACHE_DTYPES", "HOST_CHECK_MAX_ENTRIES", "MAX_ABS_SCALE", "Lengths",
           "PrefillLengths", "Shapes", "check_device", "check_out", "check_prefill_inputs",
           "check_scale", "check_shapes", "check_tensor", "check_values"]
