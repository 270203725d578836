"""Block allocator: hands out fixed-size KV-cache blocks by id, counts who holds them, and
keeps the blocks of a prefix cache until the pool needs them.

A *block* holds the keys and values of ``block_size`` consecutive tokens. The allocator knows
nothing about sequences or tensors; it tracks, per block id ``0 .. num_blocks - 1``:

* its *reference count*: how many sequences hold it (``allocate`` -> 1, ``add_ref`` +1,
  ``free`` -1). Forked sequences and prefix-cache hits share a block instead of copying it.
* optionally its *block hash* (:meth:`cache_block`): the identity of the tokens it holds, so a
  later prompt with the same prefix can find it (:meth:`cached_block`).

A block whose count drops to 0 is *free*. If it has a hash it stays cached and becomes
*evictable*: it still holds its tokens' K/V and can be revived by a hit (:meth:`add_ref`), but
:meth:`allocate` may take it, least recently used first, once no plain free block is left.

    a = BlockAllocator(num_blocks=4, block_size=16)
    b = a.allocate()      # 0 (lowest free id first), ref_count(b) == 1
    a.add_ref(b)          # a second holder: ref_count(b) == 2
    a.free(b); a.free(b)  # both holders gone -> back to the free list

Every call is O(1): the order of the free blocks is a :class:`~.free_queue.FreeBlockQueue`
(plain free first, then evictable least recently used first); here are a list of counts and a
dict from hash to block and back.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from numbers import Integral

from paged_ref.memory.free_queue import FreeBlockQueue


class OutOfBlocksError(RuntimeError):
    """Raised by :meth:`BlockAllocator.allocate` when every block is in use."""


def check_int(name: str, value, *, minimum: int | None = 0) -> int:
    """``value`` as an ``int`` if it is an integer ``>= minimum`` (NumPy integers count).

    Raises ``TypeError`` for a non-integer (``bool`` included) and ``ValueError`` below
    ``minimum`` (no lower bound when ``minimum`` is None); both messages name the argument.
    """
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, Integral)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__} ({value!r})")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class BlockAllocator:
    """A pool of ``num_blocks`` KV-cache blocks of ``block_size`` tokens each.

    Args:
        num_blocks: how many blocks the pool holds (block ids ``0 .. num_blocks - 1``).
        block_size: tokens per block. The allocator only reports it; it is here so that code
            holding an allocator knows the unit it hands out.
        on_evict: called as ``on_evict(block_id, block_hash)`` when :meth:`allocate` evicts a
            cached block, before the block is handed out (a manager can spill it to the host).

    Blocks are handed out lowest id first; a freed block without a hash goes to the back of
    the free list (so it is reused after the never-used ones), which keeps pictures and tests
    deterministic. Only when the free list is empty does :meth:`allocate` evict a cached block,
    the one that became evictable longest ago.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        on_evict: Callable[[int, Hashable], None] | None = None,
    ) -> None:
        self._num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        self._block_size = check_int("block_size", block_size, minimum=1)
        self._free = FreeBlockQueue(self._num_blocks)  # plain free, then evictable (LRU)
        self._ref_counts = [0] * self._num_blocks
        self._hash_of: dict[int, Hashable] = {}  # block id -> hash, cached blocks only
        self._block_of: dict[Hashable, int] = {}  # hash -> block id (the inverse)
        self.on_evict = on_evict
        self.num_evictions = 0  #: cached blocks taken by :meth:`allocate` so far

    # ---- sizes ------------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Total blocks in the pool, free or not."""
        return self._num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks that :meth:`allocate` can still hand out: plain free + evictable."""
        return len(self._free)

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks that nobody holds (counted in :attr:`num_free_blocks`)."""
        return self._free.num_evictable

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a hash, held or evictable."""
        return len(self._hash_of)

    @property
    def num_used_blocks(self) -> int:
        """Blocks that someone holds (``num_blocks - num_free_blocks``)."""
        return self._num_blocks - self.num_free_blocks

    # ---- holding and releasing --------------------------------------------------------------

    def allocate(self) -> int:
        """Take a free block (reference count 1) and return its id. O(1).

        A never-used or plain freed block first; otherwise the least recently used evictable
        block, which loses its hash (``on_evict`` is told first).

        Raises:
            OutOfBlocksError: every block is held (nothing changes).
        """
        if not self._free:
            raise OutOfBlocksError(
                f"out of KV-cache blocks: all {self._num_blocks} blocks of "
                f"{self._block_size} tokens are in use"
            )
        block_id, evicted = self._free.popleft()
        if evicted:
            block_hash = self._hash_of.pop(block_id)
            del self._block_of[block_hash]
            self.num_evictions += 1
            if self.on_evict is not None:
                self.on_evict(block_id, block_hash)
        self._ref_counts[block_id] = 1
        return block_id

    def add_ref(self, block_id: int) -> None:
        """One more holder of ``block_id``: a held block, or a cached one nobody holds (a
        prefix-cache hit revives it: it leaves the evictable list).

        Raises:
            ValueError: ``block_id`` is unknown, or free and not cached (nothing to share).
        """
        block_id = self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            if not self._free.is_evictable(block_id):
                raise ValueError(f"block {block_id} is free and not cached: nothing to share")
            self._free.revive(block_id)
        self._ref_counts[block_id] += 1

    def free(self, block_id: int) -> None:
        """Drop one holder of ``block_id``. O(1).

        When the last holder lets go, a cached block becomes evictable (most recently used);
        any other block goes to the back of the free list.

        Raises:
            TypeError: ``block_id`` is not an int.
            ValueError: ``block_id`` is outside ``[0, num_blocks)`` or nobody holds it (a
                double free). After an error nothing has changed.
        """
        block_id = self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"double free: block {block_id} is already free")
        self._ref_counts[block_id] -= 1
        if self._ref_counts[block_id] == 0:
            if block_id in self._hash_of:
                self._free.append_evictable(block_id)
            else:
                self._free.append_free(block_id)

    def ref_count(self, block_id: int) -> int:
        """How many holders ``block_id`` has (0 when free or evictable)."""
        return self._ref_counts[self._check_id(block_id)]

    def is_free(self, block_id: int) -> bool:
        """Whether nobody holds ``block_id`` (free or evictable)."""
        return self._ref_counts[self._check_id(block_id)] == 0

    # ---- the prefix cache's index -----------------------------------------------------------

    def cache_block(self, block_id: int, block_hash: Hashable) -> bool:
        """Register held block ``block_id`` as the cached copy of ``block_hash``.

        Returns False (and changes nothing) when the hash already has a block or the block
        already has a hash: the first copy stays the cached one.

        Raises:
            ValueError: nobody holds ``block_id`` (only live blocks get registered).
        """
        block_id = self._check_id(block_id)
        if self._ref_counts[block_id] == 0:
            raise ValueError(f"block {block_id} is free: only a held block can be cached")
        if block_hash in self._block_of or block_id in self._hash_of:
            return False
        self._hash_of[block_id] = block_hash
        self._block_of[block_hash] = block_id
        return True

    def uncache_block(self, block_id: int) -> None:
        """Forget the hash of ``block_id`` (its K/V will never hold what the hash names): no
        later prompt finds it, and if nobody holds it, it moves from the evictable list to the
        free list. A block without a hash is left as it is."""
        block_id = self._check_id(block_id)
        block_hash = self._hash_of.pop(block_id, None)
        if block_hash is None:
            return
        del self._block_of[block_hash]
        if self._free.is_evictable(block_id):
            self._free.forget_hash(block_id)

    def cached_block(self, block_hash: Hashable) -> int | None:
        """The block cached under ``block_hash``, or None."""
        return self._block_of.get(block_hash)

    def cached_run(self, hashes: list[Hashable]) -> int:
        """How many of ``hashes``, from the first, have a cached block (all of them in a row).
        Read only. NOTE: ``takewhile`` over the dict's ``__contains__`` runs in C: the
        scheduler asks this of every waiting prompt every step."""
        return len(list(itertools.takewhile(self._block_of.__contains__, hashes)))

    def block_hash(self, block_id: int) -> Hashable | None:
        """The hash ``block_id`` is cached under, or None."""
        return self._hash_of.get(self._check_id(block_id))

    def is_evictable(self, block_id: int) -> bool:
        """Whether ``block_id`` is cached and held by nobody."""
        return self._free.is_evictable(self._check_id(block_id))

    def evictable_blocks(self) -> list[int]:
        """Evictable block ids, the next to be evicted first (a new list)."""
        return self._free.evictable()

    # ---- helpers ----------------------------------------------------------------------------

    def _check_id(self, block_id) -> int:
        """``block_id`` as an ``int`` (NumPy integers are fine) if it names a block."""
        if type(block_id) is not int and (isinstance(block_id, bool)
                                          or not isinstance(block_id, Integral)):
            raise TypeError(
                f"block_id must be an int, got {type(block_id).__name__} ({block_id!r})"
            )
        if not 0 <= block_id < self._num_blocks:
            raise ValueError(
                f"unknown block_id {block_id}: ids run from 0 to {self._num_blocks - 1}"
            )
        return int(block_id)

    def __repr__(self) -> str:
        return (
            f"BlockAllocator(num_blocks={self._num_blocks}, block_size={self._block_size}, "
            f"free={self.num_free_blocks}, evictable={self.num_evictable_blocks})"
        )
