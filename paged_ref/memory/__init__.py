"""Memory: the blocks of the KV cache and who holds them (plain Python, no GPU needed).

One module a job, from the pool up (vLLM v1 keeps the same rooms: ``FreeKVCacheBlockQueue``,
``BlockPool``, ``KVCacheManager``):

* :mod:`.free_queue` -- the order free blocks are handed out in: plain free first, then cached
  blocks nobody holds, least recently used first;
* :mod:`.allocator` -- :class:`BlockAllocator`, the pool: hands out block ids, counts their
  holders, maps prefix-cache hashes to blocks;
* :mod:`.prefix_cache` -- the hash chain (``hash_block_tokens``), lookups, which sequence
  registered which block, hit counters;
* :mod:`.tables` -- one block table per sequence and what attention reads from them;
* :mod:`.manager` -- :class:`KVCacheManager`: sequences start, grow, fork (copy-on-write) and
  end against the pool; the block moves each step owes;
* :mod:`.host_tier` -- where evicted cached blocks spill, and the moves each step owes;
  :mod:`.disk_tier` -- the file below it (``DiskTier``); :mod:`.tiers` -- both sized and
  checked from an engine's arguments; :mod:`.stats` -- ``CacheStats``;
* :mod:`.storage` -- :class:`PagedKVCache`, the K/V tensors the tables point into.
"""
