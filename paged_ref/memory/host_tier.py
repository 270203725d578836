"""The host tier of the prefix cache: which evicted blocks were spilled to host memory.

When the device pool evicts a cached block, a :class:`KVCacheManager` built with
``num_host_blocks > 0`` copies it to a slot of a host pool instead of losing it; a later prompt
with the same prefix copies it back (host -> device, over PCIe) instead of recomputing it.
This class is only the bookkeeping: block hash -> host slot, least recently spilled first out.
The bytes live in :class:`paged_ref.PagedKVCache`'s ``host_kv`` (pinned memory on a GPU machine).

    tier = HostTier(2)
    tier.put(h1)          # (0, None): h1 spilled to host slot 0
    tier.put(h2); tier.put(h3)   # (0, h1): full, so h1 (the oldest) is dropped for h3
    tier.take(h2)         # 1: h2 comes back; slot 1 stays reserved until release_reserved()
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Hashable

from paged_ref.memory.allocator import check_int


class HostTier:
    """Slots ``0 .. num_blocks - 1`` of host memory, each holding one spilled block.

    A slot taken by :meth:`take` (its block is being copied back) is *reserved*: it is not
    reused until :meth:`release_reserved`, called once the copies of the step have run.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = check_int("num_host_blocks", num_blocks, minimum=1)
        self._free: deque[int] = deque(range(self.num_blocks))
        self._slot_of: OrderedDict[Hashable, int] = OrderedDict()  # oldest spill first
        self._reserved: list[int] = []

    def __len__(self) -> int:
        """Blocks held on the host."""
        return len(self._slot_of)

    def __contains__(self, block_hash: Hashable) -> bool:
        return block_hash in self._slot_of

    def put(self, block_hash: Hashable) -> tuple[int | None, Hashable | None]:
        """Find a slot for ``block_hash``: a free one, else the oldest spill's (dropped).

        Returns ``(slot, dropped_hash)``; ``(None, None)`` when every slot is reserved.
        """
        dropped = None
        if self._free:
            slot = self._free.popleft()
        elif self._slot_of:
            dropped, slot = self._slot_of.popitem(last=False)
        else:
            return None, None
        self._slot_of[block_hash] = slot
        return slot, dropped

    def spill(self, block_id: int, block_hash: Hashable,
              swap_out: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """Device block ``block_id``, cached as ``block_hash``, is evicted: :meth:`put` it.

        ``swap_out``: the spills ``(device block, host slot)`` owed and not yet run. Returns
        them with this one appended (if a slot was found), and without any that was headed for
        the slot just taken from the oldest spill (that one is dropped, never copied).
        """
        slot, dropped = self.put(block_hash)
        if dropped is not None:
            swap_out = [(b, s) for b, s in swap_out if s != slot]
        if slot is not None:
            swap_out = swap_out + [(block_id, slot)]
        return swap_out

    def take(self, block_hash: Hashable) -> int:
        """Remove ``block_hash`` from the host (it goes back to the device); its slot."""
        slot = self._slot_of.pop(block_hash)
        self._reserved.append(slot)
        return slot

    def release_reserved(self) -> None:
        """The copies back to the device have run: their slots are free again."""
        self._free.extend(self._reserved)
        self._reserved.clear()

    def hashes(self) -> list[Hashable]:
        """Hashes on the host, the next to be dropped first."""
        return list(self._slot_of)
