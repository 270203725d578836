"""Memory: the blocks of the KV cache and who holds them (plain Python, no GPU needed).

:mod:`.allocator` hands out block ids and counts their holders; :mod:`.manager` keeps one
block table per sequence (sharing, copy-on-write, prefix caching); :mod:`.host_tier` is where
evicted cached blocks spill; :mod:`.storage` holds the K/V tensors the tables point into.
"""
