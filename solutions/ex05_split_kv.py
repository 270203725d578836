"""Lesson 05: split-KV ("flash-decoding") decode attention with a log-sum-exp merge.

One program per (sequence, KV head) leaves a big GPU idle when the batch is small and the
sequences long. Split-KV cuts each sequence into chunks of ``chunk_size`` tokens, runs one
program per (sequence, KV head, chunk), then merges the chunks' results:

* Ex 5.1 :func:`merge_partials`           the merge, in plain torch
* Ex 5.2 :func:`attend_chunk`             (Triton) lesson 04's loop over one chunk's tokens
* Ex 5.3 :func:`partial_attention_kernel` stage 1 in Triton: one program per chunk, writing
                                          the normalised partial output and its log-sum-exp
* Ex 5.4 :func:`merge_chunks_kernel`      stage 2 in Triton: merge one head's chunks
* given  :func:`chunk_state` runs 5.2 alone on one chunk, to look at (and test) it
* given  :func:`launch_partials`, :func:`launch_merge`, :func:`split_kv_decode` = 5.3 + 5.4

The merge, for chunks ``c`` with normalised outputs ``o_c`` and log-sum-exps ``lse_c`` of their
scores: ``lse = log(sum_c exp(lse_c))`` and ``out = sum_c exp(lse_c - lse) * o_c``. That is
exactly attention over the whole sequence.

Units: natural logs everywhere here (``lse = torch.logsumexp(scores)``), as in lesson 04's
kernel. paged_ref's ``triton_split`` (like many production kernels) works in base 2 instead:
it folds ``log2(e)`` into the scale and uses ``exp2``, the GPU's native exponential, so its lse
is ``lse / ln 2``; the weights ``2 ** (lse2_c - lse2) = exp(lse_c - lse)`` are the same.

Layout (as everywhere in the course)::

    q                [B, Hq, D]                   one new token per sequence
    k_cache, v_cache [num_blocks, block_size, Hkv, D]
    block_tables     [B, max_blocks] int32        token t of sequence b lives in block
                                                  block_tables[b, t // block_size],
                                                  offset t % block_size
    seq_lens         [B] int32
    part_out         [B, Hq, C, D] float32        C = num_chunks; chunk c of sequence b holds
    part_lse         [B, Hq, C] float32           tokens [c * chunk_size, (c+1) * chunk_size)

The teaching kernels need ``head_dim`` to be a power of two, at least 16 (paged_ref's kernels
pad any head_dim).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from paged_ref import _device
from paged_ref.kernels.triton.decode import load_group_queries  # given: the GQA group's q

from .ex04_triton_paged_decode import load_kv_tile  # noqa: F401  (lesson 04 Ex 4.2: yours)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Exercise 5.1: merge per-chunk attention results into attention over all the chunks.

    Args:
        outs: [C, ..., D] normalised partial outputs: ``outs[c] = softmax(s_c) @ v_c`` over the
            tokens of chunk ``c`` alone (any leading dims ``...``, e.g. [C, B, Hq, D]).
            ``outs[c]`` of an empty chunk may hold anything, NaN included.
        lses: [C, ...] natural-log sum-exp of each chunk's scores, ``log(sum_t exp(s_t))``;
            ``-inf`` for an empty chunk.

    Returns:
        out: [..., D] in ``outs``' dtype, ``sum_c w_c * outs[c]`` with weights
            ``w_c = exp(lses[c] - lse)`` (0 for empty chunks); zeros where every chunk is empty.
        lse: [...] ``log(sum_c exp(lses[c]))``, the log-sum-exp of all the scores (-inf where
            every chunk is empty), so merged results can be merged again.

    Example (C = 2, one head, D = 1): chunk 0 has scores [0, 0] and values [1, 3]; chunk 1 has
    score [ln 2] and value [7]. Then ``outs = [[2.], [7.]]``, ``lses = [ln 2, ln 2]``: both
    chunks weigh the same (each holds half of the total ``exp`` mass 4), so ``out = [4.5]``
    and ``lse = ln 4``. Attention over [0, 0, ln 2] with values [1, 3, 7] gives the same:
    (1 + 3 + 2 * 7) / 4 = 4.5.

    Hints:
        * Subtract the largest ``lses[c]`` before ``exp`` (``lses`` of 1000 are normal for long
          sequences with large scores; ``exp(1000)`` is inf). Where every chunk is empty the
          largest is ``-inf``: use 0 there instead, or you get ``-inf - -inf = nan``.
        * ``exp(-inf) = 0`` gives empty chunks weight 0, but ``0 * nan`` is still nan: zero
          their ``outs`` too (``torch.where``).
        * Compute in float32 at least (``torch.promote_types(outs.dtype, torch.float32)``).
    """
    # BEGIN SOLUTION
    acc = torch.promote_types(outs.dtype, torch.float32)
    lses = lses.to(acc)
    top = lses.amax(dim=0)  # [...]
    top = torch.where(torch.isfinite(top), top, 0.0)  # every chunk empty: any finite value
    w = torch.exp(lses - top)  # [C, ...], 0 for empty chunks
    parts = torch.where(w[..., None] > 0, outs.to(acc), 0.0)  # garbage in empty chunks -> 0
    total = w.sum(dim=0)  # [...]
    out = (w[..., None] * parts).sum(dim=0) / torch.where(total > 0, total, 1.0)[..., None]
    return out.to(outs.dtype), top + torch.log(total)
    # END SOLUTION


@triton.jit
def attend_chunk(
    q,  # [GROUP_PAD, HEAD_DIM] the group's queries (rows >= GROUP are 0), float32 or cache dtype
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,  # block_tables[b]: this sequence's row of the block table (int32)
    start,  # first token of the chunk
    end,  # one past its last token; start < end <= seq_len
    kv_head,
    scale,  # softmax scale (float)
    stride_block, stride_tok, stride_head,  # cache strides: block, token in block, head
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,  # a power of two >= 16
    GROUP_PAD: tl.constexpr,
    TILE: tl.constexpr,  # tokens per loop step, a power of two >= 16
    DOT_PRECISION: tl.constexpr,
):
    """Exercise 5.2: the online-softmax state of one GQA group over tokens ``[start, end)``.

    Returns ``(m, l, acc)``, all float32, *not* normalised:

    * ``m``   [GROUP_PAD]: the largest scaled score ``scale * q[g] . k_t`` over the chunk;
    * ``l``   [GROUP_PAD]: ``sum_t exp(score_t - m)``;
    * ``acc`` [GROUP_PAD, HEAD_DIM]: ``sum_t exp(score_t - m) * v_t``.

    This is lesson 04's Exercise 4.3 with two changes: the tokens run from ``start`` to
    ``end`` (not 0 to ``seq_len``), and the state is returned as it is, because stage 1 turns it
    into a partial result and its log-sum-exp (Ex 5.3).

    Example: ``start = 40, end = 100, TILE = 32``: two loop steps, tokens 40..71 and 72..103,
    the last four of them masked.

    Hints:
        * Lesson 04's ``load_kv_tile`` (imported above: yours, from
          ``exercises/ex04_triton_paged_decode.py``) loads a K or V tile through the block table.
          Cast what it returns to ``q.dtype`` before ``tl.dot`` (it matters only in the CPU
          interpreter, where bfloat16 queries are upcast).
        * A token past ``end`` belongs to the next chunk, or to no one: it must get weight 0.
        * ``tl.dot(a, b, input_precision=DOT_PRECISION)``; it needs 16 rows and columns at
          least, which GROUP_PAD, TILE and HEAD_DIM all are.
    """
    # BEGIN SOLUTION
    offs_d = tl.arange(0, HEAD_DIM)
    d_mask = offs_d < HEAD_DIM
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], dtype=tl.float32)
    for t0 in range(start, end, TILE):
        tok = t0 + tl.arange(0, TILE)
        t_mask = tok < end
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
    return m, l, acc
    # END SOLUTION


@triton.jit
def partial_attention_kernel(
    part_out_ptr,  # [B, Hq, C, HEAD_DIM] float32
    part_lse_ptr,  # [B, Hq, C] float32
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    scale,  # softmax scale (float)
    chunk_size,  # tokens per chunk (any positive number, not only multiples of TILE)
    num_chunks,  # C
    stride_qb, stride_qh,  # q strides (elements)
    stride_bt,  # block_tables row stride
    stride_block, stride_tok, stride_head,  # cache strides: block, token in block, head
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # query heads per KV head (Hq // Hkv)
    GROUP_PAD: tl.constexpr,  # max(16, next power of 2 of GROUP): tl.dot wants >= 16 rows
    HEAD_DIM: tl.constexpr,  # a power of two >= 16
    TILE: tl.constexpr,  # tokens per loop step, a power of two >= 16
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 inputs (exact), else "tf32"
    DOT_UPCAST: tl.constexpr,  # True: multiply in float32 (bf16 in Triton's interpreter)
):
    """Exercise 5.3: stage 1, one program per (sequence, KV head, chunk).

    Grid ``(B, Hkv, C)``. Program ``(b, kv_head, c)`` owns chunk ``c`` of sequence ``b``:
    tokens ``[c * chunk_size, (c + 1) * chunk_size)`` cut at ``seq_lens[b]``, and the ``GROUP``
    query heads ``h = kv_head * GROUP + g`` (``g < GROUP``) that read ``kv_head``. For each of
    those heads it writes

    * ``part_out[b, h, c, :]``: the chunk's attention output, normalised (float32);
    * ``part_lse[b, h, c]``: the natural log of ``sum_t exp(score_t)`` over the chunk's
      scaled scores (its log-sum-exp), so that stage 2 can weigh the chunks.

    A chunk that holds no token of its sequence writes nothing at all (stage 2 never reads it).
    ``part_out`` and ``part_lse`` are contiguous: entry ``(b, h, c)`` is flat row
    ``(b * Hq + h) * C + c``, with ``Hq = tl.num_programs(1) * GROUP``.

    Example: ``seq_lens = [100]``, ``chunk_size = 40``, ``C = 4``: programs c = 0, 1, 2 own
    tokens [0, 40), [40, 80), [80, 100); program c = 3 returns at once.

    Hints:
        * Given: ``load_group_queries(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP,
          GROUP_PAD, HEAD_DIM, HEAD_DIM)`` loads the group's queries, 0 in padded rows; with
          ``DOT_UPCAST`` cast them to float32. Then your Ex 5.2 gives ``(m, l, acc)``.
        * From ``(m, l, acc)``: the output is what lesson 04 stored; for the log-sum-exp,
          ``sum_t exp(s_t) = exp(m) * l``. Natural logs (``tl.log``), as everywhere here.
        * Rows ``g >= GROUP`` are padding: mask them out of every store. A program stores a
          ``[GROUP_PAD]`` vector of lse's and a ``[GROUP_PAD, HEAD_DIM]`` block of outputs.
        * A chunk with tokens has ``l > 0``: the division needs no guard.
    """
    # BEGIN SOLUTION
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    c = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = c * chunk_size
    if start < seq_len:
        end = tl.minimum(start + chunk_size, seq_len)
        q = load_group_queries(q_ptr, b, kv_head, stride_qb, stride_qh, GROUP, GROUP_PAD,
                               HEAD_DIM, HEAD_DIM)
        if DOT_UPCAST:
            q = q.to(tl.float32)
        m, l, acc = attend_chunk(q, k_cache_ptr, v_cache_ptr,
                                 block_tables_ptr + b.to(tl.int64) * stride_bt, start, end,
                                 kv_head, scale, stride_block, stride_tok, stride_head,
                                 BLOCK_SIZE, HEAD_DIM, GROUP_PAD, TILE, DOT_PRECISION)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM)
        heads = kv_head * GROUP + offs_g
        g_mask = offs_g < GROUP
        row = (b * (tl.num_programs(1) * GROUP) + heads) * num_chunks + c  # [GROUP_PAD]
        tl.store(part_lse_ptr + row, m + tl.log(l), mask=g_mask)
        tl.store(part_out_ptr + row.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :],
                 acc / l[:, None], mask=g_mask[:, None])
    # END SOLUTION


@triton.jit
def merge_chunks_kernel(
    out_ptr,  # [B, Hq, HEAD_DIM], the output dtype
    part_out_ptr,  # [B, Hq, C, HEAD_DIM] float32
    part_lse_ptr,  # [B, Hq, C] float32
    seq_lens_ptr,
    chunk_size,
    num_chunks,  # C
    stride_ob, stride_oh,  # out strides (elements)
    HEAD_DIM: tl.constexpr,
):
    """Exercise 5.4: stage 2, merge the chunks of one (sequence, query head).

    Grid ``(B, Hq)``: program ``(b, h)`` merges the ``used = cdiv(seq_lens[b], chunk_size)``
    chunks that hold tokens of sequence ``b``: rows ``(b * Hq + h) * C + c`` for ``c < used``
    (``Hq = tl.num_programs(1)``). Chunks ``c >= used`` were never written and hold garbage
    (NaN in the tests): never read them. With ``o_c`` and ``lse_c`` the chunks' partials::

        lse = log(sum_c exp(lse_c))        out[b, h, :] = sum_c exp(lse_c - lse) * o_c

    stored in ``out_ptr``'s dtype. A sequence of length 0 has no chunk: zeros.

    Example: two chunks with ``lse = [3, 3]`` and ``o = [[1, 1, ...], [4, 4, ...]]`` weigh
    1/2 each: out = [2.5, 2.5, ...]. With ``lse = [3 + ln 2, 3]`` the first weighs 2/3:
    out = [2, 2, ...].

    Hints:
        * The merge is itself an online softmax, over chunks instead of tokens: a running max
          ``m_i`` (start at ``-inf``), a running weight sum ``l_i`` and a running
          ``acc [HEAD_DIM]``. For each chunk: ``m_new = max(m_i, lse_c)``, rescale ``l_i`` and
          ``acc`` by ``exp(m_i - m_new)``, add ``w = exp(lse_c - m_new)`` and ``w * o_c``.
        * ``for c in range(0, used)``: one chunk per step, a scalar lse and a [HEAD_DIM] row.
          Loop-carried values must keep one type: ``m_i = tl.full([], float("-inf"),
          tl.float32)``, ``l_i = tl.zeros([], tl.float32)``.
        * Divide by ``l_i`` only where ``l_i > 0`` (``tl.where``): empty sequences give zeros.
        * ``out.to(out_ptr.dtype.element_ty)`` before ``tl.store``.
    """
    # BEGIN SOLUTION
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    used = tl.cdiv(seq_len, chunk_size)
    offs_d = tl.arange(0, HEAD_DIM)
    row0 = (b * tl.num_programs(1) + h) * num_chunks
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for c in range(0, used):
        lse = tl.load(part_lse_ptr + row0 + c)
        o = tl.load(part_out_ptr + (row0 + c).to(tl.int64) * HEAD_DIM + offs_d)
        m_new = tl.maximum(m_i, lse)
        alpha = tl.exp(m_i - m_new)
        w = tl.exp(lse - m_new)
        l_i = l_i * alpha + w
        acc = acc * alpha + w * o
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty))
    # END SOLUTION


# ----------------------------------------------------------------------------- given

def num_chunks_for(seq_lens: torch.Tensor, chunk_size: int) -> int:
    """Chunks per sequence for ``chunk_size``: enough for the longest sequence (at least 1)."""
    longest = int(seq_lens.max()) if seq_lens.numel() else 0
    return max(1, math.ceil(longest / chunk_size))


def _dot_options(dtype: torch.dtype) -> dict:
    # float32: exact products (tf32 would miss 1e-5). Triton 3.6's interpreter computes garbage
    # for tl.dot on bfloat16, so there (only there) the kernel multiplies in float32.
    upcast = _device.INTERPRET and dtype == torch.bfloat16
    return dict(DOT_PRECISION="ieee" if dtype == torch.float32 or upcast else "tf32",
                DOT_UPCAST=upcast)


@triton.jit
def _chunk_state_kernel(
    m_ptr, l_ptr, acc_ptr, q_ptr, k_cache_ptr, v_cache_ptr, table_row_ptr, start, end, kv_head,
    scale, stride_qh, stride_block, stride_tok, stride_head,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, TILE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
):
    q = load_group_queries(q_ptr, 0, kv_head, 0, stride_qh, GROUP, GROUP_PAD, HEAD_DIM, HEAD_DIM)
    if DOT_UPCAST:
        q = q.to(tl.float32)
    m, l, acc = attend_chunk(q, k_cache_ptr, v_cache_ptr, table_row_ptr, start, end, kv_head,
                             scale, stride_block, stride_tok, stride_head, BLOCK_SIZE, HEAD_DIM,
                             GROUP_PAD, TILE, DOT_PRECISION)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    tl.store(m_ptr + offs_g, m)
    tl.store(l_ptr + offs_g, l)
    tl.store(acc_ptr + offs_g[:, None] * HEAD_DIM + offs_d[None, :], acc)


def chunk_state(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
    b: int, kv_head: int, start: int, end: int, *, scale: float | None = None, tile: int = 32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Given: what :func:`attend_chunk` returns for tokens ``[start, end)`` of sequence ``b``
    and the query heads that read ``kv_head``, in one program: ``(m [G], l [G], acc [G, D])``
    float32, ``G = Hq // Hkv`` (the padding rows are dropped)."""
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    group = num_q_heads // k_cache.shape[2]
    group_pad = max(16, triton.next_power_of_2(group))
    m = torch.empty(group_pad, dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty(group_pad, head_dim, dtype=torch.float32, device=q.device)
    _chunk_state_kernel[(1,)](
        m, l, acc, q[b], k_cache, v_cache, block_tables[b], start, end, kv_head,
        head_dim**-0.5 if scale is None else float(scale), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], GROUP=group, GROUP_PAD=group_pad, HEAD_DIM=head_dim,
        TILE=tile, **_dot_options(q.dtype),
    )
    return m[:group], l[:group], acc[:group]


def launch_partials(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    chunk_size: int,
    num_chunks: int,
    scale: float | None = None,
    tile: int = 32,
    buffers: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Given: launch stage 1 (:func:`partial_attention_kernel`) on grid (B, Hkv, num_chunks).

    Returns ``(part_out [B, Hq, C, D] float32, part_lse [B, Hq, C] float32)``.
    Entries of chunks with no tokens are left as they were: uninitialised memory, or what
    ``buffers`` (preallocated ``(part_out, part_lse)``, e.g. filled with NaN) held.
    """
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"the teaching kernels need head_dim a power of two >= 16, got {head_dim}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if buffers is None:
        buffers = (
            torch.empty(batch, num_q_heads, num_chunks, head_dim, dtype=torch.float32,
                        device=q.device),
            torch.empty(batch, num_q_heads, num_chunks, dtype=torch.float32, device=q.device),
        )
    part_out, part_lse = buffers
    if batch == 0:
        return part_out, part_lse
    group = num_q_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else float(scale)
    partial_attention_kernel[(batch, num_kv_heads, num_chunks)](
        part_out, part_lse, q, k_cache, v_cache, block_tables, seq_lens,
        scale, chunk_size, num_chunks,
        q.stride(0), q.stride(1), block_tables.stride(0),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=block_size, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, TILE=tile, **_dot_options(q.dtype),
    )
    return part_out, part_lse


def launch_merge(
    part_out: torch.Tensor,
    part_lse: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    chunk_size: int,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Given: launch stage 2 (:func:`merge_chunks_kernel`) on grid (B, Hq); returns [B, Hq, D] in
    ``dtype``. Reads only the chunks that hold tokens."""
    batch, num_q_heads, num_chunks, head_dim = part_out.shape
    out = torch.empty(batch, num_q_heads, head_dim, dtype=dtype, device=part_out.device)
    if batch == 0:
        return out
    merge_chunks_kernel[(batch, num_q_heads)](
        out, part_out, part_lse, seq_lens, chunk_size, num_chunks,
        out.stride(0), out.stride(1), HEAD_DIM=head_dim,
    )
    return out


def split_kv_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    chunk_size: int,
    scale: float | None = None,
) -> torch.Tensor:
    """Given (not an exercise): split-KV decode attention = 5.3 (partials) + 5.4 (merge).

    Same contract as ``paged_ref.paged_attention`` for valid inputs (head_dim a power of two
    >= 16 here): returns [B, Hq, D] in q's dtype; a sequence of length 0 gives zeros.
    """
    num_chunks = num_chunks_for(seq_lens, chunk_size)
    part_out, part_lse = launch_partials(q, k_cache, v_cache, block_tables, seq_lens,
                                         chunk_size=chunk_size, num_chunks=num_chunks,
                                         scale=scale)
    return launch_merge(part_out, part_lse, seq_lens, chunk_size=chunk_size, dtype=q.dtype)
