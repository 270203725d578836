"""The prefix cache's index: which full blocks hold which chain of token ids (vLLM v1's design).

A full block whose token ids are all known is identified by
``hash_block_tokens(parent_hash, its token ids)``, a chain over the whole prefix, so equal hashes
mean equal prefixes. :class:`PrefixCache` keeps, beside the allocator's hash <-> block map:

* per cached hash, its parent hash and token ids (what :class:`CachedBlock` shows);
* per sequence, its token ids (None once one is unknown) and the hashes of its leading full
  blocks, so the block that the next token fills can be hashed;
* per sequence, the blocks it *registered itself* (fresh blocks it filled, as opposed to hits
  and blocks copied back from the host tier, whose K/V were written earlier): the ones
  :meth:`PrefixCache.drop_unwritten` takes back out when the sequence's K/V were not all
  written (``KVCacheManager.free_sequence(seq_id, num_computed=n)``);
* the hit / miss counters of :meth:`KVCacheManager.stats`.

It changes the allocator only through ``cache_block`` / ``uncache_block``; holding and freeing
blocks is the manager's job.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Hashable, Iterable
from typing import NamedTuple

import torch

from paged_ref.memory.allocator import BlockAllocator, check_int

#: Largest token id the block hash accepts (ids are packed as signed 64-bit integers).
MAX_TOKEN_ID = 2**63 - 1


def hash_block_tokens(parent_hash: bytes | None, token_ids: Iterable[int]) -> bytes:
    """The identity of a full block: SHA-256 of its parent's hash and its token ids.

    ``parent_hash`` is the hash of the block before it in the sequence (None for the first
    block), so equal hashes mean equal *prefixes*, not just equal blocks: the same 16 tokens
    after a different prompt start get a different hash. SHA-256 (not Python's ``hash``, where
    ``hash(-1) == hash(-2)``) makes a collision, hence a wrong hit, practically impossible.

    Returns 32 bytes.
    """
    digest = hashlib.sha256(b"root" if parent_hash is None else parent_hash)
    digest.update(array("q", token_ids).tobytes())
    return digest.digest()


def check_token(name: str, token_id) -> int:
    """``token_id`` as an int in ``[0, MAX_TOKEN_ID]``; TypeError / ValueError naming ``name``."""
    token_id = check_int(name, token_id)
    if token_id > MAX_TOKEN_ID:
        raise ValueError(f"{name} must be <= 2**63 - 1, got {token_id}")
    return token_id


def check_tokens(token_ids) -> list[int]:
    """``token_ids`` (a list, tuple, range or 1-D integer tensor) as a list of ints."""
    if type(token_ids) is list and all(type(t) is int for t in token_ids) and (
            not token_ids or 0 <= min(token_ids) and max(token_ids) <= MAX_TOKEN_ID):
        return list(token_ids)  # (the common case, checked at C speed)
    if isinstance(token_ids, torch.Tensor):
        if token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
            raise TypeError(f"token_ids must be a 1-D integer tensor, got "
                            f"{token_ids.dtype} of shape {tuple(token_ids.shape)}")
        token_ids = token_ids.tolist()
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
        raise TypeError(f"token_ids must be a list of ints, got {type(token_ids).__name__}")
    return [check_token(f"token_ids[{i}]", t) for i, t in enumerate(token_ids)]


def check_prompt(num_tokens, token_ids) -> tuple[int, list[int] | None]:
    """``add_sequence``'s prompt: ``(num_tokens, token ids or None)``, checked.

    Give ``num_tokens``, ``token_ids`` (not empty), or both if they agree; TypeError /
    ValueError naming what is wrong otherwise.
    """
    tokens = None if token_ids is None else check_tokens(token_ids)
    if tokens is None and num_tokens is None:
        raise TypeError("add_sequence needs num_tokens or token_ids")
    if tokens is not None:
        if not tokens:
            raise ValueError("token_ids must not be empty")
        if num_tokens is not None and check_int("num_tokens", num_tokens) != len(tokens):
            raise ValueError(f"num_tokens={num_tokens} but token_ids has {len(tokens)} tokens")
        num_tokens = len(tokens)
    return check_int("num_tokens", num_tokens), tokens


class CachedBlock(NamedTuple):
    """One entry of the prefix cache (see :meth:`KVCacheManager.cached_blocks`)."""

    block_id: int  #: where its K/V live
    block_hash: bytes  #: ``hash_block_tokens(parent_hash, token_ids)``
    parent_hash: bytes | None  #: the hash of the block before it (None: a prompt's first)
    token_ids: tuple[int, ...]  #: the ``block_size`` tokens it holds
    ref_count: int  #: sequences holding it now
    evictable: bool  #: held by nobody (not even for an owed copy): next to go when the pool is dry


#: What the cache keeps per hash: ``(parent_hash, token_ids)``.
BlockInfo = tuple[bytes | None, tuple[int, ...]]


class PrefixCache:
    """The index of full cached blocks over ``allocator`` (blocks of ``block_size`` tokens)."""

    def __init__(self, allocator: BlockAllocator) -> None:
        self.allocator = allocator
        self.block_size = allocator.block_size
        self.info: dict[bytes, BlockInfo] = {}  # cached hash -> (parent, tokens), oldest first
        self.tokens: dict[Hashable, list[int] | None] = {}
        self.hashes: dict[Hashable, list[bytes]] = {}
        self.own: dict[Hashable, dict[int, bytes]] = {}  # seq -> {block index j: its hash}
        self.hit_tokens = 0
        self.miss_tokens = 0
        self.host_hit_tokens = 0
        self.disk_hit_tokens = 0
        #: called as ``on_cache(block_hash)`` when a block is registered (the manager drops any
        #: copy of that hash in the host / disk tiers: a block lives in one tier)
        self.on_cache: Callable[[bytes], None] | None = None

    def chain(self, tokens: list[int] | None) -> list[bytes]:
        """Hashes of the full blocks of ``tokens``, each chained to the one before."""
        hashes: list[bytes] = []
        bs = self.block_size
        for j in range(len(tokens) // bs if tokens else 0):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                            tokens[j * bs:(j + 1) * bs]))
        return hashes

    def lookup(self, hashes: list[bytes], host=None) -> list[int | None]:
        """The longest run of ``hashes`` (from the first) that are all cached: per block, its
        device block id, or None where it sits in the tiers below, ``host`` (a ``HostTier``,
        whose disk tier counts: its written blocks)."""
        blocks: list[int | None] = []
        for block_hash in hashes:
            block_id = self.allocator.cached_block(block_hash)
            if block_id is None and (host is None or block_hash not in host):
                break
            blocks.append(block_id)
        return blocks

    def cached_tokens(self, tokens: list[int], host=None, hashes: list[bytes] | None = None
                      ) -> int:
        """How many leading tokens of ``tokens`` ``add_sequence`` would find cached now, in
        this pool or the host tier ``host``: whole blocks, at most ``(len(tokens) - 1) //
        block_size`` of them. Changes nothing (no hit counted, no block held or revived).

        ``hashes``: a memo the caller keeps for one prompt (start it empty): the hashes of its
        leading full blocks computed so far, extended here as needed. ``tokens`` may grow
        between calls, never change what the memo covers.

        NOTE: hashes lazily, up to the first miss: the scheduler asks this of every waiting
        request every step, and with the memo a repeat costs one C-level scan of it.
        """
        bs, n = self.block_size, 0
        limit = (len(tokens) - 1) // bs if tokens else 0
        hashes = [] if hashes is None else hashes
        while n < limit:
            if n == len(hashes):
                hashes.append(hash_block_tokens(hashes[-1] if n else None,
                                                tokens[n * bs:(n + 1) * bs]))
            run = (self.allocator.cached_run(hashes[n:limit]) if host is None
                   else len(self.lookup(hashes[n:limit], host)))
            if not run:
                break
            n += run
        return n * bs

    def in_place(self, tokens: list[int], owed: set[int]) -> list[int]:
        """The device blocks of the longest cached chain of ``tokens``' full blocks, up to the
        first one in ``owed`` (a move still has to fill it). Changes nothing."""
        blocks = []
        for block_id in self.lookup(self.chain(tokens)):  # (no host tier: device blocks only)
            if block_id in owed:
                break
            blocks.append(block_id)
        return blocks

    def admit(self, seq_id: Hashable, tokens: list[int] | None, hashes: list[bytes],
              table: list[int], hit: list[int | None], *, counted: bool,
              from_disk: int = 0) -> None:
        """Track a new sequence (``add_sequence``): its token ids (None: not all known), the
        hashes of its full blocks and its ``table``, whose first ``len(hit)`` blocks were a
        hit (None where the block comes back from the host tier or, ``from_disk`` of them, the
        disk tier). Register its fresh full blocks (its own) and those coming back (hits:
        written before); ``counted``: the prompt's tokens were given, so the lookup counts in
        the hit / miss stats."""
        self.tokens[seq_id] = tokens
        self.hashes[seq_id] = hashes
        self.own[seq_id] = {}
        for j in range(len(hashes)):
            if j >= len(hit) or hit[j] is None:  # a fresh block, or one back from the host
                self.register(seq_id, table, j, own=j >= len(hit))
        if counted:
            bs = self.block_size
            self.hit_tokens += len(hit) * bs
            self.host_hit_tokens += (hit.count(None) - from_disk) * bs
            self.disk_hit_tokens += from_disk * bs
            self.miss_tokens += len(tokens) - len(hit) * bs

    def register(self, seq_id: Hashable, table: list[int], j: int, *, own: bool = True) -> None:
        """Cache block ``j`` of ``seq_id`` (held, full, token ids known) under its hash.

        ``own``: the sequence computes this block's K/V itself (False for a block copied back
        from the host tier: its K/V were computed earlier). Nothing happens if the hash has a
        block already or the block a hash (the first copy stays the cached one).
        """
        hashes, tokens, bs = self.hashes[seq_id], self.tokens[seq_id], self.block_size
        block_hash = hashes[j]
        if self.allocator.cache_block(table[j], block_hash):
            self.info[block_hash] = (hashes[j - 1] if j else None,
                                     tuple(tokens[j * bs:(j + 1) * bs]))
            if own:
                self.own[seq_id][j] = block_hash
            if self.on_cache is not None:
                self.on_cache(block_hash)

    def record_token(self, seq_id: Hashable, token_id: int | None, table: list[int]) -> None:
        """After an append to ``seq_id`` (blocks ``table``): extend its token ids; cache the
        block the token filled."""
        if token_id is None:
            if seq_id in self.tokens:  # (an unknown token: this block and later are uncacheable)
                self.tokens[seq_id] = None
            return
        self.record_tokens(seq_id, [token_id], table)

    def record_tokens(self, seq_id: Hashable, token_ids: list[int], table: list[int]) -> None:
        """:meth:`record_token` for each of ``token_ids`` (checked, none None), in one go."""
        tokens, bs = self.tokens.get(seq_id), self.block_size
        if tokens is None:
            return
        tokens += token_ids
        hashes = self.hashes[seq_id]
        for j in range(len(hashes), len(tokens) // bs):
            hashes.append(hash_block_tokens(hashes[-1] if j else None, tokens[j * bs:(j + 1) * bs]))
            self.register(seq_id, table, j)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child inherits the parent's token ids and hashes, not its registrations: the
        parent computes those blocks (see :meth:`drop_unwritten`)."""
        tokens = self.tokens[parent_id]
        self.tokens[child_id] = None if tokens is None else list(tokens)
        self.hashes[child_id] = list(self.hashes[parent_id])
        self.own[child_id] = {}

    def uncache(self, block_id: int) -> None:
        """Drop ``block_id`` from the prefix cache (if it is there): its K/V are not what its
        hash names."""
        block_hash = self.allocator.block_hash(block_id)
        if block_hash is not None:
            self.allocator.uncache_block(block_id)
            del self.info[block_hash]

    def drop_unwritten(self, seq_id: Hashable, table: list[int], num_computed: int) -> None:
        """Uncache every block ``seq_id`` registered itself whose tokens reach past its first
        ``num_computed`` (those K/V were never written). Hits stay cached."""
        bs = self.block_size
        for j, block_hash in self.own.get(seq_id, {}).items():
            # NOTE: compare the hash: the block may have been uncached since (an owed copy
            # into it was dropped), and then it is no longer this sequence's entry.
            if (j + 1) * bs > num_computed and self.allocator.block_hash(table[j]) == block_hash:
                self.uncache(table[j])

    def forget(self, seq_id: Hashable) -> None:
        """``seq_id`` is freed: its tokens, hashes and registration marks go."""
        self.tokens.pop(seq_id, None)
        self.hashes.pop(seq_id, None)
        self.own.pop(seq_id, None)

    def evicted(self, block_hash: bytes) -> BlockInfo:
        """The allocator evicted the block of ``block_hash``: its entry goes; what it held."""
        return self.info.pop(block_hash)

    def restore(self, block_hash: bytes, info: BlockInfo) -> None:
        """``block_hash`` comes back from the host tier with what it held."""
        self.info[block_hash] = info

    def counts(self) -> dict[str, int]:
        """The hit / miss counters, as ``CacheStats`` names them."""
        return {"prefix_hit_tokens": self.hit_tokens, "prefix_miss_tokens": self.miss_tokens,
                "prefix_host_hit_tokens": self.host_hit_tokens,
                "prefix_disk_hit_tokens": self.disk_hit_tokens}

    def entries(self, ref_count) -> list[CachedBlock]:
        """Every cached entry, oldest registration first; ``ref_count(block_id)`` gives the
        number of sequences holding a block."""
        alloc = self.allocator
        out = []
        for block_hash, (parent, tokens) in self.info.items():
            block_id = alloc.cached_block(block_hash)
            out.append(CachedBlock(block_id, block_hash, parent, tokens, ref_count(block_id),
                                   alloc.is_evictable(block_id)))
        return out
