"""Lesson 04: a Triton kernel that reads the paged KV cache in place (one pass, online softmax).

Three exercises (after the three warm-ups of ``ex04_warmups.py``), then a given wrapper that
launches the kernel:

* Ex 4.1 :func:`online_softmax_update` one step of the online softmax, in plain torch
* Ex 4.2 :func:`load_kv_tile`          (Triton) gather one tile of K or V rows through the
                                       block table
* Ex 4.3 :func:`attend_sequence`       (Triton) the block loop: walk one sequence tile by tile,
                                       fold each tile into the online softmax, normalise
* given  :func:`one_pass_decode_kernel` prologue (program ids, queries) + 4.3 + epilogue (store)
* given  :func:`paged_decode`          the Python wrapper: grid (batch, num_kv_heads)
* given  :func:`gather_kv_tile`        runs 4.2 alone on one tile, to look at (and test) it

One program per (sequence b, KV head h). It loads the queries of the GROUP query heads that
read KV head h (grouped-query attention), then walks the sequence TILE tokens at a time: it
looks each token's block up in the block table, loads those K rows straight from the paged
cache, scores them for the whole group at once, and folds them into a running softmax
(max ``m``, sum ``l``, weighted sum ``acc``). Every K/V byte is read once; nothing is copied.

Layout (as everywhere in the course):

    q                [B, Hq, D]
    k_cache, v_cache [num_blocks, block_size, Hkv, D]   contiguous
    block_tables     [B, max_blocks] int32   token t of sequence b: block block_tables[b,
                                             t // block_size], offset t % block_size
    seq_lens         [B] int32               table entries past a sequence's blocks: garbage
"""

# ruff: noqa: E741  (m, l, acc: the running max, sum and output, as in the FlashAttention papers)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_ref import _device

# ---- Exercise 4.1: the online softmax, in plain torch ------------------------------------------


def online_softmax_update(
    m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Exercise 4.1: fold one tile of T tokens into the running softmax of G query heads.

    Args (all float32):
        m:      [G] running max of the scores seen so far (``-inf`` before the first tile).
        l:      [G] running sum of ``exp(score - m)`` over the tokens seen so far (0 at first).
        acc:    [G, D] running ``sum_t exp(score_t - m) * v_t``, *not* normalised (0 at first).
        scores: [G, T] this tile's scores (already scaled); ``-inf`` marks a masked token.
        v:      [T, D] this tile's values (rows of masked tokens are 0).

    Returns:
        New ``(m, l, acc)``, same shapes, as if the tile's tokens had been part of the sequence
        from the start. After the last tile the attention output is ``acc / l[:, None]``. Do not
        modify the arguments in place.

    A row whose scores are all ``-inf`` and whose ``m`` is still ``-inf`` (nothing seen yet)
    must stay ``(-inf, 0, 0)``: no NaN.

    Example (G = 1, D = 1)::

        m, l, acc = [-inf], [0.], [[0.]]
        tile 1: scores [[0., ln 3]], v [[4.], [8.]]
          -> m = [ln 3], l = [1/3 + 1] = [4/3], acc = [[4/3 + 8]] = [[28/3]]
        tile 2: scores [[ln 3]], v [[2.]]          (the max does not change)
          -> m = [ln 3], l = [7/3], acc = [[34/3]];  acc / l = [[34/7]]
        (= softmax([0, ln 3, ln 3]) @ [4, 8, 2] = (4 + 24 + 6) / 7)

    Hints:
        * The notebook's derivation: what you have so far was weighted relative to the old
          max; once the max grows, rescale it to the new one, then add the tile's own weights
          (relative to the new max too).
        * ``exp(-inf - (-inf))`` is NaN: where ``m_new`` is ``-inf``, subtract 0 instead
          (``torch.where``); then ``exp(-inf - 0) = 0`` and nothing changes.
    """
    # BEGIN SOLUTION
    m_new = torch.maximum(m, scores.max(dim=1).values)
    m_safe = torch.where(m_new == float("-inf"), 0.0, m_new)  # rows that have seen nothing
    alpha = torch.exp(m - m_safe)  # [G]: rescales what we had
    p = torch.exp(scores - m_safe[:, None])  # [G, T]: this tile's weights
    l_new = l * alpha + p.sum(dim=1)
    acc_new = acc * alpha[:, None] + p @ v
    return m_new, l_new, acc_new
    # END SOLUTION


# ---- Exercise 4.2: one tile of K or V through the block table (Triton) -------------------------


@triton.jit
def load_kv_tile(
    cache_ptr,  # k_cache or v_cache: [num_blocks, block_size, Hkv, D], contiguous
    table_row_ptr,  # block_tables[b]: this sequence's row of the block table (int32)
    tok,  # [TILE] logical token positions
    t_mask,  # [TILE] bool: tok < seq_len
    kv_head,  # which KV head
    stride_block,  # cache strides in elements: block, token-in-block, head
    stride_tok,
    stride_head,
    offs_d,  # [HEAD_DIM_PAD] = tl.arange(0, HEAD_DIM_PAD)
    d_mask,  # [HEAD_DIM_PAD] bool: offs_d < HEAD_DIM
    BLOCK_SIZE: tl.constexpr,
):
    """Exercise 4.2: gather TILE rows of K (or V) of one KV head through the block table.

    Returns a [TILE, HEAD_DIM_PAD] tile in the cache's dtype with

        tile[i, d] = cache[block_tables[b, tok[i] // BLOCK_SIZE], tok[i] % BLOCK_SIZE, kv_head, d]

    where ``t_mask[i] and d_mask[d]``, and 0 everywhere else (masked tokens, padded columns).
    ``cache_ptr`` points at element ``[0, 0, 0, 0]``; the strides are in elements.

    Example (BLOCK_SIZE 4, block_tables[b] = [7, 2, -1], seq_len 6, TILE 4, tok = [4, 5, 6, 7]):
    tokens 4 and 5 are block 2, offsets 0 and 1 -> rows ``cache[2, 0, h]``, ``cache[2, 1, h]``;
    tokens 6 and 7 are past the end -> zero rows (and the table entry -1 is never followed).

    It is the primer's gather (a load whose address comes from another load), with a tile of
    tokens instead of one row: first the block ids, then the rows they point at.

    Traps (each has a check):
        * Masked tokens must not read the table: past a sequence's end the row holds garbage
          (-1, huge ids), and a tile can run past the end of the row itself, into memory that is
          not the table at all.
        * Element offsets need 64 bits. A 16-token block of 8 heads x 128 dims is 16384
          elements, so block 131072 already starts past 2**31: an int32 product wraps around
          to a wrong (often negative) address. Block ids load as int32.
        * Padded columns (``d >= HEAD_DIM``) would read the next head's values: mask them too.

    Hints: ``tl.load(ptrs, mask=..., other=...)``; ``x[:, None]`` and ``y[None, :]`` broadcast
    two vectors into a [TILE, HEAD_DIM_PAD] block of offsets (and of masks);
    ``x.to(tl.int64)``.
    """
    # BEGIN SOLUTION
    block = tl.load(table_row_ptr + tok // BLOCK_SIZE, mask=t_mask, other=0)  # [TILE] int32
    rows = (block.to(tl.int64) * stride_block + (tok % BLOCK_SIZE) * stride_tok
            + kv_head * stride_head)  # [TILE] int64 element offsets
    mask = t_mask[:, None] & d_mask[None, :]
    return tl.load(cache_ptr + rows[:, None] + offs_d[None, :], mask=mask, other=0.0)
    # END SOLUTION


# ---- Exercise 4.3: the block loop with the online softmax (Triton) -----------------------------


@triton.jit
def attend_sequence(
    q,  # [GROUP_PAD, HEAD_DIM_PAD] the group's queries (rows >= GROUP and padded columns are 0)
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,  # block_tables[b]
    seq_len,  # tokens in this sequence (may be 0)
    kv_head,
    scale,  # softmax scale (float)
    stride_block,
    stride_tok,
    stride_head,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Exercise 4.3: attention of one GQA group over one whole sequence, tile by tile.

    Returns out [GROUP_PAD, HEAD_DIM_PAD] float32, normalised:
    ``out[g] = sum_t softmax_t(scale * q[g] . k_t) * v_t`` over tokens ``0 <= t < seq_len``
    (K and V rows of KV head ``kv_head``, through the block table); all zeros when
    ``seq_len == 0`` (never NaN). Padded rows and columns of ``out`` may hold anything finite.

    Walk the sequence TILE tokens at a time, loading each tile's K and V once with your Ex 4.2
    (``offs_d``/``d_mask`` are yours to build), and fold the tile into the online softmax of
    Ex 4.1: its state ``m``, ``l``, ``acc`` lives in float32 across loop steps.

    Example: seq_len 37, TILE 32: two loop steps, tokens 0..31 and 32..63; in the second,
    tokens 37..63 are masked and must get weight 0.

    Hints:
        * ``tl.full``/``tl.zeros`` make the initial state (give the dtype); ``tl.dot(a, b,
          input_precision=DOT_PRECISION)`` scores the whole group against a tile (``tl.trans``);
          ``tl.max``/``tl.sum`` reduce along an ``axis``; ``tl.where`` masks; ``tl.exp``.
        * Every loop step holds at least one real token (the loop stops at seq_len), so the
          running max is finite after the first step: Ex 4.1's ``-inf`` guard is not needed
          inside the loop, but an empty sequence never enters it.
        * ``tl.dot`` needs at least 16 rows and columns: that is why the group is padded to
          GROUP_PAD >= 16 rows (zero queries) and TILE >= 16. Cast the tiles (and the weights)
          to ``q.dtype`` before ``tl.dot``: it matters only in Triton's CPU interpreter, where
          q is upcast to float32 for bfloat16 (its bf16 dot is broken); on a GPU, q is
          already the cache's dtype.
    """
    # BEGIN SOLUTION
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    for t0 in range(0, seq_len, TILE):
        tok = t0 + tl.arange(0, TILE)
        t_mask = tok < seq_len
        k = load_kv_tile(k_cache_ptr, table_row_ptr, tok, t_mask, kv_head, stride_block,
                         stride_tok, stride_head, offs_d, d_mask, BLOCK_SIZE).to(q.dtype)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale
        scores = tl.where(t_mask[None, :], scores, float("-inf"))  # [GROUP_PAD, TILE]
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(scores - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = load_kv_tile(v_cache_ptr, table_row_ptr, tok, t_mask, kv_head, stride_block,
                         stride_tok, stride_head, offs_d, d_mask, BLOCK_SIZE).to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    return acc / tl.where(l > 0, l, 1.0)[:, None]
    # END SOLUTION


# ---- Given: the kernel around Ex 4.3, and its launcher ------------------------------------------


@triton.jit
def one_pass_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, scale,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt, stride_block, stride_tok, stride_head,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
):
    """Given. Grid (batch, num_kv_heads): out[b, query heads of kv_head] for one sequence."""
    # Prologue: who am I, how long is my sequence, where is its block-table row?
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    table_row_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt
    # The queries of the GROUP heads that read kv_head: rows kv_head*GROUP ... +GROUP-1 of q[b],
    # padded with zero rows to GROUP_PAD (tl.dot's minimum of 16) and zero columns to
    # HEAD_DIM_PAD (tl.arange needs a power of two).
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + offs_g
    mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask, other=0.0)
    if DOT_UPCAST:  # Triton's CPU interpreter only: its bfloat16 tl.dot gives garbage
        q = q.to(tl.float32)
    out = attend_sequence(q, k_cache_ptr, v_cache_ptr, table_row_ptr, seq_len, kv_head, scale,
                          stride_block, stride_tok, stride_head, BLOCK_SIZE, HEAD_DIM,
                          HEAD_DIM_PAD, GROUP_PAD, TILE, DOT_PRECISION)
    # Epilogue: the real rows and columns only, in the output's dtype.
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float | None = None,
    tile: int = 32,
) -> torch.Tensor:
    """Given: launch :func:`one_pass_decode_kernel` on grid (batch, num_kv_heads).

    Same contract as ``paged_ref.paged_attention(..., backend="triton")`` for valid inputs
    (no input checks here): returns [B, Hq, D] in q's dtype; ``scale`` defaults to
    ``D ** -0.5``. ``tile`` (tokens per loop step) must be a power of two >= 16.
    """
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    if batch == 0:
        return out
    upcast = _device.INTERPRET and q.dtype == torch.bfloat16
    one_pass_decode_kernel[(batch, num_kv_heads)](
        out, q, k_cache, v_cache, block_tables, seq_lens,
        head_dim**-0.5 if scale is None else float(scale),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), TILE=tile,
        # float32: exact products ("ieee"); the default tf32 keeps ~10 bits and misses 1e-5
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        DOT_UPCAST=upcast,
    )
    return out


# ---- Given: Ex 4.2 on its own, to look at one tile ----------------------------------------------


@triton.jit
def _gather_tile_kernel(
    out_ptr, cache_ptr, table_row_ptr, seq_len, kv_head, start,
    stride_block, stride_tok, stride_head,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    TILE: tl.constexpr,
):
    tok = start + tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    tile = load_kv_tile(cache_ptr, table_row_ptr, tok, tok < seq_len, kv_head, stride_block,
                        stride_tok, stride_head, offs_d, offs_d < HEAD_DIM, BLOCK_SIZE)
    offs_t = tl.arange(0, TILE)
    tl.store(out_ptr + offs_t[:, None] * HEAD_DIM_PAD + offs_d[None, :], tile)


def gather_kv_tile(
    cache: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor, b: int,
    kv_head: int, start: int, tile: int = 16,
) -> torch.Tensor:
    """Given: what :func:`load_kv_tile` returns for tokens ``start .. start + tile - 1`` of
    sequence ``b`` and KV head ``kv_head``: a [tile, HEAD_DIM_PAD] tensor in the cache's dtype
    (one program; the whole padded tile is stored, so you can see the zeros)."""
    head_dim = cache.shape[3]
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    out = torch.full((tile, head_dim_pad), float("nan"), dtype=cache.dtype, device=cache.device)
    _gather_tile_kernel[(1,)](
        out, cache, block_tables[b], int(seq_lens[b]), kv_head, start,
        cache.stride(0), cache.stride(1), cache.stride(2),
        BLOCK_SIZE=cache.shape[1], HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, TILE=tile,
    )
    return out
