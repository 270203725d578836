"""KV-cache manager: one block table per sequence, built on a :class:`BlockAllocator`.

A sequence of ``n`` tokens holds ``ceil(n / block_size)`` blocks, listed in its *block table*:
token ``t`` lives in block ``table[t // block_size]`` at offset ``t % block_size``, and its
*slot* (its row in the cache flattened to ``[num_blocks * block_size, ...]``) is
``table[t // block_size] * block_size + t % block_size``.

    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", 6)        # prompt of 6 tokens -> 2 blocks: [0, 1]
    m.slot_mapping("a")           # [0, 1, 2, 3, 4, 5]  (where prefill writes the prompt's K/V)
    m.append_slot("a")            # 6: token 6 goes in block 1, offset 2 (no new block)
    m.append_slot("a")            # 7
    m.append_slot("a")            # 8: length 8 is a multiple of 4 -> a new block (2)
    m.free_sequence("a")          # all three blocks go back to the allocator

Sharing blocks (lesson 07). Blocks carry reference counts, so sequences can share them:

* ``fork(parent, child)``: the child shares every block of the parent (parallel sampling,
  beam search). The first write into a shared, partly filled last block is a *copy-on-write*:
  ``append_slot`` gives the writer a fresh block and records ``(src, dst)``;
  ``take_copies()`` hands those pairs over and ``PagedKVCache.copy_blocks(pairs)`` performs
  them, once per step, *before* the step writes any K/V. A sequence freed while its copy is
  still owed (preempted or aborted in the middle of a step): the copy *into* its block is
  dropped (nobody will read that block; if it was cached, it is uncached: it never got its
  K/V), and the copy's *source* stays held until ``take_copies()`` hands the copy out, even if
  every sequence holding it is freed, so no other sequence can be given that block and write
  into it before it is read.
* prefix caching (``enable_prefix_caching=True``, vLLM v1's design): a full block whose token
  ids are all known is identified by ``hash_block_tokens(parent_hash, its token ids)``, a chain
  over the whole prefix. ``add_sequence(seq_id, token_ids=...)`` shares the longest chain of
  cached blocks and returns how many tokens it covers; blocks that nobody holds stay cached
  (evictable, least recently used first) until the pool needs them. A block is registered as
  soon as its token ids are known (at ``add_sequence`` or at the ``append_slot`` that fills
  it): the caller writes its K/V in that same step, before attention reads it.

Invariants: a write never changes what another sequence reads. It lands in a block no other
sequence holds, save one case: a prompt admitted in the same step may hit the block that step's
token fills (registered when it filled), and then the write is the very token that block is
cached for. A hit only returns blocks whose tokens equal the prompt's; eviction never takes a
held block; ``num_free_blocks`` counts plain free + evictable blocks. Every method that changes
state either succeeds or raises with nothing changed. An unknown ``seq_id`` is a
``ValueError`` naming the id, whatever the method.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from typing import NamedTuple

import torch

from paged_ref.cache_math import blocks_needed, token_slot, token_slots
from paged_ref.memory.allocator import BlockAllocator, OutOfBlocksError, check_int
from paged_ref.memory.host_tier import HostTier

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


class BlockOps(NamedTuple):
    """Block moves a step owes, in the order to perform them (before writing any K/V):
    ``PagedKVCache.apply_block_ops(ops)`` runs them."""

    swap_out: list[tuple[int, int]]  #: (device block, host slot): spill evicted cached blocks
    swap_in: list[tuple[int, int]]  #: (host slot, device block): bring host hits back
    copies: list[tuple[int, int]]  #: (src, dst) device blocks: copy-on-write


class CachedBlock(NamedTuple):
    """One entry of the prefix cache (see :meth:`KVCacheManager.cached_blocks`)."""

    block_id: int  #: where its K/V live
    block_hash: bytes  #: ``hash_block_tokens(parent_hash, token_ids)``
    parent_hash: bytes | None  #: the hash of the block before it (None: a prompt's first)
    token_ids: tuple[int, ...]  #: the ``block_size`` tokens it holds
    ref_count: int  #: sequences holding it now
    evictable: bool  #: held by nobody (not even for an owed copy): next to go when the pool is dry


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of how the cache is used. Counts are in blocks or tokens, as named."""

    num_blocks: int  #: blocks in the pool
    block_size: int  #: tokens per block
    blocks_used: int  #: blocks held (a shared block once; with the source of an owed copy)
    blocks_free: int  #: blocks the allocator can still hand out (plain free + evictable)
    tokens_stored: int  #: tokens held, summed over sequences (shared tokens count per sequence)
    slots_reserved_empty: int  #: slots in used blocks that hold no token yet (internal waste)
    num_sequences: int  #: sequences held
    blocks_evictable: int = 0  #: cached blocks nobody holds (part of ``blocks_free``)
    blocks_shared: int = 0  #: used blocks held by more than one sequence
    prefix_hit_tokens: int = 0  #: prompt tokens found in the prefix cache, over all lookups
    prefix_miss_tokens: int = 0  #: prompt tokens that had to be computed, over all lookups
    prefix_host_hit_tokens: int = 0  #: of the hits, tokens copied back from the host tier
    blocks_on_host: int = 0  #: evicted cached blocks kept in the host tier

    @property
    def slots_used(self) -> int:
        """Token slots in used blocks: ``blocks_used * block_size``."""
        return self.blocks_used * self.block_size

    @property
    def utilization(self) -> float:
        """Share of reserved slots that hold a token: ``1 - slots_reserved_empty / slots_used``.

        1.0 when no block is used (nothing is reserved, so nothing is wasted).
        """
        return 1.0 if self.blocks_used == 0 else 1 - self.slots_reserved_empty / self.slots_used

    @property
    def prefix_hit_rate(self) -> float:
        """Share of looked-up prompt tokens served by the prefix cache (0.0 before any)."""
        total = self.prefix_hit_tokens + self.prefix_miss_tokens
        return 0.0 if total == 0 else self.prefix_hit_tokens / total


class KVCacheManager:
    """Block tables for many sequences that share one pool of blocks.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: keep full blocks with known token ids findable by hash, so a
            later prompt with the same prefix reuses them (see the module docstring).
        num_host_blocks: size of a host tier (prefix caching only; 0 = none): an evicted
            cached block is spilled there and a later hit copies it back instead of
            recomputing it. The caller then runs :meth:`take_block_ops` each step.

    ``seq_id`` may be any hashable value (an int or a str in the lessons).
    """

    def __init__(
        self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
        num_host_blocks: int = 0,
    ) -> None:
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError(
                f"enable_prefix_caching must be a bool, got {type(enable_prefix_caching).__name__}"
            )
        if check_int("num_host_blocks", num_host_blocks) and not enable_prefix_caching:
            raise ValueError("num_host_blocks > 0 needs enable_prefix_caching=True")
        self._host = HostTier(num_host_blocks) if num_host_blocks else None
        self._host_info: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}
        self._swap_out: list[tuple[int, int]] = []
        self._swap_in: list[tuple[int, int]] = []
        self._host_hit_tokens = 0
        self._allocator = BlockAllocator(num_blocks, block_size, on_evict=self._on_evict)
        self._prefix_caching = enable_prefix_caching
        self._tables: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}
        # Prefix caching only: each sequence's token ids (None once one is unknown) and the
        # hashes of its leading full blocks; per cached hash, its parent hash and token ids.
        self._tokens: dict[Hashable, list[int] | None] = {}
        self._hashes: dict[Hashable, list[bytes]] = {}
        self._cached: dict[bytes, tuple[bytes | None, tuple[int, ...]]] = {}
        self._copies: list[tuple[int, int]] = []
        # Sources of owed copies whose last holder was freed: held here until the copy is
        # handed out (each one is a reference in the allocator, not a sequence's).
        self._pinned: list[int] = []
        self._hit_tokens = 0
        self._miss_tokens = 0

    # ---- sizes ------------------------------------------------------------------------------

    @property
    def allocator(self) -> BlockAllocator:
        """The allocator that owns the free blocks (read it; change it only through here)."""
        return self._allocator

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._allocator.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._allocator.block_size

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether full blocks are cached by hash."""
        return self._prefix_caching

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds: plain free + evictable (cached, held by nobody)."""
        return self._allocator.num_free_blocks

    @property
    def seq_ids(self) -> list[Hashable]:
        """Ids of the sequences held, oldest first (a new list)."""
        return list(self._tables)

    def has_sequence(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` is held."""
        try:
            return seq_id in self._tables
        except TypeError:  # unhashable: cannot be held
            return False

    def __contains__(self, seq_id: Hashable) -> bool:
        return self.has_sequence(seq_id)

    def __len__(self) -> int:
        return len(self._tables)

    # ---- changing state ---------------------------------------------------------------------

    def add_sequence(
        self, seq_id: Hashable, num_tokens: int | None = None, *, token_ids=None
    ) -> int:
        """Start sequence ``seq_id`` with its prompt, all or nothing.

        Give ``num_tokens`` (the prompt's length) or ``token_ids`` (the prompt itself; both
        only if they agree). With prefix caching on and ``token_ids`` given, the longest chain
        of cached full blocks that starts the prompt is shared instead of taking new blocks,
        but always leaving at least one token to compute (so a hit is at most
        ``(len(token_ids) - 1) // block_size`` blocks). Blocks for the rest are fresh.

        Returns:
            How many leading tokens are already cached (their K/V need not be computed): a
            multiple of ``block_size``, ``< len(token_ids)``; 0 without prefix caching or
            without ``token_ids``.

        Raises:
            ValueError: ``seq_id`` is already held, ``num_tokens`` is negative, ``token_ids``
                is empty, holds a negative id, or disagrees with ``num_tokens``.
            TypeError: ``seq_id`` is not hashable, neither length nor tokens given, or a
                length / token id is not an int.
            OutOfBlocksError: too few free blocks; no block is taken.
        """
        self._check_new_id("seq_id", seq_id)
        tokens = None if token_ids is None else self._check_tokens(token_ids)
        if tokens is None and num_tokens is None:
            raise TypeError("add_sequence needs num_tokens or token_ids")
        if tokens is not None:
            if not tokens:
                raise ValueError("token_ids must not be empty")
            if num_tokens is not None and check_int("num_tokens", num_tokens) != len(tokens):
                raise ValueError(
                    f"num_tokens={num_tokens} but token_ids has {len(tokens)} tokens"
                )
            num_tokens = len(tokens)
        num_tokens = check_int("num_tokens", num_tokens)

        bs = self.block_size
        if not self._prefix_caching:
            tokens = None  # nothing to hash
        elif tokens is None and num_tokens == 0:
            tokens = []  # every token id is known (there are none yet)
        hashes = self._chain(tokens)
        hit = self._lookup(hashes[: (num_tokens - 1) // bs]) if tokens else []
        shared = [b for b in hit if b is not None]  # on the device; None = on the host
        fresh = blocks_needed(num_tokens, bs) - len(shared)
        available = self.num_free_blocks - sum(self._allocator.is_evictable(b) for b in shared)
        if fresh > available:
            cached = f" ({len(hit) * bs} cached)" if hit else ""
            raise OutOfBlocksError(
                f"sequence {seq_id!r} needs {fresh} blocks for {num_tokens} tokens{cached} "
                f"but only {available} of {self.num_blocks} are free"
            )
        for block_id in shared:
            self._allocator.add_ref(block_id)  # revives an evictable block first
        from_host = {j: self._host.take(hashes[j]) for j, b in enumerate(hit) if b is None}
        table = [self._allocator.allocate() if b is None else b for b in hit]
        table += [self._allocator.allocate() for _ in range(fresh - len(from_host))]
        for j, slot in from_host.items():
            self._swap_in.append((slot, table[j]))
            del self._host_info[hashes[j]]
        for j in range(len(hashes)):
            if j >= len(hit) or hit[j] is None:  # a fresh block, or one back from the host
                self._register(table[j], hashes[j], hashes[j - 1] if j else None, tokens, j)
        self._tables[seq_id] = table
        self._lens[seq_id] = num_tokens
        if self._prefix_caching:
            self._tokens[seq_id] = tokens
            self._hashes[seq_id] = hashes
        if self._prefix_caching and token_ids is not None:
            self._hit_tokens += len(hit) * bs
            self._host_hit_tokens += len(from_host) * bs
            self._miss_tokens += num_tokens - len(hit) * bs
        return len(hit) * bs

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares all its blocks.

        No block is taken and no K/V is copied: each block's reference count goes up by one.
        The child inherits the parent's length and token ids. The first ``append_slot`` of
        either into a shared, partly filled last block copies that block (copy-on-write).

        Raises:
            ValueError: ``parent_id`` is unknown or ``child_id`` is already held.
            TypeError: ``child_id`` is not hashable.
        """
        table = self._table(parent_id)
        self._check_new_id("child_id", child_id)
        for block_id in table:
            self._allocator.add_ref(block_id)
        self._tables[child_id] = list(table)
        self._lens[child_id] = self._lens[parent_id]
        if self._prefix_caching:
            tokens = self._tokens[parent_id]
            self._tokens[child_id] = None if tokens is None else list(tokens)
            self._hashes[child_id] = list(self._hashes[parent_id])

    def append_slot(self, seq_id: Hashable, token_id: int | None = None) -> int:
        """Grow ``seq_id`` by one token and return that token's slot.

        A new block is taken when the current length is a multiple of ``block_size``
        (including length 0). Otherwise the token goes into the last block's next free slot,
        unless another sequence also holds that block: then the writer gets a fresh block and
        a copy ``(shared block, fresh block)`` is recorded for :meth:`take_copies`
        (copy-on-write), so the write never lands in a shared block.

        ``token_id`` feeds the prefix cache: the block it fills is cached under its hash. A
        token appended without one makes this block, and all later blocks of the sequence,
        uncacheable.

        Raises:
            ValueError: unknown ``seq_id``, or a negative ``token_id``.
            TypeError: ``token_id`` is not an int.
            OutOfBlocksError: a new block is needed and none is free; nothing changes.
        """
        table = self._table(seq_id)
        if token_id is not None:
            token_id = self._check_token("token_id", token_id)
        pos = self._lens[seq_id]
        if pos % self.block_size == 0:
            table.append(self._allocator.allocate())  # raises before anything changes
        elif self.ref_count(table[-1]) > 1:  # shared: copy on write
            fresh = self._allocator.allocate()  # raises before anything changes
            self._allocator.free(table[-1])  # still held by the others
            self._copies.append((table[-1], fresh))
            table[-1] = fresh
        self._lens[seq_id] = pos + 1
        self._record_token(seq_id, token_id)
        return token_slot(table, pos, self.block_size)

    def append_slots(self, seq_ids: Iterable[Hashable], token_ids=None) -> list[int]:
        """One decode step: :meth:`append_slot` for each of ``seq_ids``, all or nothing.

        Args:
            seq_ids: distinct sequence ids.
            token_ids: optional, one token id per sequence (feeds the prefix cache).

        Returns the slots in the order given (the decode step's slot mapping).

        Raises:
            ValueError: an unknown or repeated id, or ``token_ids`` of another length.
            OutOfBlocksError: the step needs more new blocks (boundaries + copy-on-writes)
                than are free; nothing changes.
        """
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self._table(seq_id)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids repeats an id: {seq_ids!r}")
        if token_ids is None:
            token_ids = [None] * len(seq_ids)
        else:
            token_ids = self._check_tokens(token_ids)
            if len(token_ids) != len(seq_ids):
                raise ValueError(
                    f"token_ids has {len(token_ids)} ids for {len(seq_ids)} sequences"
                )
        needed = self._blocks_for_step(seq_ids)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"this step needs {needed} new blocks but only {self.num_free_blocks} "
                f"of {self.num_blocks} are free"
            )
        return [self.append_slot(s, t) for s, t in zip(seq_ids, token_ids, strict=True)]

    def free_sequence(self, seq_id: Hashable) -> None:
        """Forget ``seq_id`` and drop its hold on each of its blocks. ``ValueError`` if unknown.

        A block nobody holds any more goes back to the pool; if it is cached (full, hashed) it
        stays findable as evictable. The last block is released first, so a prompt's later
        blocks are evicted before its first ones.

        Copy-on-writes still owed (recorded by ``append_slot``, not yet taken by
        :meth:`take_copies`): a copy *into* a block that nobody holds any more is dropped and
        that block is uncached (it never got the K/V its hash names); the *source* of a copy
        that is still owed is not released with its last holder but kept until the copy is
        taken, so it cannot be handed out and overwritten before the copy reads it. (The
        freed sequence's own token of this step is never written: if it filled a block in
        place, that block is cached without it. Free such a sequence between steps.)
        """
        table = self._table(seq_id)
        dropping = Counter(table)  # this sequence's holds, per block

        def held_after(block_id: int) -> bool:
            return self._allocator.ref_count(block_id) > dropping[block_id]

        owed = [(s, d) for s, d in self._copies if held_after(d)]
        for _, dst in set(self._copies) - set(owed):
            self._uncache(dst)
        keep = {s for s, _ in owed if not held_after(s)}  # last holder leaving, copy owed
        for block_id in reversed(table):
            if block_id in keep:  # this hold becomes the manager's until take_copies()
                keep.discard(block_id)
                self._pinned.append(block_id)
            else:
                self._allocator.free(block_id)
        self._copies = owed
        del self._tables[seq_id]
        del self._lens[seq_id]
        self._tokens.pop(seq_id, None)
        self._hashes.pop(seq_id, None)

    def take_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` block copies owed by copy-on-write since the last call.

        Perform them with ``PagedKVCache.copy_blocks(pairs)`` before this step writes any
        K/V (the writer's new token goes into ``dst`` after its old contents arrive). Sources
        kept only for these copies (their last holder was freed) are released now.
        """
        if self._swap_out or self._swap_in:
            raise RuntimeError("host-tier moves are pending: call take_block_ops() instead")
        copies, self._copies = self._copies, []
        self._release_pinned()
        return copies

    def take_block_ops(self) -> BlockOps:
        """Every block move owed since the last call: spills to the host, copies back from
        it, copy-on-writes. Run them with ``PagedKVCache.apply_block_ops(ops)``, in that
        order, before this step writes any K/V (with a host tier, call this every step)."""
        ops = BlockOps(self._swap_out, self._swap_in, self._copies)
        self._swap_out, self._swap_in, self._copies = [], [], []
        self._release_pinned()
        if self._host is not None:
            self._host.release_reserved()
        return ops

    def ref_count(self, block_id: int) -> int:
        """How many sequences hold ``block_id`` (0 if none: free, evictable, or only kept as
        the source of an owed copy, see :meth:`free_sequence`)."""
        return self._allocator.ref_count(block_id) - self._pinned.count(block_id)

    # ---- reading state ----------------------------------------------------------------------

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block ids of ``seq_id``, in logical order (a copy)."""
        return list(self._table(seq_id))

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens held for ``seq_id``."""
        self._table(seq_id)
        return self._lens[seq_id]

    def slot_mapping(self, seq_id: Hashable, start: int = 0, end: int | None = None) -> list[int]:
        """Slots of tokens ``start .. end-1`` of ``seq_id`` (``end`` defaults to its length).

        Prefill writes a prompt's K/V with ``cache.write(layer, k, v, m.slot_mapping(seq_id))``.

        Raises:
            ValueError: unknown ``seq_id``, or not ``0 <= start <= end <= seq_len``.
        """
        table = self._table(seq_id)
        length = self._lens[seq_id]
        start = check_int("start", start)
        end = length if end is None else check_int("end", end)
        if not start <= end <= length:
            raise ValueError(
                f"need 0 <= start <= end <= seq_len, got start={start}, end={end}, "
                f"seq_len={length} for sequence {seq_id!r}"
            )
        return token_slots(table, end, self.block_size, start)

    def batch_tables(
        self, seq_ids: Iterable[Hashable], device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``block_tables`` and ``seq_lens`` that ``paged_ref.paged_attention`` takes.

        Returns:
            block_tables: int32 ``[len(seq_ids), max_blocks]``, ``max_blocks`` the longest
                table (at least 1); unused entries are -1.
            seq_lens: int32 ``[len(seq_ids)]``.
        """
        seq_ids = list(seq_ids)
        tables = [self._table(s) for s in seq_ids]
        width = max([1] + [len(t) for t in tables])
        block_tables = torch.full((len(seq_ids), width), -1, dtype=torch.int32)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        seq_lens = torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int32)
        return block_tables.to(device), seq_lens.to(device)

    def stats(self) -> CacheStats:
        """Blocks used, free and shared, tokens stored, empty slots, prefix-cache hits."""
        fill: dict[int, int] = {}  # held block -> tokens in it (equal for all its holders)
        for seq_id, table in self._tables.items():
            for j, block_id in enumerate(table):
                fill[block_id] = min(self.block_size, self._lens[seq_id] - j * self.block_size)
        used = self.num_blocks - self.num_free_blocks
        return CacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            blocks_used=used,
            blocks_free=self.num_free_blocks,
            tokens_stored=sum(self._lens.values()),
            slots_reserved_empty=used * self.block_size - sum(fill.values()),
            num_sequences=len(self._tables),
            blocks_evictable=self._allocator.num_evictable_blocks,
            blocks_shared=sum(self.ref_count(b) > 1 for b in fill),
            prefix_hit_tokens=self._hit_tokens,
            prefix_miss_tokens=self._miss_tokens,
            prefix_host_hit_tokens=self._host_hit_tokens,
            blocks_on_host=0 if self._host is None else len(self._host),
        )

    def cached_blocks(self) -> list[CachedBlock]:
        """The prefix cache's entries (held or evictable), oldest registration first."""
        alloc = self._allocator
        entries = []
        for block_hash, (parent, tokens) in self._cached.items():
            block_id = alloc.cached_block(block_hash)
            entries.append(CachedBlock(block_id, block_hash, parent, tokens,
                                       self.ref_count(block_id), alloc.is_evictable(block_id)))
        return entries

    # ---- helpers ----------------------------------------------------------------------------

    def _check_new_id(self, name: str, seq_id: Hashable) -> None:
        """``TypeError`` if ``seq_id`` is unhashable, ``ValueError`` if it is already held."""
        try:
            hash(seq_id)
        except TypeError:
            raise TypeError(
                f"{name} must be hashable (an int or a str), got {type(seq_id).__name__}"
            ) from None
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already exists")

    @staticmethod
    def _check_token(name: str, token_id) -> int:
        token_id = check_int(name, token_id)
        if token_id > MAX_TOKEN_ID:
            raise ValueError(f"{name} must be <= 2**63 - 1, got {token_id}")
        return token_id

    def _check_tokens(self, token_ids) -> list[int]:
        """``token_ids`` (a list, tuple, range or 1-D integer tensor) as a list of ints."""
        if isinstance(token_ids, torch.Tensor):
            if token_ids.dim() != 1 or token_ids.dtype.is_floating_point:
                raise TypeError(f"token_ids must be a 1-D integer tensor, got "
                                f"{token_ids.dtype} of shape {tuple(token_ids.shape)}")
            token_ids = token_ids.tolist()
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Iterable):
            raise TypeError(f"token_ids must be a list of ints, got {type(token_ids).__name__}")
        return [self._check_token(f"token_ids[{i}]", t) for i, t in enumerate(token_ids)]

    def _chain(self, tokens: list[int] | None) -> list[bytes]:
        """Hashes of the full blocks of ``tokens``, each chained to the one before."""
        hashes: list[bytes] = []
        bs = self.block_size
        for j in range(len(tokens) // bs if tokens else 0):
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None,
                                            tokens[j * bs:(j + 1) * bs]))
        return hashes

    def _lookup(self, hashes: list[bytes]) -> list[int | None]:
        """The longest run of ``hashes`` (from the first) that are all cached: per block, its
        device block id, or None where it sits in the host tier."""
        blocks: list[int | None] = []
        for block_hash in hashes:
            block_id = self._allocator.cached_block(block_hash)
            if block_id is None and (self._host is None or block_hash not in self._host):
                break
            blocks.append(block_id)
        return blocks

    def _register(self, block_id: int, block_hash: bytes, parent: bytes | None,
                  tokens: list[int], j: int) -> None:
        """Cache held full block ``block_id`` (block ``j`` of ``tokens``) under its hash."""
        if self._allocator.cache_block(block_id, block_hash):
            bs = self.block_size
            self._cached[block_hash] = (parent, tuple(tokens[j * bs:(j + 1) * bs]))

    def _record_token(self, seq_id: Hashable, token_id: int | None) -> None:
        """After an append: extend the sequence's token ids; cache the block it filled."""
        tokens = self._tokens.get(seq_id)
        if tokens is None:  # prefix caching off, or an earlier token is unknown
            return
        if token_id is None:
            self._tokens[seq_id] = None
            return
        tokens.append(token_id)
        if len(tokens) % self.block_size == 0:
            hashes = self._hashes[seq_id]
            parent = hashes[-1] if hashes else None
            j = len(hashes)
            block_hash = hash_block_tokens(parent, tokens[j * self.block_size:])
            hashes.append(block_hash)
            self._register(self._tables[seq_id][j], block_hash, parent, tokens, j)

    def _blocks_for_step(self, seq_ids: list[Hashable]) -> int:
        """New blocks one decode step of ``seq_ids`` takes: one per sequence at a block
        boundary, plus the copy-on-writes (``c`` writers into a block ``r`` sequences hold
        copy ``min(c, r - 1)`` times: the last holder writes in place)."""
        writers: Counter[int] = Counter()
        needed = 0
        for seq_id in seq_ids:
            if self._lens[seq_id] % self.block_size == 0:
                needed += 1
            else:
                writers[self._tables[seq_id][-1]] += 1
        for block_id, count in writers.items():
            needed += min(count, self.ref_count(block_id) - 1)
        return needed

    def _uncache(self, block_id: int) -> None:
        """Drop ``block_id`` from the prefix cache (if it is there): its K/V are not what its
        hash names."""
        block_hash = self._allocator.block_hash(block_id)
        if block_hash is not None:
            self._allocator.uncache_block(block_id)
            del self._cached[block_hash]

    def _release_pinned(self) -> None:
        """The owed copies were handed out: let go of the sources kept for them."""
        for block_id in self._pinned:
            self._allocator.free(block_id)
        self._pinned = []

    def _on_evict(self, block_id: int, block_hash: bytes) -> None:
        """The allocator evicted ``block_id``: spill it to the host tier if there is one
        (dropping the oldest spill when full), else forget what it cached."""
        info = self._cached.pop(block_hash)
        if self._host is None:
            return
        slot, dropped = self._host.put(block_hash)
        if dropped is not None:
            del self._host_info[dropped]
            self._swap_out = [(b, s) for b, s in self._swap_out if s != slot]  # not yet run
        if slot is not None:
            self._swap_out.append((block_id, slot))
            self._host_info[block_hash] = info

    def _table(self, seq_id: Hashable) -> list[int]:
        """The live table of ``seq_id``; ``ValueError`` naming the id if it is not held."""
        if not self.has_sequence(seq_id):
            raise ValueError(f"unknown sequence {seq_id!r}")
        return self._tables[seq_id]

    def __repr__(self) -> str:
        return (
            f"KVCacheManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"sequences={len(self._tables)}, free_blocks={self.num_free_blocks}, "
            f"prefix_caching={self._prefix_caching})"
        )
