"""The payload's messages, between the receiver's "yes" and the sender's trailer.

*packed* -- the scattered blocks gathered into contiguous buffers of a few layers each (about
:data:`~.payload.MESSAGES` messages), two in flight, so the gather of the next chunk overlaps the
send of this one; *per_layer* -- the same with one layer a message (what a layer-by-layer
pipeline sends); *per_block* -- one message per (layer, K/V, block), straight from the pool (each
block of each layer's K and V is contiguous: no copy).

A local failure half-way (a gather or a scatter raises) does not stop the messages: both sides
know how many there are, so the sender sends the rest as they are and says so in its trailer,
and the receiver receives the rest without landing them. The two ranks stay in step and the
failure is raised after the trailer and the receipt (:func:`finish_send`,
:func:`~.handshake.land`), on both sides at once.
"""

from __future__ import annotations

import torch

from paged_ref.memory.storage import PagedKVCache
from paged_ref.transfer.link import FAILED, OK, Link, TransferError, reason
from paged_ref.transfer.payload import (
    _block_rows,
    _message,
    _pool_rows,
    _row_numel,
    _staging,
    chunk_bounds,
)

SENDING, RECEIVING = "sending the payload", "receiving the payload"


def staging_for(cache: PagedKVCache, mode: str, per_chunk: int, num_blocks: int):
    """The two message buffers packed / per-layer mode needs (None for per_block or no blocks):
    taken before the answer, so that running out of memory is a refusal, not a failure
    half-way."""
    if mode == "per_block" or num_blocks == 0:
        return None
    return _staging(cache, per_chunk, num_blocks)


def _per_block(cache: PagedKVCache, table: list[int], op, phase: str) -> None:
    """Per-block mode: one message per (layer, K/V, block), straight from / into the pool.
    ``op``: ``link.send`` or ``link.recv``."""
    for layer in range(cache.num_layers):
        for block in table:
            op(cache.k_caches[layer][block], phase)
            op(cache.v_caches[layer][block], phase)


def send_payload(link: Link, cache: PagedKVCache, table: list[int], mode: str, per_chunk: int,
                 idx: torch.Tensor, staging) -> BaseException | None:
    """Send every layer's K and V of blocks ``table`` (``idx``: the same as a device tensor).

    Returns the local failure (an exception from a gather, after which the rest of the
    messages went as they were), or None. A dead or silent peer is a :class:`TransferError`.
    """
    if not table:
        return None
    if mode == "per_block":
        _per_block(cache, table, link.send, SENDING)
        return None
    failure = None
    try:
        rows = _block_rows(cache, idx)
    except Exception as e:  # noqa: BLE001 -- any local failure: the rest goes as filler
        failure = e
    in_flight: list[int | None] = [None, None]
    for i, (layer0, layer1) in enumerate(chunk_bounds(cache.num_layers, per_chunk)):
        if in_flight[i % 2] is not None:
            link.wait(in_flight[i % 2], SENDING, bounded=False)  # its previous send read it
        buf = _message(staging[i % 2], cache, layer1 - layer0, len(table))
        if failure is None:
            try:
                torch.index_select(_pool_rows(cache), 0, rows[:, layer0:layer1].flatten(),
                                   out=buf.view(-1, _row_numel(cache)))
            except Exception as e:  # noqa: BLE001 -- any local failure: the rest goes as filler
                failure = e
        in_flight[i % 2] = link.post_send(buf, SENDING)
    for handle in in_flight:
        if handle is not None:
            link.wait(handle, SENDING)
    return failure


def recv_payload(link: Link, cache: PagedKVCache, table: list[int], mode: str, per_chunk: int,
                 staging) -> BaseException | None:
    """The mirror of :func:`send_payload`: land the payload in blocks ``table``. The next
    message's receive is posted before this one is scattered (one indexed copy into
    ``cache.kv``); the first before the block index is made, so that host work hides behind
    the first message. Returns the local failure (a scatter raised; the rest was received and
    dropped), or None."""
    if not table:
        return None
    if mode == "per_block":
        _per_block(cache, table, link.recv, RECEIVING)
        return None
    bounds = chunk_bounds(cache.num_layers, per_chunk)

    def post(i):
        layer0, layer1 = bounds[i]
        buf = _message(staging[i % 2], cache, layer1 - layer0, len(table))
        return buf, link.post_recv(buf, RECEIVING)

    pending = post(0)
    failure = None
    try:
        idx = torch.as_tensor(table, dtype=torch.long).to(cache.device)  # (ids: the manager's)
        rows = _block_rows(cache, idx)
    except Exception as e:  # noqa: BLE001 -- any local failure: receive the rest, land nothing
        failure = e
    for i, (layer0, layer1) in enumerate(bounds):
        buf, handle = pending
        if i + 1 < len(bounds):
            pending = post(i + 1)
        link.wait(handle, RECEIVING, bounded=i + 1 == len(bounds))
        if failure is None:
            try:
                _pool_rows(cache).index_copy_(0, rows[:, layer0:layer1].flatten(),
                                              buf.view(-1, _row_numel(cache)))
            except Exception as e:  # noqa: BLE001 -- any local failure: receive the rest
                failure = e
    return failure


def finish_send(link: Link, failure: BaseException | None) -> None:
    """After the payload: send the trailer (did every message carry the blocks?), wait for
    the receipt (did they land?). Raises the local ``failure``, or a :class:`TransferError`
    when the receiver could not land the payload."""
    link.say(FAILED if failure is not None else OK, phase="sending the trailer")
    code, _ = link.hear("waiting for the receipt")
    if failure is not None:
        raise failure
    if code != OK:
        raise TransferError(f"{link.call}: rank {link.peer} did not keep the payload: "
                            f"{reason(code)}; it holds nothing of it", peer=link.peer,
                            phase="waiting for the receipt")
