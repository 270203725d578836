"""Lesson 07: sharing blocks -- reference counts, copy-on-write, prefix caching, eviction.

``SharingCache`` is a small block manager (the ideas of ``paged_ref.KVCacheManager`` in
about a hundred lines). Each block id ``0 .. num_blocks - 1`` is in exactly one state:

* **held**: ``ref_counts[b] > 0`` sequences list it in their block tables;
* **evictable**: nobody holds it, but it is cached (``b in hash_of``): it still holds the K/V
  of a full block that a later prompt may reuse. ``evictable`` is an ``OrderedDict`` used as an
  LRU list: the first key is the block to evict first;
* **free**: nobody holds it and it holds nothing useful; ``free_list`` (a deque).

So ``num_free_blocks = len(free_list) + len(evictable)``: both can be handed out.

Exercises:
    7.1  fork            reference counts: a child shares every block of its parent
    7.2  release         drop one holder; the last one out frees the block or leaves it cached
    7.3  free_sequence   release every block of a sequence
    7.4  append_slot     copy-on-write: never write into a shared block
    7.5  hash_block      a full block's identity: a hash chain over the prompt
    7.6  lookup          the longest cached chain that starts a prompt
    7.7  allocate        free blocks first, then evict the least recently used cached block
    7.8  share           one more holder; a hit revives an evictable block

``add_sequence`` (given) puts 7.6, 7.8 and 7.7 together.

One simplification: the copies in ``copies`` are assumed to be performed (and the list
emptied) at the end of the step that recorded them, before any sequence is freed.
``paged_ref.KVCacheManager`` also allows a sequence to be freed while its copy is still owed
(a request preempted or aborted mid-step): it drops a copy into the freed writer's block, and
keeps the copy's source from being handed out (and overwritten) until the copy is taken; see
its ``free_sequence``.
"""

from __future__ import annotations

import hashlib  # noqa: F401  (you use it in Exercise 7.5)
from collections import OrderedDict, deque

from paged_ref import OutOfBlocksError


class SharingCache:
    """Block tables with reference counts, copy-on-write and a prefix cache.

    State (given; keep it consistent):
        ``free_list``   deque of free block ids (hand out from the left)
        ``evictable``   OrderedDict block id -> None: cached blocks nobody holds, LRU first
        ``ref_counts``  list: holders of each block
        ``hash_of``     dict block id -> hash, for cached blocks (held or evictable)
        ``block_of``    dict hash -> block id (the inverse of ``hash_of``)
        ``tables``, ``lens``  each sequence's block table and length
        ``copies``      list of (src, dst) block copies owed by copy-on-write
    """

    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.free_list = deque(range(num_blocks))
        self.evictable: OrderedDict[int, None] = OrderedDict()
        self.ref_counts = [0] * num_blocks
        self.hash_of: dict[int, bytes] = {}
        self.block_of: dict[bytes, int] = {}
        self.tables: dict[object, list[int]] = {}
        self.lens: dict[object, int] = {}
        self.copies: list[tuple[int, int]] = []

    @property
    def num_free_blocks(self) -> int:
        """Blocks that :meth:`allocate` can hand out: plain free + evictable."""
        return len(self.free_list) + len(self.evictable)

    # ---- 7.1-7.3: reference counts -----------------------------------------------------

    def fork(self, parent, child) -> None:
        """Exercise 7.1: start ``child`` as a copy of ``parent`` that *shares* every block.

        No block is taken, no K/V copied: the child gets a copy of the parent's table (a new
        list) and length, and each block gets one more holder (:meth:`share`, 7.8).
        """
        # BEGIN SOLUTION
        table = self.tables[parent]
        for block_id in table:
            self.share(block_id)
        self.tables[child] = list(table)
        self.lens[child] = self.lens[parent]
        # END SOLUTION


    def release(self, block_id: int) -> None:
        """Exercise 7.2: drop one holder of ``block_id``.

        When the last holder lets go, the block goes to exactly one place: a cached block
        (``block_id in hash_of``) to the end of ``evictable`` (the most recently used), any
        other block to the end of ``free_list``. (In both would count it twice as free.)
        """
        # BEGIN SOLUTION
        self.ref_counts[block_id] -= 1
        if self.ref_counts[block_id] == 0:
            if block_id in self.hash_of:
                self.evictable[block_id] = None
            else:
                self.free_list.append(block_id)
        # END SOLUTION


    def free_sequence(self, seq_id) -> None:
        """Exercise 7.3: forget ``seq_id``; each of its blocks loses one holder
        (:meth:`release`, 7.2), so a block still held by a fork stays held. Release the blocks
        last to first (a prompt's later blocks are then evicted before its first ones)."""
        # BEGIN SOLUTION
        for block_id in reversed(self.tables.pop(seq_id)):
            self.release(block_id)
        del self.lens[seq_id]
        # END SOLUTION

    # ---- 7.4: copy-on-write ------------------------------------------------------------

    def append_slot(self, seq_id) -> int:
        """Exercise 7.4: grow ``seq_id`` by one token; return the token's slot
        (``table[pos // block_size] * block_size + pos % block_size``).

        * length a multiple of ``block_size``: a new block (:meth:`allocate`, 7.7);
        * else, if another sequence also holds the last block (ref count > 1): copy on write.
          Take a fresh block, record ``(old, fresh)`` in ``self.copies``, release the old
          block (the others keep it) and put the fresh one at the end of the table;
        * else write in place.
        Allocate before changing anything (``OutOfBlocksError`` leaves all as it was).
        """
        # BEGIN SOLUTION
        table, pos = self.tables[seq_id], self.lens[seq_id]
        if pos % self.block_size == 0:
            table.append(self.allocate())
        elif self.ref_counts[table[-1]] > 1:
            fresh = self.allocate()
            self.copies.append((table[-1], fresh))
            self.release(table[-1])
            table[-1] = fresh
        self.lens[seq_id] = pos + 1
        return table[pos // self.block_size] * self.block_size + pos % self.block_size
        # END SOLUTION

    # ---- 7.5-7.6: the prefix cache -----------------------------------------------------

    @staticmethod
    def hash_block(parent_hash: bytes | None, token_ids: list[int]) -> bytes:
        """Exercise 7.5: the identity of a full block: SHA-256 over its parent's hash and its
        token ids (32 bytes).

        ``parent_hash`` is the hash of the block before it in the prompt (None for the first
        block). Feed ``b"root"`` for None, then the parent hash, then the token ids as text
        (``repr(list(token_ids))``), to one ``hashlib.sha256()`` and return ``.digest()``.

        Why the parent? A block's K/V depend on *every* token before it, not just its own: the
        same 16 tokens after a different system prompt have different keys and values.

        Example:
            >>> a = hash_block(None, [1, 2])
            >>> hash_block(a, [3, 4]) != hash_block(None, [3, 4])
            True
        """
        # BEGIN SOLUTION
        h = hashlib.sha256()
        h.update(b"root" if parent_hash is None else parent_hash)
        h.update(repr(list(token_ids)).encode())
        return h.digest()
        # END SOLUTION

    def lookup(self, token_ids: list[int]) -> list[int]:
        """Exercise 7.6: the cached blocks that start ``token_ids``, in order.

        Walk the prompt's full blocks from the first, chaining hashes
        (``h = self.hash_block(h, block's tokens)``, ``h = None`` before the first), and collect
        ``block_of[h]`` while it exists; stop at the first miss. Look at no more than
        ``(len(token_ids) - 1) // block_size`` blocks: at least one token must be left to
        compute (its query produces the next token).
        """
        # BEGIN SOLUTION
        bs, found, h = self.block_size, [], None
        for j in range((len(token_ids) - 1) // bs):
            h = self.hash_block(h, token_ids[j * bs:(j + 1) * bs])
            if h not in self.block_of:
                break
            found.append(self.block_of[h])
        return found
        # END SOLUTION

    # ---- 7.7-7.8: the pool and eviction ------------------------------------------------

    def allocate(self) -> int:
        """Exercise 7.7: take a block for a new holder (its ref count becomes 1).

        Plain free blocks first (``free_list.popleft()``). Only when there are none, evict
        the least recently used cached block: ``evictable.popitem(last=False)``, and forget
        its hash (remove it from ``hash_of`` *and* ``block_of``: its K/V are about to be
        overwritten, so no prompt may find it any more). Raise ``OutOfBlocksError`` when
        neither has a block (nothing changes then).
        """
        # BEGIN SOLUTION
        if self.free_list:
            block_id = self.free_list.popleft()
        elif self.evictable:
            block_id, _ = self.evictable.popitem(last=False)
            del self.block_of[self.hash_of.pop(block_id)]
        else:
            raise OutOfBlocksError(f"all {len(self.ref_counts)} blocks are held")
        self.ref_counts[block_id] = 1
        return block_id
        # END SOLUTION


    def share(self, block_id: int) -> None:
        """Exercise 7.8: one more holder of ``block_id`` (a fork, or a prefix-cache hit).

        If nobody held it, it is an evictable cached block: take it off ``evictable`` first
        (a held block must never be evicted).
        """
        # BEGIN SOLUTION
        if self.ref_counts[block_id] == 0:
            del self.evictable[block_id]
        self.ref_counts[block_id] += 1
        # END SOLUTION

    # ---- given: a prompt, with the prefix cache ----------------------------------------

    def add_sequence(self, seq_id, token_ids: list[int]) -> int:
        """Start ``seq_id`` with its prompt, reusing cached blocks (given); all or nothing.

        Returns how many leading tokens were found in the cache (a multiple of block_size).
        Every full block of the prompt is cached afterwards.
        """
        bs = self.block_size
        hit = self.lookup(token_ids)
        fresh = -(-len(token_ids) // bs) - len(hit)
        reviving = sum(self.ref_counts[b] == 0 for b in hit)  # evictable now, held soon
        if fresh > self.num_free_blocks - reviving:
            raise OutOfBlocksError(f"need {fresh} blocks, {self.num_free_blocks - reviving} free")
        for block_id in hit:
            self.share(block_id)
        table = hit + [self.allocate() for _ in range(fresh)]
        h = None
        for j in range(len(token_ids) // bs):  # cache every full block
            h = self.hash_block(h, token_ids[j * bs:(j + 1) * bs])
            if h not in self.block_of and table[j] not in self.hash_of:
                self.block_of[h], self.hash_of[table[j]] = table[j], h
        self.tables[seq_id], self.lens[seq_id] = table, len(token_ids)
        return len(hit) * bs

hash_block = SharingCache.hash_block  # also a plain function: ex.hash_block(parent, tokens)
