"""The payload of a transfer: every layer's K and V of a list of blocks, and how it is cut.

:func:`pack_blocks` and :func:`unpack_blocks` (lesson 11's exercises) gather every layer into
``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`` and scatter it back.
On the wire a message carries layers ``[l0, l1)`` (:func:`chunk_bounds`) as
``[2 (K, V), l1 - l0, num_blocks, ...]``: the layout of the pool's one tensor ``cache.kv``, so
each gather and scatter is one indexed copy of whole blocks (:func:`_pool_rows`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from paged_ref.memory.storage import PagedKVCache

MODES = ("packed", "per_block", "per_layer")
#: dtypes a header can name (index in this tuple goes over the wire).
DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class Transfer:
    """What one :func:`send_sequence` / :func:`recv_sequence` moved.

    ``payload_bytes`` counts K and V of every block moved (whole blocks, so a half-filled last
    block travels whole); ``seconds`` is wall time from the header to the last byte (after a
    device synchronise), on the side that measured it.
    """

    num_tokens: int
    num_blocks: int
    payload_bytes: int
    seconds: float
    mode: str

    @property
    def gbps(self) -> float:
        """Payload GB/s (1e9 bytes per second)."""
        return self.payload_bytes / self.seconds / 1e9 if self.seconds > 0 else float("inf")


def _block_index(cache: PagedKVCache, block_ids: Sequence[int]) -> torch.Tensor:
    """``block_ids`` as an int64 tensor on the cache's device, checked on the host first (in
    range, no repeats) with whole-array operations: a 32k-token prompt has 2,048 blocks, and a
    Python loop over them cost a millisecond on the transfer's critical path."""
    ids = torch.as_tensor(list(block_ids), dtype=torch.long)
    if len(ids):
        bad = torch.nonzero((ids < 0) | (ids >= cache.num_blocks))
        if len(bad):
            j = int(bad[0])
            raise ValueError(f"block_ids[{j}] = {int(ids[j])} is outside "
                             f"[0, num_blocks={cache.num_blocks})")
        if len(torch.unique(ids)) != len(ids):
            raise ValueError(f"block_ids repeats a block: {ids.tolist()}")
    return ids.to(cache.device)


def payload_shape(cache: PagedKVCache, num_blocks: int) -> tuple[int, ...]:
    """``(num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)``."""
    return (cache.num_layers, 2, num_blocks, cache.block_size, cache.num_kv_heads,
            cache.head_dim)


def pack_blocks(cache: PagedKVCache, block_ids: Sequence[int],
                out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather blocks ``block_ids`` of every layer's K and V into one contiguous tensor.

    Returns ``[num_layers, 2, len(block_ids), block_size, num_kv_heads, head_dim]`` (a copy;
    ``out`` may be given, contiguous and of that shape and dtype). One indexed copy of whole
    blocks from the pool's one tensor (:func:`_pool_rows`).
    """
    check_plain(cache)
    idx = _block_index(cache, block_ids)
    shape = payload_shape(cache, len(idx))
    if out is None:
        out = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    elif tuple(out.shape) != shape or out.dtype != cache.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {cache.dtype} tensor of shape {shape}")
    rows = _block_rows(cache, idx).transpose(0, 1).flatten()  # [layers, 2 (K, V), blocks]
    torch.index_select(_pool_rows(cache), 0, rows, out=out.view(-1, _row_numel(cache)))
    return out


def unpack_blocks(cache: PagedKVCache, block_ids: Sequence[int], packed: torch.Tensor) -> None:
    """Scatter a :func:`pack_blocks` payload into blocks ``block_ids`` of ``cache``."""
    check_plain(cache)
    idx = _block_index(cache, block_ids)
    shape = payload_shape(cache, len(idx))
    if tuple(packed.shape) != shape or packed.dtype != cache.dtype:
        raise ValueError(
            f"packed must be {cache.dtype} of shape {shape}, got {packed.dtype} "
            f"{tuple(packed.shape)}"
        )
    rows = _block_rows(cache, idx).transpose(0, 1).flatten()
    _pool_rows(cache).index_copy_(0, rows, packed.reshape(-1, _row_numel(cache)))


def check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def check_plain(cache: PagedKVCache) -> None:
    if cache.kv is None:
        raise ValueError("transfers move plain (float16 / bfloat16 / float32) caches; this "
                         f"cache is quantised ({cache.kv_format.name})")


def sync(cache: PagedKVCache) -> None:
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)


#: Packed mode sends the layers in about this many messages (two in flight), each at least
#: :data:`MIN_MESSAGE_BYTES`. Measured on two H200s (results/h200x2/transfer.json, 8B-like
#: shape): for a 32k-token prompt, 8 messages of 4 layers (512 MiB) reached 76 % of the copy
#: bandwidth, 16 of 2 layers 70 %, 4 of 8 layers 73 %; for 8k tokens, messages of 128 MiB
#: (4 layers) were the fastest; short prompts go best in one message.
MESSAGES = 8
MIN_MESSAGE_BYTES = 128 << 20


def layers_per_chunk(cache: PagedKVCache, num_blocks: int, mode: str,
                     chunk_bytes: int | None = None) -> int:
    """Layers per message: one for ``per_layer``; for ``packed`` as many as fit in
    ``chunk_bytes`` (at least one layer, at most all), by default enough for about
    :data:`MESSAGES` messages of at least :data:`MIN_MESSAGE_BYTES`."""
    if mode == "per_layer":
        return 1
    if chunk_bytes is not None and chunk_bytes <= 0:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    per_layer = max(1, num_blocks * cache.block_size * cache.bytes_per_token // cache.num_layers)
    if chunk_bytes is None:
        layers = max(-(-cache.num_layers // MESSAGES), MIN_MESSAGE_BYTES // per_layer)
    else:
        layers = chunk_bytes // per_layer
    return max(1, min(cache.num_layers, layers))


def chunk_bounds(num_layers: int, per_chunk: int) -> list[tuple[int, int]]:
    """Layer ranges ``[l0, l1)`` of the payload's messages: ``per_chunk`` layers each, except
    the first and the last message, one layer each -- the first gather and the last scatter are
    the only copies no send overlaps, so they are kept short. (Both ranks compute the same
    ranges from the header's ``per_chunk``.)"""
    if per_chunk >= num_layers:
        return [(0, num_layers)]
    bounds, layer0 = [(0, 1)], 1
    while layer0 < num_layers - 1:
        layer1 = min(layer0 + per_chunk, num_layers - 1)
        bounds.append((layer0, layer1))
        layer0 = layer1
    return bounds + [(num_layers - 1, num_layers)]


def _staging(cache, per_chunk, num_blocks):
    """Two flat message buffers, each room for ``per_chunk`` layers of ``num_blocks`` blocks."""
    numel = 2 * per_chunk * num_blocks * cache.block_size * cache.num_kv_heads * cache.head_dim
    return [torch.empty(numel, dtype=cache.dtype, device=cache.device) for _ in range(2)]


def _row_numel(cache) -> int:
    """Elements of one block of one layer's K (or V): ``block_size * Hkv * D``."""
    return cache.block_size * cache.num_kv_heads * cache.head_dim


def _pool_rows(cache) -> torch.Tensor:
    """``cache.kv`` as ``[2 * num_layers * num_blocks, block]`` rows: row
    ``(kv * num_layers + layer) * num_blocks + block``. An indexed copy along dim 0 of this
    view moves whole contiguous blocks (the fast path), for any layers, K and V, in one launch."""
    return cache.kv.view(-1, _row_numel(cache))


def _block_rows(cache, idx: torch.Tensor) -> torch.Tensor:
    """Rows of :func:`_pool_rows` for blocks ``idx``: int64 ``[2, num_layers, len(idx)]``."""
    kv_layer = torch.arange(2 * cache.num_layers, device=idx.device).view(2, -1, 1)
    return kv_layer * cache.num_blocks + idx


def _message(buffer, cache, num_layers, num_blocks):
    """A contiguous view ``[2 (K, V), num_layers, num_blocks, block_size, Hkv, D]`` of the start
    of a staging buffer: what one message carries."""
    shape = (2, num_layers) + payload_shape(cache, num_blocks)[2:]
    return buffer[: math.prod(shape)].view(shape)


def payload_bytes(cache: PagedKVCache, num_blocks: int) -> int:
    return num_blocks * cache.block_size * cache.bytes_per_token
