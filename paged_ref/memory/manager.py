"""KV-cache manager: one block table per sequence, built on a :class:`BlockAllocator`.

A sequence of ``n`` tokens holds ``ceil(n / block_size)`` blocks, listed in its *block table*
(:mod:`.tables`: slots, slot mappings, the tensors attention reads); the manager takes and
releases them as sequences start, grow, fork and end.

    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", 6)        # prompt of 6 tokens -> 2 blocks: [0, 1]
    m.slot_mapping("a")           # [0, 1, 2, 3, 4, 5]  (where prefill writes the prompt's K/V)
    m.append_slot("a")            # 6: token 6 goes in block 1, offset 2 (no new block)
    m.append_slot("a")            # 7
    m.append_slot("a")            # 8: length 8 is a multiple of 4 -> a new block (2)
    m.free_sequence("a")          # all three blocks go back to the allocator

Sharing blocks (lesson 07). Blocks carry reference counts, so sequences share them:

* ``fork(parent, child)``: the child shares every block of the parent (parallel sampling,
  beam search). The first write into a shared, partly filled last block is a *copy-on-write*:
  ``append_slot`` gives the writer a fresh block and records ``(src, dst)``;
  ``take_copies()`` hands those pairs over and ``PagedKVCache.copy_blocks(pairs)`` performs
  them, once per step, *before* the step writes any K/V. Freeing a sequence while a copy is
  owed is safe (see :meth:`KVCacheManager.free_sequence`).
* prefix caching (``enable_prefix_caching=True``, vLLM v1's design, :mod:`.prefix_cache`):
  ``add_sequence(seq_id, token_ids=...)`` shares the longest chain of cached full blocks and
  returns how many tokens it covers; blocks that nobody holds stay cached (evictable, least
  recently used first) until the pool needs them. A block is registered as soon as its token
  ids are known (at ``add_sequence`` or at the ``append_slot`` that fills it): the caller
  writes its K/V in that same step, before attention reads it -- or, when the step fails,
  frees the sequence with ``num_computed``, which takes those blocks back out of the cache.

Invariants: a write never changes what another sequence reads. It lands in a block no other
sequence holds, save one case: a prompt admitted in the same step may hit the block that step's
token fills (registered when it filled), and then the write is the very token that block is
cached for. A hit only returns blocks whose tokens equal the prompt's; eviction never takes a
held block; ``num_free_blocks`` counts plain free + evictable blocks. Every method that changes
state either succeeds or raises with nothing changed. An unknown ``seq_id`` is a
``ValueError`` naming the id, whatever the method.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable, Iterable

from paged_ref.cache_math import blocks_needed, token_slot
from paged_ref.memory.allocator import check_int
from paged_ref.memory.host_tier import BlockOps, HostTier, tier_counts
from paged_ref.memory.prefix_cache import (
    MAX_TOKEN_ID,
    CachedBlock,
    PrefixCache,
    check_prompt,
    check_token,
    check_tokens,
    hash_block_tokens,
)
from paged_ref.memory.stats import CacheStats, measure
from paged_ref.memory.tables import BlockTables

__all__ = ["MAX_TOKEN_ID", "BlockOps", "CacheStats", "CachedBlock", "KVCacheManager",
           "blocks_needed", "hash_block_tokens"]


class KVCacheManager(BlockTables):
    """Block tables for many sequences that share one pool of blocks.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        enable_prefix_caching: keep full blocks with known token ids findable by hash, so a
            later prompt with the same prefix reuses them (see the module docstring).
        num_host_blocks: size of a host tier (prefix caching only; 0 = none): an evicted
            cached block is spilled there and a later hit copies it back instead of
            recomputing it. The caller then runs :meth:`take_block_ops` each step.
        disk_tier: a :class:`~paged_ref.memory.disk_tier.DiskTier` under the host tier (needs
            ``num_host_blocks > 0``; None = none): the host tier's oldest block moves there
            instead of being dropped, and a hit reads it back (:meth:`prefetch` starts that
            early). Give the same one to the ``PagedKVCache``; the caller closes it.

    ``seq_id`` may be any hashable value (an int or a str in the lessons).
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = False,
                 num_host_blocks: int = 0, disk_tier=None) -> None:
        if not isinstance(enable_prefix_caching, bool):
            raise TypeError("enable_prefix_caching must be a bool, got "
                            f"{type(enable_prefix_caching).__name__}")
        if check_int("num_host_blocks", num_host_blocks) and not enable_prefix_caching:
            raise ValueError("num_host_blocks > 0 needs enable_prefix_caching=True")
        if disk_tier is not None and not num_host_blocks:
            raise ValueError("disk_tier sits under the host tier: it needs num_host_blocks > 0")
        self._host = HostTier(num_host_blocks, disk_tier) if num_host_blocks else None
        super().__init__(num_blocks, block_size, on_evict=self._on_evict)
        self._prefix = PrefixCache(self._allocator)
        if self._host is not None:  # a block is in one tier: caching it drops lower copies
            self._prefix.on_cache = self._host.discard
        # NOTE: free_sequence drops a freed writer's owed copy by this name (one uncache, the
        # prefix cache's, which keeps its index and the allocator's map in step).
        self._uncache = self._prefix.uncache
        self._prefix_caching = enable_prefix_caching
        self._copies: list[tuple[int, int]] = []
        # Blocks kept after their last holder was freed until the move that reads or fills
        # them is handed out (owed copies' sources, copies back's targets): allocator refs.
        self._pinned: list[int] = []

    @property
    def enable_prefix_caching(self) -> bool:
        """Whether full blocks are cached by hash."""
        return self._prefix_caching

    # ---- changing state ---------------------------------------------------------------------

    def add_sequence(self, seq_id: Hashable, num_tokens: int | None = None, *,
                     token_ids=None) -> int:
        """Start sequence ``seq_id`` with its prompt, all or nothing.

        Give ``num_tokens`` (the prompt's length) or ``token_ids`` (the prompt itself; both
        only if they agree). With prefix caching on and ``token_ids`` given, the longest chain
        of cached full blocks that starts the prompt is shared instead of taking new blocks,
        but always leaving at least one token to compute (so a hit is at most
        ``(len(token_ids) - 1) // block_size`` blocks). Blocks for the rest are fresh; the
        full ones are registered in the prefix cache at once (write their K/V this step, or
        free the sequence with ``num_computed``). Hit blocks on the disk tier are read here
        (or their :meth:`prefetch` waited for); the hit stops before one that cannot be read.

        Returns:
            How many leading tokens are already cached (their K/V need not be computed): a
            multiple of ``block_size``, ``< len(token_ids)``; 0 without prefix caching or
            without ``token_ids``.

        Raises:
            ValueError: ``seq_id`` is already held, ``num_tokens`` is negative, ``token_ids``
                is empty, holds a negative id, or disagrees with ``num_tokens``.
            TypeError: ``seq_id`` is not hashable, neither length nor tokens given, or a
                length / token id is not an int.
            OutOfBlocksError: too few free blocks; no block is taken, nothing read (only a
                disk block that could not be read is dropped).
        """
        self._check_new_id("seq_id", seq_id)
        num_tokens, tokens = check_prompt(num_tokens, token_ids)
        bs, prefix = self.block_size, self._prefix
        if not self._prefix_caching:
            tokens = None  # nothing to hash
        elif tokens is None and num_tokens == 0:
            tokens = []  # every token id is known (there are none yet)
        hashes = prefix.chain(tokens)
        hit = prefix.lookup(hashes[: (num_tokens - 1) // bs], self._host) if tokens else []
        shared, fresh = self._check_fit(seq_id, num_tokens, hit)  # before any read or change
        if self._host is not None and None in hit:  # read the disk hits now (cut at a bad one)
            loaded = self._host.load(hashes, hit)
            if len(loaded) < len(hit):
                hit = loaded
                shared, fresh = self._check_fit(seq_id, num_tokens, hit)
        for block_id in shared:
            self._allocator.add_ref(block_id)  # revives an evictable block first
        # NOTE: take the hits out of the host / disk tiers before allocating: the allocations
        # evict, and the spills they cause must not push a hit off its tier.
        back = {j: self._host.take(hashes[j]) for j, b in enumerate(hit) if b is None}
        table = [self._allocator.allocate() if b is None else b for b in hit]
        table += [self._allocator.allocate() for _ in range(fresh - len(back))]
        for j, source in back.items():
            self._host.copy_back(source, table[j])
        self._tables[seq_id] = table
        self._lens[seq_id] = num_tokens
        if self._prefix_caching:
            from_disk = sum(not isinstance(source, int) for source in back.values())
            prefix.admit(seq_id, tokens, hashes, table, hit, counted=token_ids is not None,
                         from_disk=from_disk)
        return len(hit) * bs

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """Start ``child_id`` as a copy of ``parent_id`` that shares all its blocks.

        No block is taken and no K/V is copied: each block's reference count goes up by one.
        The child inherits the parent's length and token ids. The first ``append_slot`` of
        either into a shared, partly filled last block copies that block (copy-on-write).

        ValueError: ``parent_id`` is unknown or ``child_id`` is already held; TypeError:
        ``child_id`` is not hashable.
        """
        table = self._table(parent_id)
        self._check_new_id("child_id", child_id)
        for block_id in table:
            self._allocator.add_ref(block_id)
        self._tables[child_id] = list(table)
        self._lens[child_id] = self._lens[parent_id]
        if self._prefix_caching:
            self._prefix.fork(parent_id, child_id)

    def append_slot(self, seq_id: Hashable, token_id: int | None = None) -> int:
        """Grow ``seq_id`` by one token and return that token's slot.

        A new block is taken when the current length is a multiple of ``block_size``
        (including length 0), unless :meth:`lookahead` took it. Otherwise the token goes into
        its block's next free slot, unless another sequence also holds that block: then the
        writer gets a fresh block and a copy ``(shared block, fresh block)`` is recorded for
        :meth:`take_copies` (copy-on-write), so the write never lands in a shared block.

        ``token_id`` feeds the prefix cache: the block it fills is cached under its hash. A
        token appended without one makes this block, and all later blocks of the sequence,
        uncacheable.

        ValueError: unknown ``seq_id``, or a negative ``token_id``; TypeError: ``token_id`` is
        not an int; OutOfBlocksError: a new block is needed and none is free. Nothing changes.
        """
        table = self._table(seq_id)
        if token_id is not None:
            token_id = check_token("token_id", token_id)
        pos = self._lens[seq_id]
        j = pos // self.block_size  # (its block; one taken by lookahead() may be there)
        if j == len(table):
            table.append(self._allocator.allocate())  # raises before anything changes
        elif self.ref_count(table[j]) > 1:  # shared: copy on write
            fresh = self._allocator.allocate()  # raises before anything changes
            self._allocator.free(table[j])  # still held by the others
            self._copies.append((table[j], fresh))
            table[j] = fresh
        self._lens[seq_id] = pos + 1
        self._prefix.record_token(seq_id, token_id, table)
        return token_slot(table, pos, self.block_size)

    def append_slots(self, seq_ids: Iterable[Hashable], token_ids=None) -> list[int]:
        """One decode step: :meth:`append_slot` for each of ``seq_ids`` (distinct), all or
        nothing; ``token_ids``: optional, one per sequence (feeds the prefix cache). Returns the
        slots in the order given (the step's slot mapping). ValueError: an unknown or repeated
        id, or ``token_ids`` of another length; OutOfBlocksError: the step needs more new blocks
        (boundaries + copy-on-writes) than are free. Nothing changes then."""
        seq_ids, token_ids = self._check_step(seq_ids, token_ids, self.ref_count)
        return [self.append_slot(s, t) for s, t in zip(seq_ids, token_ids, strict=True)]

    def lookahead(self, seq_ids: Iterable[Hashable], num_tokens: Iterable[int]) -> None:
        """Take now the blocks the next ``num_tokens[i]`` tokens of each of ``seq_ids`` will
        fill, all or nothing (vLLM's lookahead slots: multi-step decoding writes their K/V before
        their ids are known); they sit in the table past its length until :meth:`extend` appends
        the tokens (``free_sequence`` frees them too). ValueError: an unknown id, a bad count, a
        next token in a shared block; OutOfBlocksError: too few free blocks (nothing changes)."""
        seq_ids = list(seq_ids)
        need = self._check_lookahead(seq_ids, list(num_tokens), self.ref_count)
        for seq_id, blocks in zip(seq_ids, need, strict=True):
            self._tables[seq_id] += [self._allocator.allocate() for _ in range(blocks)]

    def extend(self, seq_id: Hashable, token_ids) -> None:
        """:meth:`append_slot` for each of ``token_ids`` into blocks ``seq_id`` holds already
        (:meth:`lookahead`'s); ValueError if they do not fit them or land in a shared block."""
        tokens, table, bs = check_tokens(token_ids), self._table(seq_id), self.block_size
        end, pos = self._lens[seq_id] + len(tokens), self._lens[seq_id]
        if end > len(table) * bs or tokens and pos % bs and self.ref_count(table[pos // bs]) > 1:
            self._check_lookahead([seq_id], [len(tokens)], self.ref_count, taken=True)  # raises
        self._lens[seq_id] = end  # (append_slot's bookkeeping for all of them at once)
        self._prefix.record_tokens(seq_id, tokens, table)

    def free_sequence(self, seq_id: Hashable, *, num_computed: int | None = None) -> None:
        """Forget ``seq_id`` and drop its hold on each of its blocks.

        A block nobody holds any more goes back to the pool; a cached one stays findable, as
        evictable. The last block is released first (a prompt's later blocks are evicted first).

        Args:
            num_computed: how many leading tokens have their K/V written. None (default): all.
                An int ``n`` (``0 <= n <= seq_len``; a failed step, a broken transfer): only
                the first ``n``, and every block this sequence registered in the prefix cache
                itself (a fresh block of its prompt, one its tokens filled) whose tokens reach
                past ``n`` is uncached, so no prompt hits K/V never written. Its hits (from the
                device, or copied back from the host tier) were written before and stay cached;
                so do blocks shared with a fork parent, which the parent registered. (A prompt
                that hit a dropped block in the same step holds it uncached: free it too.)

        Owed moves (recorded since the last :meth:`take_copies` / :meth:`take_block_ops`): a
        copy-on-write *into* a block nobody holds any more is dropped and that block uncached
        (it never got its K/V); the *source* of a copy still owed is kept, held by no sequence,
        until the copy is taken, so it is not handed out and overwritten first; so is a block
        whose copy back from the host is owed (it counts as written: run every move
        ``take_block_ops`` returns). This step's own token of ``seq_id`` is never written: if
        it filled a block in place, that block stays cached without it unless ``num_computed``
        says so; free such a sequence between steps.

        ValueError: unknown ``seq_id``, or ``num_computed`` negative or above its length;
        TypeError: ``num_computed`` is not an int. After an error nothing has changed.
        """
        table = self._table(seq_id)
        if num_computed is not None:
            num_computed = check_int("num_computed", num_computed)
            if num_computed > self._lens[seq_id]:
                raise ValueError(f"num_computed must be <= seq_len={self._lens[seq_id]} of "
                                 f"sequence {seq_id!r}, got {num_computed}")
            self._prefix.drop_unwritten(seq_id, table, num_computed)
        dropping = Counter(table)  # this sequence's holds, per block

        def held_after(block_id: int) -> bool:
            return self._allocator.ref_count(block_id) > dropping[block_id]

        owed = [(s, d) for s, d in self._copies if held_after(d)]
        for _, dst in set(self._copies) - set(owed):
            self._uncache(dst)
        keep = {s for s, _ in owed if not held_after(s)}  # last holder leaving, copy owed
        keep |= {d for d in self._owed_targets() if not held_after(d)}  # copy back owed
        for block_id in reversed(table):
            if block_id in keep:  # this hold becomes the manager's until the move is taken
                keep.discard(block_id)
                self._pinned.append(block_id)
            else:
                self._allocator.free(block_id)
        self._copies = owed
        del self._tables[seq_id]
        del self._lens[seq_id]
        self._prefix.forget(seq_id)

    def take_copies(self) -> list[tuple[int, int]]:
        """The ``(src, dst)`` block copies owed by copy-on-write since the last call: perform
        them with ``PagedKVCache.copy_blocks(pairs)`` before this step writes any K/V (the
        writer's new token goes into ``dst`` after its old contents arrive). Sources kept only
        for these copies (their last holder was freed) are released now."""
        if self._host is not None and self._host.has_moves():
            raise RuntimeError("host-tier moves are pending: call take_block_ops() instead")
        copies, self._copies = self._copies, []
        self._release_pinned()
        return copies

    def take_block_ops(self) -> BlockOps:
        """Every block move owed since the last call (:class:`BlockOps`: spills to the host and
        the disk, copies back from them, copy-on-writes). Run them with ``PagedKVCache.
        apply_block_ops(ops)`` before this step writes any K/V (a host tier: every step)."""
        ops = (BlockOps([], [], self._copies, [], [], []) if self._host is None
               else self._host.take_moves(self._copies))
        self._copies = []
        self._release_pinned()
        return ops

    def prefetch(self, token_ids, hashes: list[bytes] | None = None) -> int:
        """Start reading (on the disk tier's threads) the blocks of ``token_ids``' cached prefix
        that are on the disk, so that :meth:`add_sequence` of it later waits only for what is
        left: call it a step or more ahead, for the next waiting request. No hit is counted,
        no block held. Returns how many reads started (0 without a disk tier). Raises
        ``TypeError`` / ``ValueError`` if ``token_ids`` is not a list of token ids (checked
        unless ``hashes`` is given: a memo, as :meth:`num_cached_tokens` takes it)."""
        tokens = check_tokens(token_ids) if hashes is None else token_ids
        if self._host is None or not tokens:
            return 0
        memo = [] if hashes is None else hashes
        hit = self._prefix.cached_tokens(tokens, self._host, memo) // self.block_size
        return self._host.prefetch(memo[:hit])  # (those on the disk: a block is in one tier)

    def ref_count(self, block_id: int) -> int:
        """How many sequences hold ``block_id`` (0 if none: free, evictable, or only kept
        until an owed move is handed out, see :meth:`free_sequence`)."""
        return self._allocator.ref_count(block_id) - self._pinned.count(block_id)

    # ---- reading state (the tables': see BlockTables) ---------------------------------------

    def stats(self) -> CacheStats:
        """Blocks used, free and shared, tokens stored, empty slots, prefix-cache hits."""
        return measure(self, self.ref_count, **self._prefix.counts(), **tier_counts(self._host))

    def cached_blocks(self) -> list[CachedBlock]:
        """The prefix cache's entries (held or evictable), oldest registration first."""
        return self._prefix.entries(self.ref_count)

    def cached_prefix_blocks(self, token_ids) -> list[int]:
        """The device blocks that hold the leading full blocks of ``token_ids`` now: the
        longest chain of cached blocks in this pool whose K/V are in place (it stops at a
        block in the host tier and at one that an owed move -- a copy back from the host, a
        copy-on-write -- has still to fill). Read only: no hit is counted, no block is held,
        the eviction order stays (what ``transfer.send_prefix`` reads). Between steps, every
        cached block's K/V are written; inside a step, those of the step's blocks are not.

        Raises:
            TypeError, ValueError: ``token_ids`` is not a list of token ids.
        """
        tokens = check_tokens(token_ids)
        owed = self._owed_targets()
        return self._prefix.in_place(tokens, owed) if self._prefix_caching else []

    def num_cached_tokens(self, token_ids: list[int], hashes: list[bytes] | None = None) -> int:
        """Leading tokens of ``token_ids`` (ints, unchecked) ``add_sequence`` would share now (0
        without prefix caching); read only. ``hashes``: a memo (``PrefixCache.cached_tokens``)."""
        return self._prefix.cached_tokens(token_ids, self._host, hashes)  # (none cached if off)

    # ---- helpers ----------------------------------------------------------------------------

    def _owed_targets(self) -> set[int]:
        """Device blocks that owed moves will fill: copies back from the tiers, copy-on-writes."""
        owed = {d for _, d in self._copies}
        return owed if self._host is None else owed | self._host.owed_targets()

    def _release_pinned(self) -> None:
        """The owed moves were handed out: let go of the blocks kept for them."""
        for block_id in self._pinned:
            self._allocator.free(block_id)
        self._pinned = []

    def _on_evict(self, block_id: int, block_hash: bytes) -> None:
        """The allocator evicted ``block_id``: forget its entry, spill it to the host tier."""
        self._prefix.evicted(block_hash)
        if self._host is not None:
            self._host.spill(block_id, block_hash)

    def __repr__(self) -> str:
        return (f"KVCacheManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"sequences={len(self._tables)}, free_blocks={self.num_free_blocks}, "
                f"prefix_caching={self._prefix_caching})")
