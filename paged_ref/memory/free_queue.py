"""The order in which a pool hands its free blocks out (vLLM v1's ``FreeKVCacheBlockQueue``), and
the slots of the tiers below it (:class:`SlotLRU`: host memory, a file).

A block nobody holds is in one of two queues:

* *plain free* -- never used, or freed without a prefix-cache hash: first in, first out, so
  never-used blocks (lowest id first) go before freed ones, which keeps pictures and tests
  deterministic;
* *evictable* -- freed with a hash: it still holds its tokens' K/V and a prefix-cache hit can
  take it back (:meth:`FreeBlockQueue.revive`); least recently freed first.

:meth:`FreeBlockQueue.popleft` takes a plain free block while there is one, and evicts only
when there is none. (vLLM keeps both kinds in one doubly linked list; two queues give the
same O(1) operations and the "never-used first" order lesson 02 draws.)

    q = FreeBlockQueue(3)         # plain free: 0, 1, 2
    q.popleft()                   # (0, False)
    q.append_evictable(0)         # block 0 freed with a hash
    q.popleft(); q.popleft()      # (1, False), (2, False)
    q.popleft()                   # (0, True): block 0 evicted
"""

from __future__ import annotations

from collections import OrderedDict, deque


class FreeBlockQueue:
    """Free block ids ``0 .. num_blocks - 1`` (all plain free at first). Every call is O(1).

    It trusts its caller (:class:`paged_ref.BlockAllocator`) to pass ids that are in the
    queue it names; it does no bookkeeping of holders or hashes.
    """

    def __init__(self, num_blocks: int) -> None:
        self._plain: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # least recently freed first

    def __len__(self) -> int:
        """Blocks :meth:`popleft` can still hand out: plain free + evictable."""
        return len(self._plain) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        """Evictable blocks (cached, held by nobody)."""
        return len(self._evictable)

    def popleft(self) -> tuple[int, bool]:
        """Take the next block: ``(block_id, evicted)``; ``evicted`` says it was a cached one.

        Raises ``IndexError`` when both queues are empty (the allocator checks first).
        """
        if self._plain:
            return self._plain.popleft(), False
        if self._evictable:
            return self._evictable.popitem(last=False)[0], True
        raise IndexError("no free block")

    def append_free(self, block_id: int) -> None:
        """``block_id`` (no hash) goes to the back of the plain free queue."""
        self._plain.append(block_id)

    def append_evictable(self, block_id: int) -> None:
        """``block_id`` (cached) becomes the most recently freed evictable block."""
        self._evictable[block_id] = None

    def is_evictable(self, block_id: int) -> bool:
        return block_id in self._evictable

    def revive(self, block_id: int) -> None:
        """An evictable block is held again (a prefix-cache hit): it leaves the queue."""
        del self._evictable[block_id]

    def forget_hash(self, block_id: int) -> None:
        """An evictable block lost its hash: it moves to the back of the plain free queue."""
        del self._evictable[block_id]
        self._plain.append(block_id)

    def evictable(self) -> list[int]:
        """Evictable ids, the next to be evicted first (a new list)."""
        return list(self._evictable)


class SlotLRU:
    """Slots ``0 .. num_slots - 1`` of a tier below the device pool (host memory, a file), each
    holding one spilled block, keyed by its prefix-cache hash; least recently spilled first out.

    Every call is O(1). A slot is *free* (in the free queue), *held* (mapped from a hash), or
    neither: popped by its owner (a host slot whose copy back is owed), until :meth:`free`.

        s = SlotLRU(2)
        s.put(h1); s.put(h2)   # (0, None), (1, None)
        s.put(h3)              # (0, h1): full, so h1 (the oldest) is dropped for h3
        s.pop(h2)              # 1 (the caller frees it when it is done with it)
    """

    def __init__(self, num_slots: int) -> None:
        self._free: deque[int] = deque(range(num_slots))
        self._slot_of: OrderedDict = OrderedDict()  # hash -> slot, oldest spill first
        self._hash_at: dict = {}  # slot -> hash (the inverse)

    def __len__(self) -> int:
        """Slots held."""
        return len(self._slot_of)

    def __contains__(self, block_hash) -> bool:
        return block_hash in self._slot_of

    @property
    def num_free(self) -> int:
        """Slots in the free queue."""
        return len(self._free)

    def put(self, block_hash) -> tuple[int | None, object]:
        """A slot for ``block_hash`` (not held yet): a free one, else the oldest one's, whose
        hash is dropped. Returns ``(slot, dropped_hash)``; ``(None, None)`` when no slot is
        free or held (all popped)."""
        dropped = None
        if self._free:
            slot = self._free.popleft()
        elif self._slot_of:
            dropped, slot = self._slot_of.popitem(last=False)
        else:
            return None, None
        self._slot_of[block_hash] = slot
        self._hash_at[slot] = block_hash
        return slot, dropped

    def pop(self, block_hash) -> int:
        """Take ``block_hash`` out (KeyError if it is not held); its slot, not yet free."""
        slot = self._slot_of.pop(block_hash)
        del self._hash_at[slot]
        return slot

    def free(self, slot: int) -> None:
        """A popped slot goes back to the free queue."""
        self._free.append(slot)

    def touch(self, block_hash) -> None:
        """``block_hash`` becomes the most recently used (the last to be dropped)."""
        self._slot_of.move_to_end(block_hash)

    def slot_of(self, block_hash) -> int | None:
        """The slot holding ``block_hash``, or None."""
        return self._slot_of.get(block_hash)

    def hash_at(self, slot: int):
        """The hash held in ``slot``, or None."""
        return self._hash_at.get(slot)

    def hashes(self) -> list:
        """Hashes held, the next to be dropped first (a new list)."""
        return list(self._slot_of)

    def items(self) -> list[tuple]:
        """``(hash, slot)`` pairs, the next to be dropped first (a new list)."""
        return list(self._slot_of.items())
