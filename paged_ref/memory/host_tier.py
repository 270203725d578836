"""The tiers under the device pool: host memory, and optionally a disk tier below it.

When the device pool evicts a cached block, a :class:`KVCacheManager` built with
``num_host_blocks > 0`` copies it to a slot of a host pool instead of losing it; a later prompt
with the same prefix copies it back (host -> device, over PCIe) instead of recomputing it. With
a ``disk_tier`` (:class:`~paged_ref.memory.disk_tier.DiskTier`), a full host tier moves its
least recently spilled block down to the file instead of dropping it, and a hit there is read
back (disk -> host memory at the lookup, then -> device). A block is in exactly one tier: a
hit takes it out of its tier, and a hash the device caches again is dropped from below.

This class is the bookkeeping of the host slots (block hash -> slot, least recently spilled
first out) and the moves each step owes; the host bytes live in :class:`paged_ref.PagedKVCache`'s
``host_kv`` (pinned memory on a GPU machine), the disk bytes in the disk tier's file.

    tier = HostTier(2)
    tier.put(h1)          # (0, None): h1 spilled to host slot 0
    tier.put(h2); tier.put(h3)   # (0, h1): full, so h1 (the oldest) is dropped for h3
    tier.take(h2)         # 1: h2 comes back; slot 1 stays reserved until release_reserved()
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import TYPE_CHECKING, NamedTuple

from paged_ref.memory.allocator import check_int
from paged_ref.memory.disk_tier import DiskTier
from paged_ref.memory.free_queue import SlotLRU

if TYPE_CHECKING:
    import torch


class BlockOps(NamedTuple):
    """Block moves a step owes (before writing any K/V): ``PagedKVCache.apply_block_ops(ops)``
    runs them, the disk writes first (they read host slots and device blocks that the other
    moves overwrite), then spills, copies back from the disk, from the host, copy-on-writes."""

    swap_out: list[tuple[int, int]]  #: (device block, host slot): spill evicted cached blocks
    swap_in: list[tuple[int, int]]  #: (host slot, device block): bring host hits back
    copies: list[tuple[int, int]]  #: (src, dst) device blocks: copy-on-write
    # NOTE: the disk's moves default to empty tuples (never a shared mutable list), so a
    # BlockOps of three lists, as before the disk tier, still runs.
    to_disk: list[tuple[int, int]] = ()  #: (host slot, disk slot): the host tier's oldest, down
    device_to_disk: list[tuple[int, int]] = ()  #: (device block, disk slot): pushed off the
    #: host in the step that spilled it
    from_disk: list = ()  #: (block read from the disk ``[2, L, bs, Hkv, D]``, device block)


class HostTier:
    """Slots ``0 .. num_blocks - 1`` of host memory, each holding one spilled block, and the
    disk tier ``disk_tier`` (or None) under them.

    A slot taken by :meth:`take` (its block is being copied back) is *reserved*: it is not
    reused until :meth:`release_reserved`, called once the copies of the step have run.

    The moves owed since the last :meth:`take_moves`, each a list of pairs:
    ``swap_out`` (device block, host slot), ``swap_in`` (host slot, device block), ``to_disk``
    (host slot, disk slot), ``device_to_disk`` (device block, disk slot: a block pushed off
    the host in the step that spilled it), ``from_disk`` (block read from the disk, device block).
    """

    def __init__(self, num_blocks: int, disk_tier: DiskTier | None = None) -> None:
        self.num_blocks = check_int("num_host_blocks", num_blocks, minimum=1)
        if disk_tier is not None and not isinstance(disk_tier, DiskTier):
            raise TypeError(f"disk_tier must be a DiskTier, got {type(disk_tier).__name__}")
        self.disk = disk_tier
        self._slots = SlotLRU(self.num_blocks)
        self._reserved: list[int] = []
        self.swap_out: list[tuple[int, int]] = []
        self.swap_in: list[tuple[int, int]] = []
        self.to_disk: list[tuple[int, int]] = []
        self.device_to_disk: list[tuple[int, int]] = []
        self.from_disk: list[tuple[torch.Tensor, int]] = []

    def __len__(self) -> int:
        """Blocks held on the host."""
        return len(self._slots)

    def __contains__(self, block_hash: Hashable) -> bool:
        """Whether a hit finds ``block_hash`` here: on the host, or written on the disk."""
        return block_hash in self._slots or (self.disk is not None
                                             and self.disk.readable(block_hash))

    def put(self, block_hash: Hashable) -> tuple[int | None, Hashable | None]:
        """Find a slot for ``block_hash``: a free one, else the oldest spill's (dropped).

        Returns ``(slot, dropped_hash)``; ``(None, None)`` when every slot is reserved.
        """
        return self._slots.put(block_hash)

    def spill(self, block_id: int, block_hash: Hashable) -> None:
        """Device block ``block_id``, cached as ``block_hash``, is evicted: :meth:`put` it and
        owe the copy ``(block_id, slot)``. The oldest spill it pushes off goes to the disk tier
        (from its host slot, or from the device if its own copy was still owed: that copy is
        dropped), or is dropped without one; with every host slot reserved, the block goes to
        the disk directly."""
        self.discard(block_hash)  # (never two copies of one hash)
        slot, dropped = self.put(block_hash)
        if dropped is not None:
            owed = [b for b, s in self.swap_out if s == slot]  # its bytes not on the host yet
            self.swap_out = [(b, s) for b, s in self.swap_out if s != slot]
            self._move_to_disk(dropped, ("device", owed[0]) if owed else ("host", slot))
        if slot is not None:
            self.swap_out.append((block_id, slot))
        else:
            self._move_to_disk(block_hash, ("device", block_id))

    def take(self, block_hash: Hashable):
        """Remove ``block_hash`` from the tiers (a hit: it goes back to the device). Returns
        its host slot (an int, reserved until :meth:`release_reserved`), or for a block on the
        disk its K/V ``[2, num_layers, block_size, Hkv, D]``, read already (:meth:`load`)."""
        if block_hash in self._slots:
            slot = self._slots.pop(block_hash)
            self._reserved.append(slot)
            return slot
        return self.disk.take(block_hash)

    def copy_back(self, source, block_id: int) -> None:
        """Owe the copy of a hit's ``source`` (what :meth:`take` returned) into ``block_id``."""
        if isinstance(source, int):
            self.swap_in.append((source, block_id))
        else:
            self.from_disk.append((source, block_id))

    def load(self, hashes: list[Hashable], hit: list[int | None]) -> list[int | None]:
        """A lookup found ``hit`` (per block of ``hashes``: a device block, or None: down here).
        Read its blocks on the disk now (or wait for their prefetch); return ``hit`` cut before
        the first one that could not be read (that hash is dropped; the tokens are recomputed)."""
        if self.disk is None:
            return hit
        host = self._slots
        wanted = [h for h, b in zip(hashes, hit, strict=False) if b is None and h not in host]
        if not wanted:
            return hit
        failed = set(self.disk.load(wanted))
        bad = [j for j, b in enumerate(hit) if b is None and hashes[j] in failed]
        return hit[:bad[0]] if bad else hit

    def prefetch(self, hashes: list[Hashable]) -> int:
        """Start reading those of ``hashes`` that are on the disk; how many reads started.
        Those here become the most recently used: a request about to be admitted finds them
        here, not spilled to the disk meanwhile."""
        on_disk = []
        for block_hash in hashes:
            if block_hash in self._slots:
                self._slots.touch(block_hash)
            else:
                on_disk.append(block_hash)
        return 0 if self.disk is None else self.disk.prefetch(on_disk)

    def discard(self, block_hash: Hashable) -> None:
        """The device caches ``block_hash`` again: drop any copy of it here or on the disk,
        with the move owed into its slot."""
        if block_hash in self._slots:
            slot = self._slots.pop(block_hash)
            self._slots.free(slot)
            self.swap_out = [(b, s) for b, s in self.swap_out if s != slot]
        elif self.disk is not None and block_hash in self.disk:
            self._forget_disk_writes(self.disk.discard(block_hash))

    def owed_targets(self) -> set[int]:
        """Device blocks that owed copies back (from the host, from the disk) will fill."""
        return {d for _, d in self.swap_in} | {d for _, d in self.from_disk}

    def has_moves(self) -> bool:
        """Whether any move is owed."""
        return any(self._moves())

    def take_moves(self, copies: list[tuple[int, int]]) -> BlockOps:
        """The owed moves, with the copy-on-writes ``copies``, handed over once; the slots of
        this step's copies back are free again."""
        ops = BlockOps(self.swap_out, self.swap_in, copies, self.to_disk, self.device_to_disk,
                       self.from_disk)
        self.swap_out, self.swap_in, self.to_disk, self.device_to_disk, self.from_disk = (
            [], [], [], [], [])
        self.release_reserved()
        return ops

    def release_reserved(self) -> None:
        """The copies back to the device have run: their slots are free again."""
        for slot in self._reserved:
            self._slots.free(slot)
        self._reserved.clear()

    def hashes(self) -> list[Hashable]:
        """Hashes on the host, the next to be dropped first."""
        return self._slots.hashes()

    def slot_of(self, block_hash: Hashable) -> int | None:
        """The host slot holding ``block_hash``, or None."""
        return self._slots.slot_of(block_hash)

    @property
    def num_free_slots(self) -> int:
        """Host slots holding nothing and not reserved."""
        return self._slots.num_free

    # ---- helpers ----------------------------------------------------------------------------

    def _moves(self) -> tuple[list, ...]:
        return self.swap_out, self.swap_in, self.to_disk, self.device_to_disk, self.from_disk

    def _move_to_disk(self, block_hash: Hashable, source: tuple[str, int]) -> None:
        """Put ``block_hash`` on the disk tier (if any) and owe its write from ``source``
        (``("host", slot)`` or ``("device", block)``); the disk's oldest block may be dropped,
        and with it the write owed into its slot."""
        if self.disk is None:
            return
        slot, dropped = self.disk.put(block_hash)
        if dropped is not None:
            self._forget_disk_writes(slot)
        (self.to_disk if source[0] == "host" else self.device_to_disk).append((source[1], slot))

    def _forget_disk_writes(self, disk_slot: int | None) -> None:
        """No write is owed into ``disk_slot`` any more (its hash left the disk)."""
        self.to_disk = [(h, d) for h, d in self.to_disk if d != disk_slot]
        self.device_to_disk = [(b, d) for b, d in self.device_to_disk if d != disk_slot]


def tier_counts(host: HostTier | None) -> dict[str, int]:
    """The tiers' fields of ``CacheStats``: blocks held on the host and on the disk, and the
    disk's bytes read and written and its failed reads and writes."""
    disk = None if host is None else host.disk
    if disk is None:
        return {"blocks_on_host": 0 if host is None else len(host)}
    return {"blocks_on_host": len(host), "blocks_on_disk": len(disk),
            "disk_bytes_read": disk.bytes_read, "disk_bytes_written": disk.bytes_written,
            "disk_read_errors": disk.read_errors, "disk_write_errors": disk.write_errors}
