"""Block tables: which blocks each sequence holds, and where its tokens' K/V live.

:class:`BlockTables` is the reading half of :class:`~paged_ref.KVCacheManager`: one table and
one length per sequence over a :class:`~paged_ref.BlockAllocator`'s pool, and what attention
and the K/V writes need from them (slot mappings, padded ``block_tables`` tensors). It never
changes a table; the manager (:mod:`.manager`) takes and releases blocks.

Token ``t`` of a sequence lives in block ``table[t // block_size]`` at offset
``t % block_size``; its *slot* (its row in the cache flattened to
``[num_blocks * block_size, ...]``) is ``table[t // block_size] * block_size + t % block_size``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Hashable, Iterable

import numpy as np
import torch

from paged_ref.cache_math import blocks_needed, token_slots
from paged_ref.memory.allocator import BlockAllocator, OutOfBlocksError, check_int
from paged_ref.memory.prefix_cache import check_tokens


class BlockTables:
    """Tables of the sequences held in a pool of ``num_blocks`` blocks of ``block_size``
    tokens (``on_evict``: the allocator's callback, see :class:`~paged_ref.BlockAllocator`)."""

    def __init__(self, num_blocks: int, block_size: int, *,
                 on_evict: Callable[[int, bytes], None] | None = None) -> None:
        self._allocator = BlockAllocator(num_blocks, block_size, on_evict=on_evict)
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
        """Blocks no sequence holds: plain free + evictable (cached, held by nobody)."""
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

    # ---- reading state ----------------------------------------------------------------------

    def block_table(self, seq_id: Hashable) -> list[int]:
        """Physical block ids of ``seq_id``, in logical order (a copy)."""
        return list(self._table(seq_id))

    def last_block(self, seq_id: Hashable) -> int:
        """The last block of ``seq_id`` (``block_table(seq_id)[-1]`` without the copy)."""
        return self._table(seq_id)[-1]

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

    # ---- helpers ----------------------------------------------------------------------------

    def _check_new_id(self, name: str, seq_id: Hashable) -> None:
        """``TypeError`` if ``seq_id`` is unhashable, ``ValueError`` if it is already held."""
        try:
            hash(seq_id)
        except TypeError:
            raise TypeError(
                f"{name} must be hashable (an int or a str), got {type(seq_id).__name__}"
            ) from None
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id!r} already exists")

    def _check_fit(self, seq_id: Hashable, num_tokens: int,
                   hit: list[int | None]) -> tuple[list[int], int]:
        """A new sequence of ``num_tokens`` whose prefix-cache hit is ``hit`` (device blocks, or
        None: back from a tier below): ``(the device blocks it shares, the fresh blocks it
        takes)``; ``OutOfBlocksError`` if those are not free (an evictable hit is not free)."""
        shared = [b for b in hit if b is not None]
        fresh = blocks_needed(num_tokens, self.block_size) - len(shared)
        available = self.num_free_blocks - sum(self._allocator.is_evictable(b) for b in shared)
        if fresh > available:
            cached = f" ({len(hit) * self.block_size} cached)" if hit else ""
            raise OutOfBlocksError(
                f"sequence {seq_id!r} needs {fresh} blocks for {num_tokens} tokens{cached} "
                f"but only {available} of {self.num_blocks} are free")
        return shared, fresh

    def _check_step(self, seq_ids: Iterable[Hashable], token_ids,
                    ref_count: Callable[[int], int]) -> tuple[list[Hashable], list]:
        """``append_slots``' arguments, checked: ``(seq_ids, token_ids)`` as lists (one token id
        or None per sequence). ``ValueError`` for an unknown or repeated id or ``token_ids`` of
        another length, ``OutOfBlocksError`` when the step needs more new blocks than are free
        (``ref_count(block)``: how many sequences hold a block)."""
        seq_ids = list(seq_ids)
        for seq_id in seq_ids:
            self._table(seq_id)
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"seq_ids repeats an id: {seq_ids!r}")
        if token_ids is None:
            token_ids = [None] * len(seq_ids)
        else:
            token_ids = check_tokens(token_ids)
            if len(token_ids) != len(seq_ids):
                raise ValueError(
                    f"token_ids has {len(token_ids)} ids for {len(seq_ids)} sequences")
        needed = self._blocks_for_step(seq_ids, ref_count)
        if needed > self.num_free_blocks:
            raise OutOfBlocksError(
                f"this step needs {needed} new blocks but only {self.num_free_blocks} "
                f"of {self.num_blocks} are free")
        return seq_ids, token_ids

    def _blocks_for_step(self, seq_ids: list[Hashable], ref_count: Callable[[int], int]) -> int:
        """New blocks one decode step of ``seq_ids`` takes: one per sequence at a block
        boundary, plus the copy-on-writes (``c`` writers into a block ``r`` sequences hold
        copy ``min(c, r - 1)`` times: the last holder writes in place; ``ref_count(block)``:
        how many sequences hold a block)."""
        writers: Counter[int] = Counter()
        needed = 0
        for seq_id in seq_ids:
            table, j = self._tables[seq_id], self._lens[seq_id] // self.block_size
            if j == len(table):  # (else its block is there: part filled, or a lookahead one)
                needed += 1
            else:
                writers[table[j]] += 1
        for block_id, count in writers.items():
            needed += min(count, ref_count(block_id) - 1)
        return needed

    def _check_lookahead(self, seq_ids: list[Hashable], num_tokens: list[int],
                         ref_count: Callable[[int], int], taken: bool = False) -> list[int]:
        """The new blocks each of ``seq_ids`` needs for its next ``num_tokens`` tokens
        (``lookahead``'s; ``taken``: none may be needed, ``extend``'s). ``ValueError`` for an
        unknown id, a bad count, or a next token in a shared block; ``OutOfBlocksError``."""
        if len(seq_ids) != len(num_tokens) or len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"need distinct seq_ids and one count each, got {seq_ids!r} and "
                             f"num_tokens={num_tokens!r}")
        bs, need = self.block_size, []
        for seq_id, n in zip(seq_ids, num_tokens, strict=True):
            table, length = self._table(seq_id), self._lens[seq_id]
            n = check_int("num_tokens", n)
            if n and length % bs and ref_count(table[length // bs]) > 1:
                raise ValueError(f"sequence {seq_id!r}: its next token goes into block "
                                 f"{table[length // bs]}, which is shared (append_slot first)")
            need.append(max(0, blocks_needed(length + n, bs) - len(table)))
            if taken and need[-1]:
                raise ValueError(f"sequence {seq_id!r} holds {len(table)} blocks: {n} more "
                                 f"tokens after its {length} need {need[-1]} more (lookahead)")
        if sum(need) > self.num_free_blocks:
            raise OutOfBlocksError(f"the lookahead needs {sum(need)} new blocks but only "
                                   f"{self.num_free_blocks} of {self.num_blocks} are free")
        return need

    def _table(self, seq_id: Hashable) -> list[int]:
        """The live table of ``seq_id``; ``ValueError`` naming the id if it is not held."""
        if not self.has_sequence(seq_id):
            raise ValueError(f"unknown sequence {seq_id!r}")
        return self._tables[seq_id]


def padded_tables(block_tables: list[list[int]], rows: int) -> torch.Tensor:
    """Block tables (lists of block ids) as one int32 CPU tensor ``[rows, longest]``: short
    rows and the rows past ``len(block_tables)`` (a CUDA graph's padding) hold 0, never read
    (their lengths stop the kernels first)."""
    out = np.zeros((rows, max(1, max(len(t) for t in block_tables))), dtype=np.int32)
    for row, table in enumerate(block_tables):
        out[row, :len(table)] = table
    return torch.from_numpy(out)


def pass_inputs(block_tables: list[list[int]], positions: list[int], steps: list[int],
                block_size: int, scratch_slot: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A multi-step decode's passes (``Engine(num_scheduler_steps=...)``): sequence ``b``'s
    first token at ``positions[b]``, its ``steps[b]`` tokens in blocks its table holds
    already (``KVCacheManager.lookahead``). Returns positions, slots and lengths, int64
    ``[max(steps), B]``; in the passes past its own, a sequence repeats its last position and
    writes to ``scratch_slot`` (a block no sequence holds)."""
    steps_b = np.array(steps)
    passes = np.arange(steps_b.max())[:, None]
    pos = np.array(positions) + np.minimum(passes, steps_b - 1)
    tables = padded_tables(block_tables, len(block_tables)).numpy().astype(np.int64)
    slots = np.take_along_axis(tables, pos.T // block_size, axis=1).T * block_size
    return pos, np.where(passes < steps_b, slots + pos % block_size, scratch_slot), pos + 1
