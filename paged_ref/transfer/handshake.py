"""The handshake both transfer calls share: header, checks, answer, and landing with undo.

Every transfer is five steps, each a message (or a run of them) the other rank waits for:

1. ``src`` sends a **header** (what kind of call, tokens, blocks, mode, layers per message,
   its pool's shape; for a prefix, the token ids follow). A sender that refuses before it
   (the prompt is not computed, an unknown ``seq_id``...) sends a header that says so instead.
2. ``dst`` checks it and asks its manager for blocks (all or nothing), then **answers**
   ``(OK, number)`` or ``(code, 0)``: no room, another pool shape, a ``seq_id`` it holds
   already, prefix caching off, another call. A refusal ends the call on both ranks (they stay
   in step), nothing held.
3. the **payload** (:mod:`.stream`);
4. ``src``'s **trailer**: did every message carry the blocks (a gather may fail half-way)?
5. ``dst``'s **receipt**: did they land? Only then do both calls return.

A receiver that fails after taking its blocks -- the sender died or went silent (a
:class:`~.link.TransferError` after ``timeout`` seconds at most), the trailer says the payload
is bad, a scatter raised -- frees them with ``free_sequence(seq, num_computed=0)``: the blocks go
back to the pool and every hash the call registered over them is dropped, so no prompt ever
hits K/V that never arrived.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import NamedTuple

import torch.distributed as dist

from paged_ref.memory.allocator import OutOfBlocksError
from paged_ref.memory.manager import KVCacheManager
from paged_ref.memory.storage import PagedKVCache
from paged_ref.transfer.link import (
    FAILED,
    NO_ROOM,
    OK,
    OTHER_CALL,
    OTHER_SHAPE,
    Link,
    TransferError,
    reason,
)
from paged_ref.transfer.payload import DTYPES, MODES, check_plain
from paged_ref.transfer.stream import recv_payload, staging_for

SEQUENCE, PREFIX, REFUSED = 1, 2, 3  # what a header announces
KINDS = {SEQUENCE: "send_sequence", PREFIX: "send_prefix"}
HEADER_LEN = 11  # kind, code, tokens, blocks, mode, layers per message, then the pool's shape (5)


class Header(NamedTuple):
    kind: int
    code: int  #: the sender's reason when ``kind`` is REFUSED
    num_tokens: int
    num_blocks: int
    mode: str | None  #: None: a mode this version does not know
    per_chunk: int
    shape: list[int]
    token_ids: list[int] | None  #: a prefix's, which follow its header


def pool_shape(cache: PagedKVCache) -> list[int]:
    """``[layers, block_size, kv_heads, head_dim, dtype#]``, as a header carries it."""
    dtype = DTYPES.index(cache.dtype) if cache.dtype in DTYPES else -1
    return [cache.num_layers, cache.block_size, cache.num_kv_heads, cache.head_dim, dtype]


def send_header(link: Link, cache: PagedKVCache, kind: int, num_tokens: int, num_blocks: int,
                mode: str, per_chunk: int) -> None:
    link.words([kind, OK, num_tokens, num_blocks, MODES.index(mode), per_chunk,
                *pool_shape(cache)], "sending the header")


def refuse_early(link: Link, code: int) -> None:
    """The sender gives up before its header: tell the receiver, so it raises at once instead
    of waiting out its timeout. Best effort: without a process group there is nobody to tell,
    and a peer that cannot be reached is not this call's error (the refusal is). A send waits
    for the peer to receive it (gloo too), so this takes up to ``timeout`` when no receiver
    comes."""
    if link.group is None and not dist.is_initialized():
        return
    try:
        link.words([REFUSED, code] + [0] * (HEADER_LEN - 2), "refusing")
    except Exception:  # noqa: BLE001, S110 -- the refusal's own error is the one to raise
        pass


def hear_header(link: Link) -> Header:
    """The sender's header (and a prefix's token ids); a sender that refused before it is a
    ``ValueError`` here too."""
    kind, code, num_tokens, num_blocks, mode, per_chunk, *shape = link.hear_words(
        HEADER_LEN, "waiting for the header")
    if kind == REFUSED:
        raise ValueError(f"{link.call}: rank {link.peer} refused to send: {reason(code)}")
    ids = None
    if kind == PREFIX and num_tokens > 0:  # (received whatever this rank runs: stay in step)
        ids = link.hear_words(num_tokens, "receiving the prompt's token ids")
    return Header(kind, code, num_tokens, num_blocks,
                  MODES[mode] if 0 <= mode < len(MODES) else None, per_chunk, shape, ids)


def refuse(link: Link, code: int, error: Exception):
    """Answer no (``code``) and raise ``error`` (nothing was taken)."""
    link.say(code, phase="refusing")
    raise error


def check_header(link: Link, cache: PagedKVCache, header: Header, kind: int,
                 num_blocks: int) -> None:
    """Refuse (answer no, raise ``ValueError``) a header of another call, another pool shape,
    or that disagrees with itself (``num_blocks``: what its token count makes here)."""
    if header.kind != kind:
        theirs = KINDS.get(header.kind, f"an unknown call ({header.kind})")
        refuse(link, OTHER_CALL, ValueError(
            f"{link.call}: rank {link.peer} runs {theirs}, which does not pair with this call"))
    mine = pool_shape(cache)
    if header.shape != mine or cache.kv is None:
        if cache.kv is None:
            link.say(OTHER_SHAPE, phase="refusing")
            check_plain(cache)
        refuse(link, OTHER_SHAPE, ValueError(
            f"rank {link.peer}'s pool (layers, block_size, kv_heads, head_dim, dtype#) = "
            f"{header.shape} differs from this pool's {mine}"))
    if header.mode is None or header.per_chunk < 1 or header.num_blocks != num_blocks:
        refuse(link, FAILED, ValueError(
            f"{link.call}: rank {link.peer} sent a header this rank cannot read "
            f"(mode, layers per message, blocks, tokens = {header.mode}, {header.per_chunk}, "
            f"{header.num_blocks}, {header.num_tokens})"))


def admit(link: Link, manager: KVCacheManager, seq_id: Hashable, **kwargs) -> int:
    """``manager.add_sequence(seq_id, **kwargs)``; when it refuses, answer no, then re-raise."""
    try:
        return manager.add_sequence(seq_id, **kwargs)
    except OutOfBlocksError:
        link.say(NO_ROOM, phase="refusing")
        raise
    except Exception:
        link.say(FAILED, phase="refusing")
        raise


def land(link: Link, cache: PagedKVCache, manager: KVCacheManager, seq_id: Hashable,
         table: list[int], mode: str, per_chunk: int, answer: int) -> None:
    """Steps 2-5 on the receiver, which holds ``seq_id`` already: answer ``(OK, answer)``,
    land the payload in blocks ``table``, read the trailer, send the receipt. On any failure
    ``seq_id`` is freed with ``num_computed=0`` (blocks back, its hashes dropped) and the
    error raised: a :class:`TransferError` for the peer's, the local exception for this rank's.
    """
    try:
        try:
            staging = staging_for(cache, mode, per_chunk, len(table))
        except Exception:
            link.say(FAILED, phase="refusing")
            raise
        link.say(OK, answer, phase="answering")
        failure = recv_payload(link, cache, table, mode, per_chunk, staging)
        code, _ = link.hear("waiting for the trailer")
        if failure is None and code == OK:
            link.say(OK, phase="sending the receipt")
            return
        link.say(FAILED, phase="sending the receipt")
        if failure is not None:
            raise failure
        raise TransferError(f"{link.call}: rank {link.peer} gave up half-way through the "
                            f"payload ({reason(code)}); the blocks it had filled are freed",
                            peer=link.peer, phase="waiting for the trailer")
    except BaseException:
        manager.free_sequence(seq_id, num_computed=0)
        raise
