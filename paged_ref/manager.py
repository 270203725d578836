"""KV-cache manager (work in progress): per-sequence block tables on top of BlockAllocator."""

from __future__ import annotations

from paged_ref.allocator import BlockAllocator


class KVCacheManager:
    """Placeholder; the full manager lands shortly."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.allocator = BlockAllocator(num_blocks, block_size)
