# Your exercises for lesson 2: replace each `raise NotImplementedError(...)`.
# The lesson notebook's check cells (or `make test-exercises EX=ex02`) test this file.
# Generated from solutions/ex02_block_allocator.py by tools/make_exercises.py.
"""Lesson 02: a block allocator and block tables.

A serving engine splits the KV cache into *blocks* of ``block_size`` token slots. Each
sequence owns a list of block ids, its *block table*: token ``t`` lives in block
``block_table[t // block_size]`` at offset ``t % block_size``, and its *slot*, its row in the
cache flattened to ``[num_blocks * block_size, num_kv_heads, head_dim]``, is

    slot = block_table[t // block_size] * block_size + t % block_size

Exercises:
    2.1  SimpleBlockAllocator.allocate   take a free block
    2.2  SimpleBlockAllocator.free       give it back (and catch mistakes)
    2.3  blocks_needed                   how many blocks ``n`` tokens need
    2.4  append_slot                     grow a sequence by one token
    2.5  slot_mapping                    where a list of tokens lives

``paged_ref.BlockAllocator`` and ``paged_ref.KVCacheManager`` are the finished versions; once
your functions pass, compare them.
"""

from __future__ import annotations

from collections import deque

from paged_ref import OutOfBlocksError  # noqa: F401  (you raise it in Exercise 2.1)


class SimpleBlockAllocator:
    """Hands out block ids ``0 .. num_blocks - 1`` and takes them back.

    State (given):
        ``self._free_list``: a deque of the free block ids, in the order to hand them out.
        ``self._free_set``: the same ids as a set, to answer "is block b free?" in O(1).
    Keep the two in step: a block id is in both or in neither.
    """

    def __init__(self, num_blocks: int):
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._free_list = deque(range(num_blocks))
        self._free_set = set(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """How many blocks :meth:`allocate` can still hand out."""
        return len(self._free_list)

    def allocate(self) -> int:
        """Exercise 2.1: take one free block and return its id, in O(1).

        Raise ``paged_ref.OutOfBlocksError`` (imported above) when no block is free, with a
        message that says how many blocks the pool has.

        Example:
            >>> a = SimpleBlockAllocator(2)
            >>> a.allocate(), a.allocate()
            (0, 1)
            >>> a.allocate()
            Traceback (most recent call last):
            OutOfBlocksError: all 2 blocks are in use

        Hints:
            * ``deque.popleft()`` is O(1); so is ``set.remove``.
            * Check for an empty free list *before* changing anything.
        """
        raise NotImplementedError("Exercise 2.1: allocate")

    def free(self, block_id: int) -> None:
        """Exercise 2.2: give block ``block_id`` back, in O(1).

        Raise ``ValueError`` (and change nothing) when ``block_id`` is not in
        ``[0, num_blocks)`` or is already free (a *double free*: in a real engine two sequences
        would end up writing into the same block).

        Example:
            >>> a = SimpleBlockAllocator(4)
            >>> b = a.allocate()
            >>> a.free(b)
            >>> a.num_free_blocks
            4
            >>> a.free(b)
            Traceback (most recent call last):
            ValueError: block 0 is already free

        Hints:
            * Test membership in ``self._free_set``, not in the deque (that would be O(n)).
            * Append the id to ``self._free_list`` and add it to ``self._free_set``.
        """
        raise NotImplementedError("Exercise 2.2: free")


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Exercise 2.3: the number of blocks that hold ``num_tokens`` tokens.

    That is ``ceil(num_tokens / block_size)``: 0 tokens need 0 blocks, and a partly filled
    last block still counts as a whole block.

    Example:
        >>> blocks_needed(0, 16), blocks_needed(1, 16), blocks_needed(16, 16), blocks_needed(17, 16)
        (0, 1, 1, 2)

    Hints:
        * Stay in integers: ``math.ceil(a / b)`` goes through a float, which rounds wrongly for
          very large numbers. ``(a + b - 1) // b`` or ``-(-a // b)`` does not.
    """
    raise NotImplementedError("Exercise 2.3: blocks_needed")


def append_slot(block_table: list[int], seq_len: int, block_size: int, allocator) -> int:
    """Exercise 2.4: make room for the token at position ``seq_len`` and return its slot.

    The sequence holds ``seq_len`` tokens in the blocks of ``block_table``. The new token goes
    to position ``seq_len``. When ``seq_len`` is a multiple of ``block_size`` (0 included)
    every block is full, so take a new one with ``allocator.allocate()`` and append it to
    ``block_table`` (change the list in place). Otherwise do not allocate.

    Example (block_size 4, the allocator hands out block 7 next):
        >>> table = [3]
        >>> append_slot(table, 3, 4, allocator)   # block 3 has room: offset 3
        15
        >>> append_slot(table, 4, 4, allocator)   # block 3 is full: new block 7, offset 0
        28
        >>> table
        [3, 7]

    Hints:
        * ``slot = block_table[pos // block_size] * block_size + pos % block_size``
        * If ``allocator.allocate()`` raises, let the error through with ``block_table``
          unchanged (calling it before you modify anything gives you that for free).
    """
    raise NotImplementedError("Exercise 2.4: append_slot")


def slot_mapping(block_table: list[int], positions: list[int], block_size: int) -> list[int]:
    """Exercise 2.5: the slot of each token position in ``positions``.

    During prefill, a whole prompt's K and V are written at once: the kernel needs, for each
    token, the row of the flattened cache to write to. ``positions`` are token positions
    within the sequence (any order, each ``< len(block_table) * block_size``).

    Example (block_size 4):
        >>> slot_mapping([5, 2], [0, 1, 4, 6], 4)
        [20, 21, 8, 10]

    Hints:
        * The same formula as in 2.4, once per position; a list comprehension is enough.
    """
    raise NotImplementedError("Exercise 2.5: slot_mapping")
