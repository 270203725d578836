# Your exercises for lesson 11: replace each `raise NotImplementedError(...)`.
# The lesson notebook's check cells (or `make test-exercises EX=ex11`) test this file.
# Generated from solutions/ex11_transfer.py by tools/make_exercises.py.
"""Lesson 11: moving a sequence's KV blocks from one pool to another.

Two exercises, then the library's send/recv (``paged_ref.transfer``) does the rest:

* Ex 11.1 :func:`pack_blocks`   gather a sequence's scattered blocks, every layer, K and V,
                                into one contiguous buffer (one send instead of thousands)
* Ex 11.2 :func:`unpack_blocks` scatter such a buffer into the blocks the receiver's
                                allocator gave

Layout, per layer (as everywhere in the course)::

    k_caches[layer], v_caches[layer]   [num_blocks, block_size, num_kv_heads, head_dim]
    packed                             [num_layers, 2, n, block_size, num_kv_heads, head_dim]
                                       packed[l, 0, j] = K of the j-th listed block of layer l,
                                       packed[l, 1, j] = its V
"""

from __future__ import annotations

import torch


def pack_blocks(cache, block_ids: list[int], out: torch.Tensor | None = None) -> torch.Tensor:
    """Exercise 11.1: gather blocks ``block_ids`` (in that order) of every layer's K and V.

    Args:
        cache: a :class:`paged_ref.PagedKVCache`; ``cache.k_caches[layer]`` and
            ``cache.v_caches[layer]`` are ``[num_blocks, block_size, Hkv, D]``.
        block_ids: the sequence's block table (logical order), ids in ``[0, num_blocks)``.
        out: optional, a contiguous tensor of the result's shape to fill (else a new one).

    Returns:
        A contiguous tensor ``[num_layers, 2, len(block_ids), block_size, Hkv, D]`` on the
        cache's device and dtype: index 0 of the second dimension is K, 1 is V.

    Hints:
        * One ``index_select`` (or advanced indexing) per layer and per K/V picks the blocks;
          ``torch.stack`` puts the pieces together (or fill a preallocated ``torch.empty``).
        * The order of ``block_ids`` is the sequence's logical order: keep it.
    """
    raise NotImplementedError("Exercise 11.1: pack_blocks")


def unpack_blocks(cache, block_ids: list[int], packed: torch.Tensor) -> None:
    """Exercise 11.2: write ``packed`` (from :func:`pack_blocks` on another pool) into blocks
    ``block_ids`` of ``cache``, in place: the j-th packed block goes to ``block_ids[j]``.

    Every other block stays as it was.

    Hints:
        * ``tensor.index_copy_(0, idx, source)`` or ``tensor[idx] = source``, per layer, K and V.
        * The receiver's ids differ from the sender's: only the position j links them.
    """
    raise NotImplementedError("Exercise 11.2: unpack_blocks")
