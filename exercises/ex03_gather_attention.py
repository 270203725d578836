# Your exercises for lesson 3: replace each `raise NotImplementedError(...)`.
# The lesson notebook's check cells (or `make test-exercises EX=ex03`) test this file.
# Generated from solutions/ex03_gather_attention.py by tools/make_exercises.py.
"""Lesson 03: decode attention over a paged KV cache, the naive way (gather, then attend).

Three steps, one exercise each, then a given function that chains them:

* Ex 3.1 :func:`padded_slots`     logical token position -> physical slot, for a whole batch
* Ex 3.2 :func:`gather_slots`     copy every cached token's K and V into contiguous tensors
* Ex 3.3 :func:`masked_attention` decode attention over those tensors, masking padding
* given  :func:`paged_attention_gather` = 3.1 + 3.2 + 3.3

Layout (as everywhere in the course):

    q                [B, Hq, D]                   one new token per sequence
    k_cache, v_cache [num_blocks, block_size, Hkv, D]
    block_tables     [B, max_blocks] int32        token t of sequence b lives in block
                                                  block_tables[b, t // block_size],
                                                  offset t % block_size
    seq_lens         [B] int32                    entries past ceil(seq_lens[b] / block_size)
                                                  hold garbage (-1, huge values): never use them
"""

from __future__ import annotations

import torch


def padded_slots(
    block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int, block_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 3.1: the physical slot of every logical token position, for a whole batch.

    ``paged_ref.cache_math.token_slots(block_table, seq_len, block_size)`` (lesson 02) does one
    sequence as a Python list; this is the same for every row of a batch at once, as tensors,
    padded to ``max_len`` columns.

    Args:
        block_tables: [B, max_blocks] int32; row b lists sequence b's blocks in order. Entries
            past the blocks a sequence uses hold garbage (-1, 2**31 - 1, ...).
        seq_lens: [B] int32, each ``<= max_blocks * block_size``.
        max_len: positions to produce per row, ``max(seq_lens) <= max_len <=
            max_blocks * block_size``.
        block_size: tokens per block.

    Returns:
        slots: [B, max_len] int64. For ``t < seq_lens[b]``:
            ``block_tables[b, t // block_size] * block_size + t % block_size``; 0 elsewhere.
        valid: [B, max_len] bool, ``t < seq_lens[b]``.

    Example (block_size 4)::

        block_tables = [[7, 2, -1],      seq_lens = [6, 3], max_len = 6
                        [5, -1, 99999]]
        slots = [[28, 29, 30, 31, 8, 9],     # tokens 0-3 in block 7, tokens 4-5 in block 2
                 [20, 21, 22,  0, 0, 0]]     # tokens 0-2 in block 5, then padding
        valid = [[T, T, T, T, T, T],
                 [T, T, T, F, F, F]]

    Hints:
        * ``pos = torch.arange(max_len)``; ``pos // block_size`` picks the table column,
          ``pos % block_size`` the offset; index the table with the columns for all rows at once.
        * Convert the table to int64 *before* multiplying: ``2**31 - 1`` times 16 overflows int32.
        * Replace the block of invalid positions by 0 (``torch.where``) before you use it, so no
          garbage entry turns into a slot.
        * Build everything on ``block_tables.device``.
    """
    raise NotImplementedError("Exercise 3.1: padded_slots")


def gather_slots(
    k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 3.2: copy each slot's K and V into contiguous tensors.

    Args:
        k_cache, v_cache: [num_blocks, block_size, Hkv, D].
        slots: [B, L] int64 slots in ``[0, num_blocks * block_size)`` (from :func:`padded_slots`).

    Returns:
        k, v: [B, L, Hkv, D] in the cache's dtype, ``k[b, t] = k_cache_flat[slots[b, t]]`` where
        ``k_cache_flat = k_cache`` viewed as ``[num_blocks * block_size, Hkv, D]`` (one row per
        slot). These are copies: this step writes every cached token a second time.

    Example: with block_size 4, slot 9 is block 2, offset 1, so
    ``k[b, t] = k_cache[2, 1]`` wherever ``slots[b, t] == 9``.

    Hints:
        * ``k_cache.flatten(0, 1)`` (or ``.view(-1, Hkv, D)``) turns blocks into slots.
        * Indexing a tensor with an integer tensor of shape [B, L] returns [B, L, ...].
    """
    raise NotImplementedError("Exercise 3.2: gather_slots")


def masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float
) -> torch.Tensor:
    """Exercise 3.3: decode attention over contiguous K/V, ignoring invalid positions.

    Args:
        q: [B, Hq, D]. k, v: [B, L, Hkv, D], ``Hq % Hkv == 0``. valid: [B, L] bool.
        scale: multiplies the scores (``D ** -0.5`` by default in the callers).

    Returns:
        [B, Hq, D] in q's dtype::

            out[b, h] = sum_t softmax_t(scale * q[b, h] . k[b, t, h // G]) * v[b, t, h // G]

        over valid t only, where ``G = Hq // Hkv`` (query heads h*G .. h*G+G-1 share KV head h:
        grouped-query attention). Rows with no valid position are zeros, never NaN.

    Invalid positions may hold anything, NaN included (padding and the unwritten end of a
    sequence's last block): they must not reach the output.

    Example: B = 1, Hq = 2, Hkv = 1, D = 1, L = 3, scale = 1, q = [[[1.], [0.]]],
    k[0, :, 0, 0] = [0., ln 3, nan], v[0, :, 0, 0] = [4., 8., nan], valid = [[T, T, F]]:
    head 0 weights softmax([0, ln 3]) = [1/4, 3/4] -> 7.0; head 1 weights [1/2, 1/2] -> 6.0.

    Hints:
        * Compute in float32 (``q.float()`` ...) and cast back at the end.
        * GQA without copying K: view q as [B, Hkv, G, D]; ``torch.einsum("bhgd,bthd->bhgt")``.
        * Scores of invalid positions -> ``-inf`` (``masked_fill``) before the softmax.
        * ``0 * nan`` is nan: also zero v at invalid positions (``torch.where``), or the NaN
          leaks through the weighted sum even with weight 0.
        * The softmax of an all ``-inf`` row is NaN: set such rows' weights to 0.
    """
    raise NotImplementedError("Exercise 3.3: masked_attention")


def paged_attention_gather(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """Given (not an exercise): paged decode attention = 3.1 + 3.2 + 3.3.

    Same contract as ``paged_ref.paged_attention(..., backend="torch")`` for valid inputs:
    returns [B, Hq, D] in q's dtype; ``scale`` defaults to ``head_dim ** -0.5``.
    """
    block_size, head_dim = k_cache.shape[1], k_cache.shape[3]
    scale = head_dim**-0.5 if scale is None else scale
    max_len = int(seq_lens.max()) if seq_lens.numel() else 0
    slots, valid = padded_slots(block_tables, seq_lens, max_len, block_size)
    k, v = gather_slots(k_cache, v_cache, slots)
    return masked_attention(q, k, v, valid, scale)
