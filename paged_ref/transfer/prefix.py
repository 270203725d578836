"""Moving a computed prompt's full blocks into another rank's *prefix cache*: :func:`send_prefix`
and :func:`recv_prefix` (the handshake: :mod:`.handshake`)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from paged_ref.memory.manager import KVCacheManager
from paged_ref.memory.prefix_cache import check_tokens
from paged_ref.memory.storage import PagedKVCache
from paged_ref.transfer.handshake import (
    PREFIX,
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
    NO_PREFIX_CACHING,
    NOT_COMPUTED,
    OK,
    Link,
    TransferError,
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


def send_prefix(cache: PagedKVCache, manager: KVCacheManager, token_ids: Sequence[int], *,
                dst: int, mode: str = "packed", group=None,
                timeout: float | None = DEFAULT_TIMEOUT) -> Transfer:
    """Send the K/V of a prompt's cached full blocks to rank ``dst``'s *prefix cache*
    (:func:`recv_prefix`): afterwards, rank ``dst``'s ``add_sequence(token_ids=prompt)`` hits
    them, as if it had computed the prompt itself -- how a decode engine takes over a prompt
    that a prefill engine computed (vLLM's KV connectors work this way).

    ``manager`` must have prefix caching on and hold the prompt's full blocks with their K/V
    written (e.g. its engine has just computed the prompt; between two steps). Only full
    blocks travel (at most ``len - 1`` tokens, as a prefix-cache hit always leaves one token
    to compute), and only those the receiver lacks: it answers how many leading tokens it has
    cached already. This manager is only read (``cached_prefix_blocks``): nothing is held,
    registered or counted here, whatever happens. ``timeout``: seconds each wait may take.

    Raises:
        ValueError: before anything is sent (the receiver is told and raises too): prefix
            caching is off, or the prompt's full blocks are not all in this pool (not
            computed, evicted, in the host tier); or the receiver refused (no room, another
            pool shape, prefix caching off there).
        TransferError: the receiver died, went silent for ``timeout`` seconds or could not
            land the payload; it keeps nothing of it.
    """
    timeout = check_timeout(timeout)
    link = Link(dst, group, cache.device, timeout, "send_prefix")
    code = FAILED
    try:
        check_mode(mode)
        check_plain(cache)
        ids = check_tokens(token_ids)
        if not ids:
            raise ValueError("token_ids must not be empty")
        if not manager.enable_prefix_caching:
            raise ValueError("send_prefix needs a KVCacheManager with enable_prefix_caching=True")
        bs = manager.block_size
        full = (len(ids) - 1) // bs * bs  # the tokens a hit can cover (0: nothing travels)
        blocks = manager.cached_prefix_blocks(ids[:full])
        if len(blocks) * bs < full:
            code = NOT_COMPUTED
            raise ValueError(f"only {len(blocks) * bs} of the prompt's {full} leading tokens "
                             "are in this pool's prefix cache; compute the prompt first")
        per_chunk = layers_per_chunk(cache, len(blocks), mode)
        idx = _block_index(cache, blocks)
        staging = staging_for(cache, mode, per_chunk, len(blocks))
    except Exception:
        refuse_early(link, code)
        raise
    sync(cache)
    start = time.perf_counter()
    send_header(link, cache, PREFIX, full + 1, len(blocks), mode, per_chunk)
    link.words(ids[: full + 1], "sending the prompt's token ids")
    code, have = link.hear("waiting for the answer")
    if code != OK:
        raise ValueError(f"rank {dst} refused the prefix: {reason(code)}")
    if have % bs or not 0 <= have <= full:
        link.abandon()
        raise TransferError(f"send_prefix: rank {dst} answered that it has {have} of {full} "
                            "tokens cached, which cannot be", peer=dst,
                            phase="waiting for the answer")
    table = blocks[have // bs:]
    # NOTE: the messages keep the header's layers per message (both sides know it) and the
    # front of the staging buffers, taken for every block before anything was sent.
    failure = send_payload(link, cache, table, mode, per_chunk, idx[have // bs:], staging)
    finish_send(link, failure)
    sync(cache)
    seconds = time.perf_counter() - start
    return Transfer(full, len(table), payload_bytes(cache, len(table)), seconds, mode)


def recv_prefix(cache: PagedKVCache, manager: KVCacheManager, *, src: int, group=None,
                timeout: float | None = DEFAULT_TIMEOUT) -> Transfer:
    """Receive a prompt's full blocks from :func:`send_prefix` on rank ``src`` into this pool's
    prefix cache (``manager`` must have prefix caching on). Blocks it has cached already are
    not sent again. Afterwards nobody holds the new blocks: they are cached (evictable, least
    recently used last) until a request with that prompt hits them. ``timeout``: seconds each
    wait may take (the header too; None: the group's timeout).

    Returns what moved; ``num_tokens`` counts the tokens now cached for that prompt.

    Raises (each after answering the sender, which raises too):
        OutOfBlocksError: no room (nothing held).
        ValueError: prefix caching is off here, the pools' shapes differ, the sender runs
            another call or refused to send (nothing held).
        TransferError: the sender died, went silent for ``timeout`` seconds or gave up
            half-way: the blocks taken are freed and every hash registered over them dropped
            (``free_sequence(num_computed=0)``), so no prompt hits K/V that never arrived.
            (Cached blocks nobody held may have been evicted to make room.)
    """
    link = Link(src, group, cache.device, check_timeout(timeout), "recv_prefix")
    header = hear_header(link)
    start = time.perf_counter()
    bs = manager.block_size
    check_header(link, cache, header, PREFIX, max(header.num_tokens - 1, 0) // bs)
    if not manager.enable_prefix_caching:
        refuse(link, NO_PREFIX_CACHING, ValueError(
            "recv_prefix needs a KVCacheManager with enable_prefix_caching=True"))
    seq = ("transfer", id(header))
    have = admit(link, manager, seq, token_ids=header.token_ids)
    table = manager.block_table(seq)[have // bs : header.num_blocks]
    land(link, cache, manager, seq, table, header.mode, header.per_chunk, have)
    # The payload is in: the full blocks stay cached, holding the sender's K/V.
    manager.free_sequence(seq, num_computed=header.num_blocks * bs)
    sync(cache)
    seconds = time.perf_counter() - start
    return Transfer(header.num_blocks * bs, len(table), payload_bytes(cache, len(table)),
                    seconds, header.mode)
