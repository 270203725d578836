"""A snapshot of a :class:`~paged_ref.KVCacheManager`'s pool: what :meth:`stats` returns."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paged_ref.memory.tables import BlockTables


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
    prefix_disk_hit_tokens: int = 0  #: of the hits, tokens read back from the disk tier
    blocks_on_disk: int = 0  #: evicted cached blocks kept in the disk tier
    disk_bytes_read: int = 0  #: bytes read back from the disk tier's file, over all reads
    disk_bytes_written: int = 0  #: bytes written to it, over all spills
    disk_read_errors: int = 0  #: disk reads that failed (their blocks dropped, recomputed)
    disk_write_errors: int = 0  #: disk writes that failed (their blocks dropped)

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

    @property
    def prefix_device_hit_tokens(self) -> int:
        """Of the hits, tokens found on the device (shared, no copy)."""
        return self.prefix_hit_tokens - self.prefix_host_hit_tokens - self.prefix_disk_hit_tokens


def measure(tables: BlockTables, ref_count: Callable[[int], int], **counts: int) -> CacheStats:
    """The :class:`CacheStats` of ``tables``' pool now. ``ref_count(block_id)``: how many
    sequences hold a block; ``counts``: the prefix cache's and the host tier's fields."""
    bs = tables.block_size
    fill: dict[int, int] = {}  # held block -> tokens in it (equal for all its holders)
    for seq_id in tables.seq_ids:
        length = tables.seq_len(seq_id)
        for j, block_id in enumerate(tables.block_table(seq_id)):
            fill[block_id] = min(bs, length - j * bs)
    used = tables.num_blocks - tables.num_free_blocks
    return CacheStats(
        num_blocks=tables.num_blocks,
        block_size=bs,
        blocks_used=used,
        blocks_free=tables.num_free_blocks,
        tokens_stored=sum(tables.seq_len(s) for s in tables.seq_ids),
        slots_reserved_empty=used * bs - sum(fill.values()),
        num_sequences=len(tables),
        blocks_evictable=tables.allocator.num_evictable_blocks,
        blocks_shared=sum(ref_count(b) > 1 for b in fill),
        **counts,
    )
