"""Moving one sequence, blocks and all, into another rank's pool: :func:`send_sequence` and
:func:`recv_sequence` (the handshake: :mod:`.handshake`)."""

from __future__ import annotations

import time
from collections.abc import Hashable

from paged_ref.cache_math import blocks_needed
from paged_ref.memory.manager import KVCacheManager
from paged_ref.memory.storage import PagedKVCache
from paged_ref.transfer.handshake import (
    SEQUENCE,
    admit,
    check_header,
    hear_header,
    land,
    refuse,
    refuse_early,
    send_header,
)
from paged_ref.transfer.link import (
    DEFAULT_TIMEOUT,
    FAILED,
    OK,
    SEQ_HELD,
    Link,
    check_timeout,
    reason,
)
from paged_ref.transfer.payload import (
    Transfer,
    _block_index,
    check_mode,
    check_plain,
    layers_per_chunk,
    payload_bytes,
    sync,
)
from paged_ref.transfer.stream import finish_send, send_payload, staging_for


def send_sequence(cache: PagedKVCache, manager: KVCacheManager, seq_id: Hashable, *, dst: int,
                  mode: str = "packed", group=None, chunk_bytes: int | None = None,
                  timeout: float | None = DEFAULT_TIMEOUT) -> Transfer:
    """Send sequence ``seq_id``'s K/V (all layers) to rank ``dst``, which runs
    :func:`recv_sequence`. The local sequence is left as it is (free it once this returns:
    then rank ``dst`` holds it).

    Args:
        chunk_bytes: packed mode's message size (default: about ``MESSAGES`` messages; the
            header tells the receiver).
        timeout: seconds each wait may take (the answer, each message, the receipt); None:
            the process group's timeout.

    Returns what moved; ``seconds`` is wall time from the header to the receipt.

    Raises:
        ValueError: a bad argument or an unknown ``seq_id`` (the receiver is told and raises
            too), or the receiver refused (no room, another pool shape, it holds that
            ``seq_id``); nothing was sent past the header.
        TransferError: the receiver died, went silent for ``timeout`` seconds, or could not
            land the payload; it holds nothing of it.
    """
    timeout = check_timeout(timeout)
    link = Link(dst, group, cache.device, timeout, f"send_sequence({seq_id!r})")
    try:
        check_mode(mode)
        check_plain(cache)
        table = manager.block_table(seq_id)
        num_tokens = manager.seq_len(seq_id)
        per_chunk = layers_per_chunk(cache, len(table), mode, chunk_bytes)
        idx = _block_index(cache, table)  # (checked before anything is sent)
        staging = staging_for(cache, mode, per_chunk, len(table))
    except Exception:
        refuse_early(link, FAILED)
        raise
    sync(cache)
    start = time.perf_counter()
    send_header(link, cache, SEQUENCE, num_tokens, len(table), mode, per_chunk)
    code, _ = link.hear("waiting for the answer")
    if code != OK:
        raise ValueError(f"rank {dst} refused sequence {seq_id!r}: {reason(code)}")
    finish_send(link, send_payload(link, cache, table, mode, per_chunk, idx, staging))
    sync(cache)
    seconds = time.perf_counter() - start
    return Transfer(num_tokens, len(table), payload_bytes(cache, len(table)), seconds, mode)


def recv_sequence(cache: PagedKVCache, manager: KVCacheManager, seq_id: Hashable, *, src: int,
                  group=None, timeout: float | None = DEFAULT_TIMEOUT) -> Transfer:
    """Receive a sequence sent by :func:`send_sequence` on rank ``src`` as ``seq_id``.

    Asks ``manager`` for the blocks first (``add_sequence``, all or nothing), then lands the
    payload in them; afterwards ``manager.block_table(seq_id)`` points at the K/V.
    ``timeout``: seconds each wait may take (the header too; None: the group's timeout).

    Returns what moved; ``seconds`` is wall time from the header to the last block landed.

    Raises (each after answering the sender, which raises too; nothing held or written):
        OutOfBlocksError: the pool has no room.
        ValueError: the pools' shapes differ, ``seq_id`` is held already, the sender runs
            another call or refused to send.
        TransferError: the sender died, went silent for ``timeout`` seconds or gave up
            half-way; the blocks taken for the sequence are freed.
    """
    link = Link(src, group, cache.device, check_timeout(timeout), f"recv_sequence({seq_id!r})")
    header = hear_header(link)
    start = time.perf_counter()
    check_header(link, cache, header, SEQUENCE, blocks_needed(max(header.num_tokens, 0),
                                                              cache.block_size))
    if manager.has_sequence(seq_id):
        refuse(link, SEQ_HELD, ValueError(f"{link.call}: sequence {seq_id!r} already exists "
                                          "on this rank; nothing was received"))
    admit(link, manager, seq_id, num_tokens=header.num_tokens)
    land(link, cache, manager, seq_id, manager.block_table(seq_id), header.mode,
         header.per_chunk, 0)
    sync(cache)
    seconds = time.perf_counter() - start
    return Transfer(header.num_tokens, header.num_blocks,
                    payload_bytes(cache, header.num_blocks), seconds, header.mode)
