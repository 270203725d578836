"""Moving a sequence's KV blocks from one engine's pool to another's (disaggregated serving).

A prefill engine (rank ``src``) has computed a prompt's K/V: it sits in *its* pool, in
whatever blocks its allocator gave, listed in its block table. A decode engine (rank ``dst``)
has its own pool, allocator and tables. Moving the sequence is three steps:

1. **agree**: ``src`` sends a small header (tokens, blocks, mode, payload shape); ``dst``
   asks *its* manager for blocks (all or nothing) and answers yes or no. Nothing is sent
   into a pool that has no room, and a "no" leaves both sides as they were;
2. **move**: the payload travels through ``torch.distributed`` (NCCL between GPUs, gloo
   between CPU processes): *packed* -- the scattered blocks gathered into contiguous buffers
   of a few layers each (about :data:`MESSAGES` messages), two in flight, so the gather of the next
   chunk overlaps the send of this one; *per_layer* -- the same with one layer a message (what
   a layer-by-layer pipeline sends); *per_block* -- one send per (layer, K/V, block), no copy;
3. **land**: ``dst`` scatters the payload into the blocks its allocator gave; its block table
   points at them, and decode goes on there as if the prompt had been computed locally.

    # rank 0 (prefill)                         # rank 1 (decode)
    send_sequence(cache0, m0, "req", dst=1)     recv_sequence(cache1, m1, "req", src=0)

Payload layout: :func:`pack_blocks` and :func:`unpack_blocks` (lesson 11's exercises) gather
every layer into ``[num_layers, 2 (K, V), num_blocks, block_size, num_kv_heads, head_dim]`` and
scatter it back. On the wire a message carries layers ``[l0, l1)`` (:func:`chunk_bounds`) as
``[2 (K, V), l1 - l0, num_blocks, ...]``: the layout of the pool's one tensor ``cache.kv``, so
each gather and scatter is one indexed copy of whole blocks (:func:`_pool_rows`). Both pools
must agree on ``num_layers``, ``block_size``, ``num_kv_heads``, ``head_dim`` and ``dtype``
(checked in the handshake: a mismatch is a ``ValueError`` on both sides, never bytes landing
in the wrong shape).
"""

from __future__ import annotations

import math
import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from paged_ref.memory.allocator import OutOfBlocksError
from paged_ref.memory.manager import KVCacheManager
from paged_ref.memory.storage import PagedKVCache

MODES = ("packed", "per_block", "per_layer")
#: dtypes a header can name (index in this tuple goes over the wire).
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HEADER_LEN = 9  # tokens, blocks, mode, layers per chunk, then the pool's shape (5)


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
    _check_plain(cache)
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
    _check_plain(cache)
    idx = _block_index(cache, block_ids)
    shape = payload_shape(cache, len(idx))
    if tuple(packed.shape) != shape or packed.dtype != cache.dtype:
        raise ValueError(
            f"packed must be {cache.dtype} of shape {shape}, got {packed.dtype} "
            f"{tuple(packed.shape)}"
        )
    rows = _block_rows(cache, idx).transpose(0, 1).flatten()
    _pool_rows(cache).index_copy_(0, rows, packed.reshape(-1, _row_numel(cache)))


def _header(cache: PagedKVCache, num_tokens: int, num_blocks: int, mode: str,
            per_chunk: int) -> torch.Tensor:
    return torch.tensor(
        [num_tokens, num_blocks, MODES.index(mode), per_chunk, cache.num_layers, cache.block_size,
         cache.num_kv_heads, cache.head_dim, _DTYPES.index(cache.dtype)],
        dtype=torch.int64, device=cache.device,
    )


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")


def _check_plain(cache: PagedKVCache) -> None:
    if cache.kv is None:
        raise ValueError("transfers move plain (float16 / bfloat16 / float32) caches; this "
                         f"cache is quantised ({cache.kv_format.name})")


def _sync(cache: PagedKVCache) -> None:
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)


# The handshake. The receiver answers a header with two numbers: (1, n) yes -- n is what the
# sender needs to know (for a prefix: the leading tokens already cached) -- or (0, why) no.
_NO_ROOM, _OTHER_SHAPE = 1, 2


def _answer(cache: PagedKVCache, src: int, group, yes: bool, number: int) -> None:
    dist.send(torch.tensor([int(yes), number], dtype=torch.int64, device=cache.device), src,
              group=group)


def _await_answer(cache: PagedKVCache, dst: int, group, what: str) -> int:
    """The receiver's answer: its number on a yes; on a no, ``ValueError`` with the reason."""
    answer = torch.zeros(2, dtype=torch.int64, device=cache.device)
    dist.recv(answer, dst, group=group)
    yes, number = (int(x) for x in answer.tolist())
    if not yes:
        reason = "its pool's shape differs" if number == _OTHER_SHAPE else "it has no free blocks"
        raise ValueError(f"rank {dst} refused {what}: {reason}")
    return number


def _recv_header(cache: PagedKVCache, src: int, group) -> tuple[int, int, str, int, list[int]]:
    """``(num_tokens, num_blocks, mode, layers per chunk, the sender's pool shape)``."""
    header = torch.empty(_HEADER_LEN, dtype=torch.int64, device=cache.device)
    dist.recv(header, src, group=group)
    num_tokens, num_blocks, mode_code, per_chunk, *shape = (int(x) for x in header.tolist())
    return num_tokens, num_blocks, MODES[mode_code], per_chunk, shape


def _refuse_other_shape(cache: PagedKVCache, shape: list[int], src: int, group) -> None:
    """Say no (and raise ``ValueError``) when the sender's pool shape differs from this one's."""
    mine = [cache.num_layers, cache.block_size, cache.num_kv_heads, cache.head_dim,
            _DTYPES.index(cache.dtype)]
    if shape != mine or cache.kv is None:
        _answer(cache, src, group, False, _OTHER_SHAPE)
        _check_plain(cache)
        raise ValueError(
            f"rank {src}'s pool (layers, block_size, kv_heads, head_dim, dtype#) = {shape} "
            f"differs from this pool's {mine}"
        )


def _add_or_refuse(cache: PagedKVCache, manager: KVCacheManager, seq_id: Hashable, src: int,
                   group, *args, **kwargs) -> int:
    """``manager.add_sequence(seq_id, ...)``; when it has no room, say no, then re-raise."""
    try:
        return manager.add_sequence(seq_id, *args, **kwargs)
    except OutOfBlocksError:
        _answer(cache, src, group, False, _NO_ROOM)
        raise


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


def _per_block(cache: PagedKVCache, table, op, peer: int, group) -> None:
    """Per-block mode: one message per (layer, K/V, block), straight from the cache (each
    block of each layer's K and V is contiguous: no copy). ``op``: ``dist.send`` or
    ``dist.recv``."""
    for layer in range(cache.num_layers):
        for block in table:
            op(cache.k_caches[layer][block], peer, group=group)
            op(cache.v_caches[layer][block], peer, group=group)


def _send_payload(cache, table, mode, dst, group, per_chunk, idx=None):
    """Packed and per-layer: gather layers [l0, l1) into one of two staging buffers and send it
    asynchronously, so the gather of the next chunk overlaps the send of this one. The gather is
    one indexed copy of whole blocks from the pool's one tensor (:func:`_pool_rows`).
    ``idx``: ``table`` as a device tensor, if the caller made it already."""
    if mode == "per_block":
        _per_block(cache, table, dist.send, dst, group)
        return
    idx = _block_index(cache, table) if idx is None else idx
    rows = _block_rows(cache, idx)
    staging = _staging(cache, per_chunk, len(table))
    in_flight = [None, None]
    for i, (layer0, layer1) in enumerate(chunk_bounds(cache.num_layers, per_chunk)):
        if in_flight[i % 2] is not None:
            in_flight[i % 2].wait()  # this buffer's previous send has read it
        buf = _message(staging[i % 2], cache, layer1 - layer0, len(table))
        torch.index_select(_pool_rows(cache), 0, rows[:, layer0:layer1].flatten(),
                           out=buf.view(-1, _row_numel(cache)))
        in_flight[i % 2] = dist.isend(buf, dst, group=group)
    for work in in_flight:
        if work is not None:
            work.wait()


def _recv_payload(cache, table, mode, src, group, per_chunk, idx=None):
    """The mirror of :func:`_send_payload`: the next chunk's receive is posted before this
    chunk is scattered into its blocks (one indexed copy into ``cache.kv``). The first receive
    is posted before the block index is made (``idx`` None): on a 32k-token prompt that host
    work (checks, a copy to the device) took 0.3-0.6 ms, now hidden behind the first message."""
    if mode == "per_block":
        _per_block(cache, table, dist.recv, src, group)
        return
    staging = _staging(cache, per_chunk, len(table))
    bounds = chunk_bounds(cache.num_layers, per_chunk)

    def post(i):
        layer0, layer1 = bounds[i]
        buf = _message(staging[i % 2], cache, layer1 - layer0, len(table))
        return buf, dist.irecv(buf, src, group=group)

    pending = post(0)
    idx = _block_index(cache, table) if idx is None else idx
    rows = _block_rows(cache, idx)
    for i, (layer0, layer1) in enumerate(bounds):
        buf, work = pending
        if i + 1 < len(bounds):
            pending = post(i + 1)
        work.wait()
        _pool_rows(cache).index_copy_(0, rows[:, layer0:layer1].flatten(),
                                      buf.view(-1, _row_numel(cache)))


def send_sequence(cache: PagedKVCache, manager: KVCacheManager, seq_id: Hashable, *, dst: int,
                  mode: str = "packed", group=None, chunk_bytes: int | None = None) -> Transfer:
    """Send sequence ``seq_id``'s K/V (all layers) to rank ``dst``, which runs
    :func:`recv_sequence`. The local sequence is left as it is (free it when done).
    ``chunk_bytes``: packed mode's message size (default: about :data:`MESSAGES` messages; the
    header tells the receiver).

    Raises ``ValueError`` (nothing sent past the header) when the receiver has no room or its
    pool's shape differs; ``dst`` raises too.
    """
    _check_mode(mode)
    _check_plain(cache)
    table = manager.block_table(seq_id)
    num_tokens = manager.seq_len(seq_id)
    per_chunk = layers_per_chunk(cache, len(table), mode, chunk_bytes)
    idx = _block_index(cache, table)  # (checked before anything is sent)
    _sync(cache)
    start = time.perf_counter()
    dist.send(_header(cache, num_tokens, len(table), mode, per_chunk), dst, group=group)
    _await_answer(cache, dst, group, f"sequence {seq_id!r}")
    _send_payload(cache, table, mode, dst, group, per_chunk, idx)
    _sync(cache)
    seconds = time.perf_counter() - start
    return Transfer(num_tokens, len(table), _payload_bytes(cache, len(table)), seconds, mode)


def recv_sequence(cache: PagedKVCache, manager: KVCacheManager, seq_id: Hashable, *, src: int,
                  group=None) -> Transfer:
    """Receive a sequence sent by :func:`send_sequence` on rank ``src`` as ``seq_id``.

    Asks ``manager`` for the blocks first (``add_sequence``, all or nothing), then lands the
    payload in them; afterwards ``manager.block_table(seq_id)`` points at the K/V. Raises
    ``OutOfBlocksError`` (after telling the sender) when the pool has no room, ``ValueError``
    when the pools' shapes differ; in both cases nothing is held or written.
    """
    num_tokens, num_blocks, mode, per_chunk, shape = _recv_header(cache, src, group)
    start = time.perf_counter()
    _refuse_other_shape(cache, shape, src, group)
    _add_or_refuse(cache, manager, seq_id, src, group, num_tokens)
    table = manager.block_table(seq_id)
    if len(table) != num_blocks:  # same block_size on both sides, so this cannot differ
        raise AssertionError(f"expected {num_blocks} blocks, the manager gave {len(table)}")
    _answer(cache, src, group, True, 0)
    _recv_payload(cache, table, mode, src, group, per_chunk)
    _sync(cache)
    seconds = time.perf_counter() - start
    return Transfer(num_tokens, num_blocks, _payload_bytes(cache, num_blocks), seconds, mode)


def send_prefix(cache: PagedKVCache, manager: KVCacheManager, token_ids: Sequence[int], *,
                dst: int, mode: str = "packed", group=None) -> Transfer:
    """Send the K/V of a prompt's cached full blocks to rank ``dst``'s *prefix cache*
    (:func:`recv_prefix`): afterwards, rank ``dst``'s ``add_sequence(token_ids=prompt)`` hits
    them, as if it had computed the prompt itself -- how a decode engine takes over a prompt
    that a prefill engine computed (vLLM's KV connectors work this way).

    ``manager`` must have prefix caching on and hold the prompt's full blocks (e.g. its engine
    has just computed the prompt). Only full blocks travel (at most ``len - 1`` tokens, as a
    prefix-cache hit always leaves one token to compute), and only those the receiver lacks:
    it answers how many leading tokens it has cached already.

    Raises ``ValueError`` (before any payload is sent) when this manager does not have the
    blocks cached, or the receiver refuses (no room, other pool shape).
    """
    _check_mode(mode)
    _check_plain(cache)
    bs = manager.block_size
    ids = [int(t) for t in token_ids]
    if not ids:
        raise ValueError("token_ids must not be empty")
    full = (len(ids) - 1) // bs * bs  # the tokens a hit can cover (0: nothing travels)
    seq = ("transfer", id(ids))
    cached = manager.add_sequence(seq, token_ids=ids[: full + 1])
    try:
        if cached < full:
            raise ValueError(f"only {cached} of the prompt's {full} leading tokens are in this "
                             "pool's prefix cache; compute the prompt first")
        table = manager.block_table(seq)[: full // bs]
        _sync(cache)
        start = time.perf_counter()
        per_chunk = layers_per_chunk(cache, len(table), mode)
        dist.send(_header(cache, full + 1, len(table), mode, per_chunk), dst, group=group)
        dist.send(torch.tensor(ids[: full + 1], dtype=torch.int64, device=cache.device), dst,
                  group=group)
        have = _await_answer(cache, dst, group, "the prefix") // bs  # blocks it has already
        table = table[have:]
        if table:
            _send_payload(cache, table, mode, dst, group,
                          layers_per_chunk(cache, len(table), mode))
        _sync(cache)
        seconds = time.perf_counter() - start
    finally:
        manager.free_sequence(seq)  # the blocks stay cached here
    return Transfer(full, len(table), _payload_bytes(cache, len(table)), seconds, mode)


def recv_prefix(cache: PagedKVCache, manager: KVCacheManager, *, src: int,
                group=None) -> Transfer:
    """Receive a prompt's full blocks from :func:`send_prefix` on rank ``src`` into this pool's
    prefix cache (``manager`` must have prefix caching on). Blocks it has cached already are
    not sent again. Afterwards nobody holds the new blocks: they are cached (evictable, least
    recently used last) until a request with that prompt hits them.

    Returns what moved; ``num_tokens`` counts the tokens now cached for that prompt.
    Raises ``OutOfBlocksError`` / ``ValueError`` as :func:`recv_sequence` (nothing changed).
    """
    if not manager.enable_prefix_caching:
        raise ValueError("recv_prefix needs a KVCacheManager with enable_prefix_caching=True")
    num_tokens, num_blocks, mode, per_chunk, shape = _recv_header(cache, src, group)
    start = time.perf_counter()
    ids = torch.empty(num_tokens, dtype=torch.int64, device=cache.device)
    dist.recv(ids, src, group=group)
    _refuse_other_shape(cache, shape, src, group)
    seq = ("transfer", id(ids))
    have = _add_or_refuse(cache, manager, seq, src, group, token_ids=ids.tolist())
    try:
        _answer(cache, src, group, True, have)
        bs = manager.block_size
        table = manager.block_table(seq)[have // bs : num_blocks]
        if table:
            _recv_payload(cache, table, mode, src, group,
                          layers_per_chunk(cache, len(table), mode))
        _sync(cache)
        seconds = time.perf_counter() - start
    finally:
        manager.free_sequence(seq)  # full blocks stay cached, now holding the sender's K/V
    return Transfer(num_blocks * manager.block_size, len(table),
                    _payload_bytes(cache, len(table)), seconds, mode)


def _payload_bytes(cache: PagedKVCache, num_blocks: int) -> int:
    return num_blocks * cache.block_size * cache.bytes_per_token


__all__ = ["MODES", "Transfer", "chunk_bounds", "pack_blocks", "payload_shape", "recv_prefix",
           "recv_sequence", "send_prefix", "send_sequence", "unpack_blocks"]
