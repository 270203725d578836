"""Block allocator: hands out fixed-size KV-cache blocks by id and takes them back.

A *block* holds the keys and values of ``block_size`` consecutive tokens of one sequence. The
allocator knows nothing about sequences or tensors; it only tracks which block ids
``0 .. num_blocks - 1`` are free. :class:`paged_ref.KVCacheManager` builds block tables on top.

    a = BlockAllocator(num_blocks=4, block_size=16)
    b = a.allocate()      # 0 (lowest free id first)
    a.free(b)             # back to the free list

Both calls are O(1): a free list (a deque, popped from the left) plus a ``bytearray`` that says,
per block id, whether it is free (so double frees are caught without scanning the list).
"""

from __future__ import annotations

from collections import deque
from numbers import Integral


class OutOfBlocksError(RuntimeError):
    """Raised by :meth:`BlockAllocator.allocate` when every block is in use."""


def check_int(name: str, value, *, minimum: int | None = 0) -> int:
    """``value`` as an ``int`` if it is an integer ``>= minimum`` (NumPy integers count).

    Raises ``TypeError`` for a non-integer (``bool`` included) and ``ValueError`` below
    ``minimum`` (no lower bound when ``minimum`` is None); both messages name the argument.
    """
    if isinstance(value, bool) or not isinstance(value, Integral):
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

    Blocks are handed out lowest id first; a freed block goes to the back of the free list
    (so it is reused after the never-used ones), which keeps pictures and tests deterministic.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self._num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        self._block_size = check_int("block_size", block_size, minimum=1)
        self._free_list: deque[int] = deque(range(self._num_blocks))
        self._is_free = bytearray(b"\x01") * self._num_blocks  # 1 = free, 0 = allocated

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
        """Blocks that :meth:`allocate` can still hand out."""
        return len(self._free_list)

    @property
    def num_used_blocks(self) -> int:
        """Blocks handed out and not yet freed (``num_blocks - num_free_blocks``)."""
        return self._num_blocks - len(self._free_list)

    def allocate(self) -> int:
        """Take a free block and return its id. O(1).

        Raises:
            OutOfBlocksError: every block is in use (nothing changes).
        """
        if not self._free_list:
            raise OutOfBlocksError(
                f"out of KV-cache blocks: all {self._num_blocks} blocks of "
                f"{self._block_size} tokens are in use"
            )
        block_id = self._free_list.popleft()
        self._is_free[block_id] = 0
        return block_id

    def free(self, block_id: int) -> None:
        """Give block ``block_id`` back to the pool. O(1).

        Raises:
            TypeError: ``block_id`` is not an int.
            ValueError: ``block_id`` is outside ``[0, num_blocks)`` or already free.
            After an error nothing has changed.
        """
        block_id = self._check_id(block_id)
        if self._is_free[block_id]:
            raise ValueError(f"double free: block {block_id} is already free")
        self._is_free[block_id] = 1
        self._free_list.append(block_id)

    def is_free(self, block_id: int) -> bool:
        """Whether block ``block_id`` is free (same argument checks as :meth:`free`)."""
        return bool(self._is_free[self._check_id(block_id)])

    def _check_id(self, block_id) -> int:
        """``block_id`` as an ``int`` (NumPy integers are fine) if it names a block."""
        if isinstance(block_id, bool) or not isinstance(block_id, Integral):
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
            f"free={self.num_free_blocks})"
        )
