"""KV-cache manager: one block table per sequence, built on a :class:`BlockAllocator`.

A sequence of ``n`` tokens owns ``ceil(n / block_size)`` blocks, listed in its *block table*:
token ``t`` lives in block ``table[t // block_size]`` at offset ``t % block_size``, and its
*slot* (its row in the cache flattened to ``[num_blocks * block_size, ...]``) is
``table[t // block_size] * block_size + t % block_size``.

    m = KVCacheManager(num_blocks=8, block_size=4)
    m.add_sequence("a", 6)        # prompt of 6 tokens -> 2 blocks: [0, 1]
    m.slot_mapping("a")           # [0, 1, 2, 3, 4, 5]  (where prefill writes the prompt's K/V)
    m.append_slot("a")            # 6: token 6 goes in block 1, offset 2 (no new block)
    m.append_slot("a")            # 7
    m.append_slot("a")            # 8: length 8 is a multiple of 4 -> a new block (2)
    m.free_sequence("a")          # all three blocks go back to the allocator

Every method that changes state either succeeds or raises with nothing changed. An unknown
``seq_id`` is a ``ValueError`` naming the id, whatever the method.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

import torch

from paged_ref.allocator import BlockAllocator, OutOfBlocksError, check_int
from paged_ref.cache_math import blocks_needed, token_slot, token_slots


@dataclass(frozen=True)
class CacheStats:
    """A snapshot of how the cache is used. Counts are in blocks or tokens, as named."""

    num_blocks: int  #: blocks in the pool
    block_size: int  #: tokens per block
    blocks_used: int  #: blocks owned by some sequence
    blocks_free: int  #: blocks the allocator can still hand out
    tokens_stored: int  #: tokens held, summed over sequences
    slots_reserved_empty: int  #: slots in used blocks that hold no token yet (internal waste)
    num_sequences: int  #: sequences held

    @property
    def slots_used(self) -> int:
        """Token slots in used blocks: ``blocks_used * block_size``."""
        return self.blocks_used * self.block_size

    @property
    def utilization(self) -> float:
        """Share of reserved slots that hold a token: ``tokens_stored / slots_used``.

        1.0 when no block is used (nothing is reserved, so nothing is wasted).
        """
        return 1.0 if self.blocks_used == 0 else self.tokens_stored / self.slots_used


class KVCacheManager:
    """Block tables for many sequences that share one pool of blocks.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.

    ``seq_id`` may be any hashable value (an int or a str in the lessons).
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self._allocator = BlockAllocator(num_blocks, block_size)
        self._tables: dict[Hashable, list[int]] = {}
        self._lens: dict[Hashable, int] = {}

    # ---- sizes ------------------------------------------------------------------------------

    @property
    def allocator(self) -> BlockAllocator:
        """The allocator that owns the free blocks (read it; change it only through here)."""
        return self._allocator

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self._allocator.num_blocks

    @property
    def block_size(self) -> int:
        """Tokens per block."""
        return self._allocator.block_size

    @property
    def num_free_blocks(self) -> int:
        """Blocks not owned by any sequence."""
        return self._allocator.num_free_blocks

    @property
    def seq_ids(self) -> list[Hashable]:
        """Ids of the sequences held, oldest first (a new list)."""
        return list(self._tables)

    def has_sequence(self, seq_id: Hashable) -> bool:
        """Whether ``seq_id`` is held."""
        try:
            return seq_id in self._tables
        except TypeError:  # unhashable: cannot be held
            return False

    def __contains__(self, seq_id: Hashable) -> bool:
        return self.has_sequence(seq_id)

    def __len__(self) -> int:
        return len(self._tables)

    # ---- changing state ---------------------------------------------------------------------

    def add_sequence(self, seq_id: Hashable, num_tokens: int) -> None:
        """Start sequence ``seq_id`` with ``num_tokens`` tokens (its prompt), all or nothing.

        Takes ``ceil(num_tokens / block_size)`` blocks (none for an empty sequence).

        Raises:
            ValueError: ``seq_id`` is already held, or ``num_tokens`` is negative.
            TypeError: ``seq_id`` is not hashable, or ``num_tokens`` is not an int.
            OutOfBlocksError: too few free blocks; no block is taken.
        """
        try:
            hash(seq_id)
        except TypeError:
            raise TypeError(
                f"seq_id must be hashable (an int or a str), got {type(seq_id).__name__}"
            ) from None
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already exists")
        num_tokens = check_int("num_tokens", num_tokens)
        needed = blocks_needed(num_tokens, self.block_size)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"sequence {seq_id!r} needs {needed} blocks for {num_tokens} tokens but only "
                f"{self.num_free_blocks} of {self.num_blocks} are free"
            )
        self._tables[seq_id] = [self._allocator.allocate() for _ in range(needed)]
        self._lens[seq_id] = num_tokens

    def append_slot(self, seq_id: Hashable) -> int:
        """Grow ``seq_id`` by one token and return that token's slot.

        A new block is taken only when the current length is a multiple of ``block_size``
        (including length 0); otherwise the token goes into the last block's next free slot.

        Raises:
            ValueError: unknown ``seq_id``.
            OutOfBlocksError: a new block is needed and none is free; the sequence is unchanged.
        """
        table = self._table(seq_id)
        pos = self._lens[seq_id]
        if pos % self.block_size == 0:
            table.append(self._allocator.allocate())  # raises before anything changes
        self._lens[seq_id] = pos + 1
        return token_slot(table, pos, self.block_size)

    def append_slots(self, seq_ids: Iterable[Hashable]) -> list[int]:
        """One decode step: :meth:`append_slot` for each of ``seq_ids``, all or nothing.

        Returns the slots in the order given (the decode step's slot mapping).

        Raises:
            ValueError: an unknown or repeated id.
            OutOfBlocksError: the step needs more new blocks than are free; nothing changes.
        """
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self._table(seq_id)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids repeats an id: {seq_ids!r}")
        needed = sum(1 for s in seq_ids if self._lens[s] % self.block_size == 0)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"this step needs {needed} new blocks but only {self.num_free_blocks} "
                f"of {self.num_blocks} are free"
            )
        return [self.append_slot(s) for s in seq_ids]

    def free_sequence(self, seq_id: Hashable) -> None:
        """Forget ``seq_id`` and give all its blocks back. ``ValueError`` if unknown."""
        table = self._table(seq_id)
        for block_id in table:
            self._allocator.free(block_id)
        del self._tables[seq_id]
        del self._lens[seq_id]

    # ---- reading state ----------------------------------------------------------------------

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block ids of ``seq_id``, in logical order (a copy)."""
        return list(self._table(seq_id))

    def seq_len(self, seq_id: Hashable) -> int:
        """Tokens held for ``seq_id``."""
        self._table(seq_id)
        return self._lens[seq_id]

    def slot_mapping(self, seq_id: Hashable, start: int = 0, end: int | None = None) -> list[int]:
        """Slots of tokens ``start .. end-1`` of ``seq_id`` (``end`` defaults to its length).

        Prefill writes a prompt's K/V with ``cache.write(layer, k, v, m.slot_mapping(seq_id))``.

        Raises:
            ValueError: unknown ``seq_id``, or not ``0 <= start <= end <= seq_len``.
        """
        table = self._table(seq_id)
        length = self._lens[seq_id]
        start = check_int("start", start)
        end = length if end is None else check_int("end", end)
        if not start <= end <= length:
            raise ValueError(
                f"need 0 <= start <= end <= seq_len, got start={start}, end={end}, "
                f"seq_len={length} for sequence {seq_id!r}"
            )
        return token_slots(table, end, self.block_size, start)

    def batch_tables(
        self, seq_ids: Iterable[Hashable], device: str | torch.device = "cpu"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The ``block_tables`` and ``seq_lens`` that ``paged_ref.paged_attention`` takes.

        Returns:
            block_tables: int32 ``[len(seq_ids), max_blocks]``, ``max_blocks`` the longest
                table (at least 1); unused entries are -1.
            seq_lens: int32 ``[len(seq_ids)]``.
        """
        seq_ids = list(seq_ids)
        tables = [self._table(s) for s in seq_ids]
        width = max([1] + [len(t) for t in tables])
        block_tables = torch.full((len(seq_ids), width), -1, dtype=torch.int32)
        for row, table in enumerate(tables):
            block_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        seq_lens = torch.tensor([self._lens[s] for s in seq_ids], dtype=torch.int32)
        return block_tables.to(device), seq_lens.to(device)

    def stats(self) -> CacheStats:
        """Blocks used and free, tokens stored, slots reserved but empty (a snapshot)."""
        used = self.num_blocks - self.num_free_blocks
        tokens = sum(self._lens.values())
        return CacheStats(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            blocks_used=used,
            blocks_free=self.num_free_blocks,
            tokens_stored=tokens,
            slots_reserved_empty=used * self.block_size - tokens,
            num_sequences=len(self._tables),
        )

    def _table(self, seq_id: Hashable) -> list[int]:
        """The live table of ``seq_id``; ``ValueError`` naming the id if it is not held."""
        if not self.has_sequence(seq_id):
            raise ValueError(f"unknown sequence {seq_id!r}")
        return self._tables[seq_id]

    def __repr__(self) -> str:
        return (
            f"KVCacheManager(num_blocks={self.num_blocks}, block_size={self.block_size}, "
            f"sequences={len(self._tables)}, free_blocks={self.num_free_blocks})"
        )
