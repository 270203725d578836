"""Moving a sequence's KV blocks from one engine's pool to another's (disaggregated serving).

A prefill engine (rank ``src``) has computed a prompt's K/V: it sits in *its* pool, in
whatever blocks its allocator gave, listed in its block table. A decode engine (rank ``dst``)
has its own pool, allocator and tables. Moving the sequence is three steps:

1. **agree**: ``src`` sends a small header (tokens, blocks, mode, payload shape); ``dst``
   asks *its* manager for blocks (all or nothing) and answers yes or no. Nothing is sent
   into a pool that has no room, and a "no" leaves both sides as they were;
2. **move**: the payload travels through ``torch.distributed`` (NCCL between GPUs, gloo
   between CPU processes): *packed*, *per_layer* or *per_block* (:mod:`.stream`);
3. **land**: ``dst`` scatters the payload into the blocks its allocator gave; its block table
   points at them, and decode goes on there as if the prompt had been computed locally. A
   trailer (did every message carry the blocks?) and a receipt (did they land?) end it.

    # rank 0 (prefill)                         # rank 1 (decode)
    send_sequence(cache0, m0, "req", dst=1)     recv_sequence(cache1, m1, "req", src=0)

Both pools must agree on ``num_layers``, ``block_size``, ``num_kv_heads``, ``head_dim`` and
``dtype`` (checked in the handshake: a mismatch is a ``ValueError`` on both sides, never bytes
landing in the wrong shape).

Failures lose nothing (:mod:`.handshake`): every refusal is answered, so the peer raises at once
(``ValueError``; ``OutOfBlocksError`` on a receiver without room); every wait lasts at most
``timeout`` seconds (default :data:`DEFAULT_TIMEOUT`; on a GPU the payload's waits between
messages only order the streams, the last one is bounded); a peer that dies or goes silent is a
:class:`TransferError` naming it and the phase; a receiver that took blocks frees them, with
every prefix-cache hash over them dropped, before it raises. After a ``TransferError`` the two
ranks are out of step: make a new process group before the next transfer between them. On NCCL
a timed-out operation may also end the group (its watchdog).

Modules: :mod:`.payload` (what moves, how it is cut: ``pack_blocks``, ``chunk_bounds``...),
:mod:`.link` (messages, timeouts, ``TransferError``), :mod:`.stream` (the payload's messages),
:mod:`.handshake` (header, answer, landing with undo), :mod:`.sequence` (``send_sequence`` /
``recv_sequence``), :mod:`.prefix` (``send_prefix`` / ``recv_prefix``).
"""

from paged_ref.transfer.link import DEFAULT_TIMEOUT, REASONS, TransferError
from paged_ref.transfer.payload import (
    MESSAGES,
    MIN_MESSAGE_BYTES,
    MODES,
    Transfer,
    chunk_bounds,
    layers_per_chunk,
    pack_blocks,
    payload_shape,
    unpack_blocks,
)
from paged_ref.transfer.prefix import recv_prefix, send_prefix
from paged_ref.transfer.sequence import recv_sequence, send_sequence

__all__ = ["DEFAULT_TIMEOUT", "MESSAGES", "MIN_MESSAGE_BYTES", "MODES", "REASONS", "Transfer",
           "TransferError", "chunk_bounds", "layers_per_chunk", "pack_blocks", "payload_shape",
           "recv_prefix", "recv_sequence", "send_prefix", "send_sequence", "unpack_blocks"]
