# Your exercises for lesson 8: replace each `raise NotImplementedError(...)`.
# The lesson notebook's check cells (or `make test-exercises EX=ex08`) test this file.
# Generated from solutions/ex08_prefill.py by tools/make_exercises.py.
"""Lesson 08: prefill over the paged cache -- many query tokens per sequence.

Four exercises, then a given kernel and wrapper that use them:

* Ex 8.1 :func:`causal_offset_mask`       which keys each query row may see (plain torch)
* Ex 8.2 :func:`prefill_one_sequence`     attention of one sequence's query rows over its
                                          gathered K/V, with GQA (plain torch)
* Ex 8.3 :func:`tile_key_ranges`          (Triton) for one tile of query rows: where the keys
                                          that every row sees end, and where all keys end
* Ex 8.4 :func:`attend_key_range`         (Triton) the key loop: load K/V tiles through the
                                          block table, mask when asked, online softmax
* given  :func:`prefill_kernel`           one tile of BLOCK_Q query tokens x GROUP heads
* given  :func:`paged_prefill_tiles`          the wrapper: grid (query tiles, KV heads, sequences)

The queries of sequence ``b`` are its LAST ``q_len`` tokens (their K/V already in the cache):
query row ``i`` is token ``p = seq_len - q_len + i`` and, causally, sees keys ``0 .. p``.

    q                [total_query_tokens, Hq, D]    rows of all sequences, one after another
    query_start_loc  [batch + 1] int32              sequence b owns rows [qsl[b], qsl[b + 1])
    k_cache, v_cache [num_blocks, block_size, Hkv, D]
    block_tables     [batch, max_blocks] int32;  seq_lens [batch] int32
"""

# ruff: noqa: E741  (m, l, acc: the running max, sum and output, as in the FlashAttention papers)

from __future__ import annotations

import torch
import triton
import triton.language as tl

from paged_ref import _device

# ---- Exercise 8.1: the causal mask with an offset (plain torch) ---------------------------------


def causal_offset_mask(seq_len: int, q_len: int) -> torch.Tensor:
    """Exercise 8.1: which cache positions each query row may attend to.

    The ``q_len`` query rows are the last tokens of a sequence of ``seq_len`` tokens (a cached
    prefix of ``seq_len - q_len`` tokens comes first). Returns a bool tensor [q_len, seq_len]:
    ``mask[i, j]`` is True when row ``i`` (token ``seq_len - q_len + i``) sees key ``j``, i.e.
    ``j <= seq_len - q_len + i``.

    Example (seq_len 5, q_len 2: 3 cached tokens, then the 2 queries)::

        [[T, T, T, T, F],     row 0 is token 3: keys 0..3
         [T, T, T, T, T]]     row 1 is token 4: keys 0..4

    With ``q_len == seq_len`` it is the usual lower-triangular mask; with ``q_len == 1`` (a
    decode step) the one row sees everything. ``q_len == 0`` gives shape [0, seq_len].

    Hint: compare ``torch.arange(seq_len)[None, :]`` with a column of positions.
    """
    raise NotImplementedError("Exercise 8.1: causal_offset_mask")


# ---- Exercise 8.2: one sequence, gathered K/V, GQA (plain torch) --------------------------------


def prefill_one_sequence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                         scale: float, causal: bool = True) -> torch.Tensor:
    """Exercise 8.2: attention of one sequence's query rows over all its cached tokens.

    Args:
        q: [q_len, Hq, D], the sequence's last q_len tokens.
        k, v: [seq_len, Hkv, D], every cached token in order (gathered through the block
            table), the queries' own tokens included. ``Hq`` is a multiple of ``Hkv``.
        scale: the softmax scale.
        causal: True: row i sees keys 0 .. seq_len - q_len + i (Ex 8.1); False: all keys.

    Returns [q_len, Hq, D] float32 (compute in float32 whatever the input dtype).

    Grouped-query attention: query heads ``h`` with the same ``h // (Hq // Hkv)`` share one KV
    head (heads 0-3 read KV head 0 when Hq = 8, Hkv = 2). Masked scores are ``-inf`` before
    the softmax; every row sees at least its own token, so no row is all ``-inf``.

    Hint: ``k.repeat_interleave(Hq // Hkv, dim=1)`` lines KV heads up with query heads;
    ``torch.einsum("qhd,khd->hqk", ...)`` gives the scores [Hq, q_len, seq_len].
    """
    raise NotImplementedError("Exercise 8.2: prefill_one_sequence")


# ---- Exercise 8.3: the causal diagonal, per tile (Triton) ---------------------------------------


@triton.jit
def tile_key_ranges(first_pos, last_pos, seq_len, CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Exercise 8.3: split the keys of one tile of query rows into two ranges.

    The tile's rows are tokens ``first_pos .. last_pos`` of a sequence of ``seq_len`` tokens
    (``0 <= first_pos <= last_pos < seq_len``). Keys are processed ``BLOCK_N`` at a time from 0.
    Return ``(full_end, kv_end)``:

    * ``full_end``: a multiple of ``BLOCK_N``; the key tiles ``[0, full_end)`` are seen by
      EVERY row of the tile, so the kernel runs them with no mask at all. Make it as large as
      possible: causal, every row sees keys ``0 .. first_pos``, so the largest multiple of
      ``BLOCK_N`` that is ``<= first_pos + 1``; not causal, the largest multiple of ``BLOCK_N``
      that is ``<= seq_len``.
    * ``kv_end``: one past the last key any row sees: ``last_pos + 1`` when causal, else
      ``seq_len``. Key tiles from ``full_end`` up to ``kv_end`` are run with the mask; tiles
      past ``kv_end`` are fully masked and are never loaded.

    Example (BLOCK_N 16, causal, rows are tokens 40..47 of 100): every row sees keys 0..40, so
    ``full_end = 32`` (tiles 0-15 and 16-31), ``kv_end = 48``: the masked tiles are 32-47.
    """
    raise NotImplementedError("Exercise 8.3: tile_key_ranges")


# ---- Exercise 8.4: the key loop (Triton) --------------------------------------------------------


@triton.jit
def attend_key_range(
    acc, m, l,  # running state: [BLOCK_M, HEAD_DIM_PAD] fp32, [BLOCK_M] (log2 units), [BLOCK_M]
    q,  # [BLOCK_M, HEAD_DIM_PAD]: the tile's query rows (padded rows and columns are 0)
    pos,  # [BLOCK_M] int: each row's token position in the sequence
    k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head,
    start, end, seq_len,  # keys [start, end) of a sequence of seq_len tokens
    qk_scale,  # softmax scale * log2(e): scores are in base 2 (tl.exp2)
    stride_block, stride_tok, stride_head,
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Exercise 8.4: fold keys ``[start, end)``, ``BLOCK_N`` at a time, into the online softmax.

    Returns the new ``(acc, m, l)``. Per key tile (lesson 04's loop, many query rows at once):

        key    = k0 + tl.arange(0, BLOCK_N);  key_ok = key < seq_len
        block  = tl.load(table_row_ptr + key // BLOCK_SIZE, mask=key_ok, other=0)
        row    = block.to(tl.int64) * stride_block + (key % BLOCK_SIZE) * stride_tok
                 + kv_head * stride_head                                          [BLOCK_N]
        k      = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :],
                         mask=key_ok[:, None] & d_mask[None, :], other=0.0).to(q.dtype)
        s      = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  [BLOCK_M, N]
        if MASKED: s = -1.0e30 where the key is past seq_len, or (CAUSAL) past the row's pos
        m_new  = max(m, row max of s);  alpha = exp2(m - m_new);  p = exp2(s - m_new[:, None])
        l      = l * alpha + row sum of p
        v      = (as k, from v_cache_ptr)
        acc    = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision=DOT_PRECISION)
        m      = m_new

    ``MASKED`` is a compile-time flag: the kernel calls this twice, first for the keys every
    row sees (``MASKED=False``: no mask to build), then for the diagonal band and the last
    partial key tile (``MASKED=True``). Use ``-1.0e30``, not ``-inf``, for masked scores: a row
    that sees no key of a tile then gets a finite ``m`` and never NaN (``exp2(-inf + inf)``).
    """
    raise NotImplementedError("Exercise 8.4: attend_key_range")


# ---- Given: the kernel around Ex 8.3 and 8.4, and its launcher ----------------------------------


@triton.jit
def prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, qk_scale, num_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_block, stride_tok,
    stride_head,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    """Given. Grid (num_tiles, num_kv_heads, batch): one tile = BLOCK_Q query tokens x the GROUP
    query heads of one KV head (row r is token r // GROUP, head r % GROUP)."""
    tile = num_tiles - 1 - tl.program_id(0)  # the last tiles have the most keys: start them first
    kv_head = tl.program_id(1)
    b = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = tile * BLOCK_Q + offs_m // GROUP  # which query token of the sequence
    head = kv_head * GROUP + offs_m % GROUP  # which query head
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    pos = seq_len - q_len + q_idx  # the causal offset
    rows = (q_start + q_idx).to(tl.int64)
    mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=mask, other=0.0)
    if DOT_UPCAST:  # Triton's CPU interpreter only: its bfloat16 / float16 tl.dot
        q = q.to(tl.float32)
    first_pos = seq_len - q_len + tile * BLOCK_Q
    last_pos = seq_len - q_len + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len) - 1
    full_end, kv_end = tile_key_ranges(first_pos, last_pos, seq_len, CAUSAL, BLOCK_N)
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row_ptr = block_tables_ptr + b.to(tl.int64) * stride_bt
    acc, m, l = attend_key_range(
        acc, m, l, q, pos, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, 0, full_end,
        seq_len, qk_scale, stride_block, stride_tok, stride_head, False, CAUSAL, BLOCK_SIZE,
        BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, DOT_PRECISION)
    acc, m, l = attend_key_range(
        acc, m, l, q, pos, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, full_end, kv_end,
        seq_len, qk_scale, stride_block, stride_tok, stride_head, True, CAUSAL, BLOCK_SIZE,
        BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, DOT_PRECISION)
    out = acc / l[:, None]
    tl.store(out_ptr + rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask)


def paged_prefill_tiles(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                  scale: float | None = None, causal: bool = True, block_m: int = 32,
                  block_n: int = 16) -> torch.Tensor:
    """Given: launch :func:`prefill_kernel`. Same contract as
    ``paged_ref.paged_prefill(..., backend="triton")`` for valid inputs with a positive scale
    (no input checks here). ``block_m`` (query rows per tile, a power of two >= 16 and >= the
    GQA group) and ``block_n`` (keys per loop step, a power of two >= 16) set the tiles."""
    total, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    out = torch.empty_like(q)
    q_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    if total == 0 or max(q_lens, default=0) == 0:
        return out
    block_q = block_m // group
    num_tiles = triton.cdiv(max(q_lens), block_q)
    upcast = _device.INTERPRET and q.dtype != torch.float32
    scale = head_dim**-0.5 if scale is None else float(scale)
    prefill_kernel[(num_tiles, num_kv_heads, len(q_lens))](
        out, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        scale * 1.4426950408889634, num_tiles,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, GROUP=group, HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=block_m,
        BLOCK_Q=block_q, BLOCK_N=block_n, CAUSAL=causal,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 or upcast else "tf32",
        DOT_UPCAST=upcast,
    )
    return out


# ---- Given: Ex 8.3 on its own, to look at -------------------------------------------------------


@triton.jit
def _ranges_kernel(out_ptr, first_pos, last_pos, seq_len, CAUSAL: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    full_end, kv_end = tile_key_ranges(first_pos, last_pos, seq_len, CAUSAL, BLOCK_N)
    tl.store(out_ptr, full_end)
    tl.store(out_ptr + 1, kv_end)


def key_ranges(first_pos: int, last_pos: int, seq_len: int, *, causal: bool = True,
               block_n: int = 16) -> tuple[int, int]:
    """Given: run :func:`tile_key_ranges` in one program; returns ``(full_end, kv_end)``."""
    out = torch.zeros(2, dtype=torch.int32, device=_device.triton_device())
    _ranges_kernel[(1,)](out, first_pos, last_pos, seq_len, CAUSAL=causal, BLOCK_N=block_n)
    return tuple(out.tolist())
