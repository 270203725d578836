"""The tiers under an engine's KV pool, from the engine's arguments.

Evicted cached blocks go down and come back up (:mod:`.host_tier`, :mod:`.disk_tier`)::

    device pool (num_blocks) -> host tier (num_host_blocks, CPU memory)
                             -> disk tier (num_disk_blocks, one file in disk_path)

vLLM sizes its CPU swap space in GiB (``swap_space``) and LMCache its CPU and disk backends
in bytes (``max_local_cpu_size``, ``local_disk`` + ``max_local_disk_size``); here both are
counted in blocks, as the pool is. One block is ``2 * num_layers * block_size * num_kv_heads
* head_dim`` elements of the cache's dtype (``DiskTier.block_bytes``).

    host = host_tier_blocks(num_blocks, "recompute", 64)
    disk = open_disk_tier("/mnt/nvme", 4096, num_host_blocks=host, enable_prefix_caching=True,
                          kv_format=None, block_shape=(2, 16, 16, 8, 64), dtype=torch.bfloat16)
"""

from __future__ import annotations

import os

import torch

from paged_ref.memory.allocator import check_int
from paged_ref.memory.disk_tier import DiskTier


def host_tier_blocks(num_blocks: int, preemption_mode: str, num_host_blocks) -> int:
    """The host tier's size in blocks: ``num_host_blocks`` if given, else as many as the pool
    with ``preemption_mode="swap"`` (its blocks spill there) and none otherwise.

    Raises:
        TypeError: ``num_host_blocks`` is not an int or None.
        ValueError: it is negative, or 0 with ``"swap"`` (a swap needs somewhere to go).
    """
    if num_host_blocks is None:
        return num_blocks if preemption_mode == "swap" else 0
    num_host_blocks = check_int("num_host_blocks", num_host_blocks)
    if preemption_mode == "swap" and num_host_blocks == 0:
        raise ValueError("num_host_blocks=0 leaves preemption_mode='swap' no host tier: give "
                         "num_host_blocks > 0, or None (as many as num_blocks)")
    return num_host_blocks


def open_disk_tier(disk_path, num_disk_blocks, *, num_host_blocks: int,
                   enable_prefix_caching: bool, kv_format, block_shape: tuple[int, ...],
                   dtype: torch.dtype, workers: int = 4) -> DiskTier | None:
    """The disk tier of ``num_disk_blocks`` blocks in a file made in the folder ``disk_path``
    (None: no disk tier, and ``num_disk_blocks`` must be 0). Every argument is checked
    before the file is made.

    Args:
        disk_path: an existing folder this process can write (an SSD's), or None.
        num_disk_blocks: the file's slots (>= 1 with ``disk_path``).
        num_host_blocks, enable_prefix_caching, kv_format: the engine's; the disk tier sits
            under a host tier (> 0 blocks), holds cached blocks (prefix caching on) of a plain
            cache (``kv_format`` None).
        block_shape, dtype: one block, ``(2, num_layers, block_size, num_kv_heads, head_dim)``
            of the cache's dtype (``PagedKVCache.host_kv.shape[1:]``).
        workers: the disk tier's read-ahead threads.

    Raises:
        TypeError / ValueError: naming the argument (``disk_path`` for what the disk tier
            needs of the others).
    """
    if disk_path is None:
        if check_int("num_disk_blocks", num_disk_blocks):
            raise ValueError("num_disk_blocks needs disk_path (the folder for the disk tier's "
                             "file)")
        return None
    if not isinstance(disk_path, (str, os.PathLike)):
        raise TypeError(f"disk_path must be a folder (a str or a path), got "
                        f"{type(disk_path).__name__}")
    num_disk_blocks = check_int("num_disk_blocks", num_disk_blocks, minimum=1)
    for broken, why in ((not enable_prefix_caching, "enable_prefix_caching=True (the tiers "
                         "hold cached blocks)"),
                        (not num_host_blocks, "a host tier above it: num_host_blocks > 0 (or "
                         "preemption_mode='swap')"),
                        (kv_format is not None, f"a plain cache, not kv_format={kv_format!r}")):
        if broken:
            raise ValueError(f"disk_path: the disk tier needs {why}")
    try:
        return DiskTier(disk_path, num_disk_blocks, block_shape, dtype, workers=workers)
    except ValueError as exc:
        raise ValueError(f"disk_path: {exc}") from exc
