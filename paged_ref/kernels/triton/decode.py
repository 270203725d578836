"""``backend="triton"``: a one-pass Triton paged decode kernel.

One program per (sequence, KV head). It loads the queries of every query head that shares this
KV head (the GQA group), then walks the sequence ``TILE`` tokens at a time: look up each
token's physical block in the block table, load those K rows straight from the paged cache,
score them with one ``tl.dot`` for the whole group, and fold them into an online softmax
(running max ``m``, running sum ``l``, running weighted sum ``acc``). Each K/V byte is read once
and nothing is copied.

The token loop lives in :func:`attend_tokens`, which the split-KV kernel
(:mod:`paged_ref.kernels.triton.split`) reuses on a chunk of the sequence.

Scores are kept in base 2 (``exp2``), so the softmax's running max and the log-sum-exp that
the split kernel writes are in log2 units. A tile whose every score is ``-inf`` (a key of
``-inf``) adds nothing: the running max is taken as 0 while it is still ``-inf``, so no
``exp2(-inf - -inf)`` (NaN) ever happens; a sequence whose every score is ``-inf`` gives zeros,
as an empty one does (the torch backend agrees).

Strides: the wrappers pass the strides of every dimension but the last; ``q``, ``out``,
``block_tables`` and ``seq_lens`` must have a unit stride in their last dimension
(:func:`unit_last_stride` makes a copy otherwise: they are small). Lengths are clamped to
``max_seq_len`` (the table's capacity, or a plan's bound), so the kernels never read a table
entry past the ones the checks saw.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_ref import _device
from paged_ref.cache_math import default_scale
from paged_ref.kernels.triton.kv_formats import (
    KV_FP8_TENSOR,
    KV_FP8_TOKEN_HEAD,
    KV_INT4,
    KV_PLAIN,
    attend_tokens_int4,
    kv_format_code,
    kv_kernel_args,
    token_slots,
)
from paged_ref.kernels.triton.launch import launch

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class KernelConfig:
    """Launch shape: ``tile`` tokens per loop step, warps per program, pipeline depth, and
    ``prefetch``: the kernel itself loads the next tile into registers before it uses this one
    (for de-quantised caches, whose tiles Triton's pipeline would stage through shared memory
    as bytes; use it with ``num_stages=1``)."""

    tile: int = 64
    num_warps: int = 4
    num_stages: int = 3
    prefetch: bool = False

    @property
    def label(self) -> str:
        """``t64,w4,s3`` (``,prefetch`` when set): for tables (the bench's config sweep)."""
        return f"t{self.tile},w{self.num_warps},s{self.num_stages}" + (
            ",prefetch" if self.prefetch else "")

    def launch_options(self) -> dict:
        """Triton's launch options for this config."""
        return dict(num_warps=self.num_warps, num_stages=self.num_stages)


#: Launch configs for quantised caches (KV_FORMAT -> config), from a sweep on the H200
#: (B64_L4096, head_dim 128, q bf16; 24 configs a format and layout): 64 tokens a tile on 2
#: warps was fastest for FP8 (per tensor 66 % of copy bandwidth, 0.191 ms, against 54 % at
#: 128 tokens on 4 warps, the config before) and for INT4 (23 %); capping the registers a
#: thread to fit more programs on a multiprocessor did not help. Used for head_dim <= 128 and
#: 16-bit q (the configs measured); everything else keeps KernelConfig(). INT4 loads its next
#: tile itself (``prefetch``): 24.7 % against 22.9 %, the only format it helped.
QUANTISED_CONFIGS = {1: KernelConfig(64, 2, 3), 2: KernelConfig(64, 2, 3),
                     3: KernelConfig(64, 2, 1, prefetch=True)}


#: The launch config for a plain 16-bit cache with head_dim <= 64 (the 1B-like and SmolLM2
#: shapes): two pipeline stages, not three. H200, bf16, 32 q / 8 KV heads, D 64: B256_L284
#: 0.0534 ms against 0.0573 (-7 %), B256_L1024 0.1446 against 0.1533 (-6 %), B64_L284 equal
#: (27 configs each: tiles 32/64/128 x warps 2/4/8 x stages 2/3/4); on an H100 B256_L284
#: -1.6 %, B64_L4096 +0.4 %, SmolLM2's heads (9 q / 3 KV) B32_L2048 +2.7 %. At D 128 three
#: stages stay best (``results/h200/tune_configs.json``).
SMALL_HEAD_CONFIG = KernelConfig(64, 4, 2)


def default_config(q: torch.Tensor, k_cache) -> KernelConfig:
    """The launch config for these inputs: :data:`QUANTISED_CONFIGS`,
    :data:`SMALL_HEAD_CONFIG` or ``KernelConfig()``."""
    code = kv_format_code(k_cache)
    if q.dtype == torch.float32 or _device.INTERPRET:
        return KernelConfig()
    if code:
        return QUANTISED_CONFIGS[code] if k_cache.shape[-1] <= 128 else KernelConfig()
    return SMALL_HEAD_CONFIG if k_cache.shape[-1] <= 64 else KernelConfig()


@triton.jit
def load_token_tile(
    k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, t0, end, stride_kb, stride_kt, stride_kh,
    k_scale_ptr, v_scale_ptr, stride_sb, stride_st, stride_sh,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    TILE: tl.constexpr, KV_FORMAT: tl.constexpr,
):
    """K and V rows of tokens ``[t0, t0 + TILE)`` of one KV head, straight from the paged cache:
    ``(k, v, k_scale, v_scale, t_mask)``: k, v ``[TILE, HEAD_DIM_PAD]`` in the cache's dtype
    (rows at or past ``end`` are 0 and cost no memory traffic), the per-token scales ``[TILE]``
    (``KV_FP8_TOKEN_HEAD``; ones otherwise) and ``t_mask`` ``[TILE]`` (token < end)."""
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    # Logical -> physical: which block holds each token, and where in it.
    block, slot, t_mask = token_slots(table_row_ptr, t0, end, BLOCK_SIZE, TILE)
    row = block * stride_kb + slot * stride_kt + kv_head * stride_kh
    kv_mask = t_mask[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
    if KV_FORMAT == KV_FP8_TOKEN_HEAD:
        srow = block * stride_sb + slot * stride_st + kv_head * stride_sh
        k_s = tl.load(k_scale_ptr + srow, mask=t_mask, other=0.0)
        v_s = tl.load(v_scale_ptr + srow, mask=t_mask, other=0.0)
    else:
        k_s = tl.full([TILE], 1.0, dtype=tl.float32)
        v_s = k_s
    return k, v, k_s, v_s, t_mask


@triton.jit
def attend_tokens(
    q,  # [GROUP_PAD, HEAD_DIM_PAD] queries of one GQA group, cache dtype (padded rows are 0)
    k_cache_ptr,
    v_cache_ptr,
    table_row_ptr,  # block_tables[b] (int32)
    kv_head,
    start,  # first token (inclusive)
    end,  # last token (exclusive); start < end
    qk_scale,  # softmax scale * log2(e)
    stride_kb,  # cache strides in elements: block, token-in-block, head
    stride_kt,
    stride_kh,
    BLOCK_SIZE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr,
    k_scale_ptr,  # quantised caches (see kv_formats.py); unused for KV_PLAIN
    v_scale_ptr,
    k_zero_ptr,
    v_zero_ptr,
    stride_sb,  # scale strides in elements: block, token-in-block, head
    stride_st,
    stride_sh,
    KV_FORMAT: tl.constexpr,
    INT4_GROUPS: tl.constexpr,
    PREFETCH: tl.constexpr,  # load tile i + 1 while tile i is used (registers, no async copy)
):
    """Online softmax over tokens [start, end) of one sequence for one GQA group.

    Returns (acc [GROUP_PAD, HEAD_DIM_PAD] fp32 unnormalised, m [GROUP_PAD] running max in
    log2 units, l [GROUP_PAD] running sum of 2^(score - m)). A quantised cache
    (``KV_FORMAT`` > 0) is de-quantised in registers, see
    :mod:`paged_ref.kernels.triton.kv_formats`.
    """
    if KV_FORMAT == KV_INT4:
        return attend_tokens_int4(
            q, k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, start, end, qk_scale,
            stride_kb, stride_kt, stride_kh, k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr,
            stride_sb, stride_st, stride_sh,
            BLOCK_SIZE, HEAD_DIM, GROUP_PAD, TILE, DOT_PRECISION, DOT_UPCAST, INT4_GROUPS,
            PREFETCH,
        )
    if KV_FORMAT != KV_PLAIN:  # e4m3 codes become float16 (float32 when upcasting) for the dots
        q = q.to(tl.float32 if DOT_UPCAST else tl.float16)
    if KV_FORMAT == KV_FP8_TENSOR:  # q . (s c) = s (q . c): the K scale joins the score scale
        qk_scale = qk_scale * tl.load(k_scale_ptr)
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)
    # PREFETCH: each step loads the tile after the one it uses (the first tile is loaded before
    # the loop), so that tile's loads are in flight while this one is computed on.
    AHEAD: tl.constexpr = TILE if PREFETCH else 0
    if PREFETCH:
        nxt = load_token_tile(
            k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, start, end,
            stride_kb, stride_kt, stride_kh, k_scale_ptr, v_scale_ptr,
            stride_sb, stride_st, stride_sh, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, TILE, KV_FORMAT)
    for t0 in range(start, end, TILE):
        loaded = load_token_tile(
            k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, t0 + AHEAD, end,
            stride_kb, stride_kt, stride_kh, k_scale_ptr, v_scale_ptr,
            stride_sb, stride_st, stride_sh, BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, TILE, KV_FORMAT)
        if PREFETCH:
            tile, nxt = nxt, loaded
        else:
            tile = loaded
        k, v, k_s, v_s, t_mask = tile
        k = k.to(q.dtype)  # (a no-op for plain caches unless upcasting)
        scores = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        if KV_FORMAT == KV_FP8_TOKEN_HEAD:  # column t of the scores times token t's K scale
            scores *= k_s[None, :]
        scores = tl.where(t_mask[None, :], scores, float("-inf"))  # [GROUP_PAD, TILE]
        # Online softmax: rescale what we have by 2^(m_old - m_new), then add this tile.
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # all -inf so far: add nothing
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        v = v.to(q.dtype)
        pv = p
        if KV_FORMAT == KV_FP8_TOKEN_HEAD:  # sum_t p_t (s_t c_t) = (p s) @ c
            pv = p * v_s[None, :]
        acc = acc * alpha[:, None] + tl.dot(pv.to(v.dtype), v, input_precision=DOT_PRECISION)
        m = m_new
    if KV_FORMAT == KV_FP8_TENSOR:
        acc = acc * tl.load(v_scale_ptr)
    return acc, m, l


@triton.jit
def load_group_queries(
    q_ptr, b, kv_head, stride_qb, stride_qh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
):
    """Queries of the GROUP query heads that read ``kv_head``: [GROUP_PAD, HEAD_DIM_PAD]
    (padded rows and columns are 0)."""
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    heads = kv_head * GROUP + offs_g
    mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
    ptrs = q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def paged_decode_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qk_scale,
    max_seq_len,
    stride_qb, stride_qh, stride_ob, stride_oh, stride_bt, stride_kb, stride_kt, stride_kh,
    k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr, stride_sb, stride_st, stride_sh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    KV_FORMAT: tl.constexpr, INT4_GROUPS: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Grid (batch, num_kv_heads): out[b, heads of kv_head] = attention over the whole sequence.
    A row of length ``-1`` (one the value checks rejected) is skipped: nothing read or written."""
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_seq_len)
    if seq_len >= 0:
        q = load_group_queries(q_ptr, b, kv_head, stride_qb, stride_qh,
                               GROUP, GROUP_PAD, HEAD_DIM, HEAD_DIM_PAD)
        if DOT_UPCAST:
            q = q.to(tl.float32)
        acc, m, l = attend_tokens(
            q, k_cache_ptr, v_cache_ptr, block_tables_ptr + b.to(tl.int64) * stride_bt,
            kv_head, 0, seq_len, qk_scale, stride_kb, stride_kt, stride_kh,
            BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, GROUP_PAD, TILE, DOT_PRECISION, DOT_UPCAST,
            k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr, stride_sb, stride_st, stride_sh,
            KV_FORMAT, INT4_GROUPS, PREFETCH,
        )
        out = acc / tl.where(l > 0, l, 1.0)[:, None]  # an empty sequence gives zeros, not NaN
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        heads = kv_head * GROUP + offs_g
        mask = (offs_g < GROUP)[:, None] & (offs_d < HEAD_DIM)[None, :]
        ptrs = out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :]
        tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=mask)


def unit_last_stride(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its last dimension has stride 1 (other strides, even 0, are passed to
    the kernels), else a contiguous copy. A copy is one small launch, and CUDA graphs capture it
    like any other kernel (so a graph replays it from the caller's tensor)."""
    return t if t.shape[-1] <= 1 or t.stride(-1) == 1 else t.contiguous()


def prepare_out(out: torch.Tensor | None, q: torch.Tensor, k_cache) -> tuple[torch.Tensor, bool]:
    """``out`` (a new contiguous one when None), and whether the call is already done: an
    empty batch, or a pool with no blocks at all (every length is 0 then, the checks saw to
    it: zeros). ``out`` comes checked from the layer above (unit stride in head_dim)."""
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] and k_cache.shape[0] == 0:
        out.zero_()
    return out, q.shape[0] == 0 or k_cache.shape[0] == 0


def launch_constants(q: torch.Tensor, k_cache, scale: float | None) -> dict:
    """Compile-time sizes shared by the one-pass and split kernels (``k_cache`` a tensor or a
    :class:`~paged_ref.QuantizedKV`), plus ``qk_scale``. A new dict each call (callers pop
    from it); worked out once per combination of sizes (a hot call's host time counts)."""
    return dict(_launch_constants(q.dtype, q.shape[1], q.shape[2], k_cache.shape[1],
                                  k_cache.shape[2], scale, not isinstance(k_cache, torch.Tensor)))


@functools.lru_cache(maxsize=256)
def _launch_constants(q_dtype, num_q_heads, head_dim, block_size, num_kv_heads, scale,
                      quantized) -> dict:
    group = num_q_heads // num_kv_heads
    scale = default_scale(head_dim, scale)
    # Triton 3.6's interpreter gives garbage for tl.dot on bfloat16 operands: there, and only
    # there, the kernels multiply in float32 (the loads and the bytes moved stay bfloat16).
    # De-quantised values are float16 for the dots, float32 with a float32 q or in the
    # interpreter.
    upcast = (_device.INTERPRET and q_dtype == torch.bfloat16) or (
        quantized and (_device.INTERPRET or q_dtype == torch.float32))
    return dict(
        qk_scale=scale * LOG2E,
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),  # tl.dot needs >= 16 rows
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
        # fp32 caches: exact fp32 products (the default, tf32, would miss 1e-5)
        DOT_PRECISION="ieee" if q_dtype == torch.float32 or upcast else "tf32",
        DOT_UPCAST=upcast,
    )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Launch :func:`paged_decode_kernel`: one program per (sequence, KV head).

    Args:
        q: ``[batch, Hq, D]`` float16 / bfloat16 / float32, any strides (a copy when head_dim's
            stride is not 1).
        k_cache, v_cache: ``[num_blocks, block_size, Hkv, D]`` contiguous tensors of q's dtype,
            or :class:`~paged_ref.QuantizedKV` caches.
        block_tables: int32 ``[batch, max_blocks_per_seq]``; seq_lens: int32 ``[batch]``
            (``-1`` rows are skipped). Values already checked (the kernel trusts them).
        scale: softmax scale, default ``head_dim ** -0.5``.
        config: launch shape, default :func:`default_config`.
        out: ``[batch, Hq, D]`` of q's dtype, head_dim stride 1; default a new contiguous one.
        max_seq_len: lengths are clamped to it; default what the table holds
            (``max_blocks_per_seq * block_size``).

    Returns:
        ``out``: ``[batch, Hq, D]`` in q's dtype.
    """
    config = config or default_config(q, k_cache)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out, done = prepare_out(out, q, k_cache)
    if done:
        return out
    q, block_tables, seq_lens = (unit_last_stride(t) for t in (q, block_tables, seq_lens))
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * k_cache.shape[1]
    consts = launch_constants(q, k_cache, scale)
    (k_data, v_data, *scales), formats = kv_kernel_args(k_cache, v_cache)
    launch(
        paged_decode_kernel, (batch, num_kv_heads),
        out, q, k_data, v_data, block_tables, seq_lens, consts.pop("qk_scale"), max_seq_len,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_data.stride(0), k_data.stride(1), k_data.stride(2), *scales,
        TILE=config.tile, PREFETCH=config.prefetch, **config.launch_options(), **consts,
        **formats,
    )
    return out


__all__ = ["KernelConfig", "attend_tokens", "paged_attention_triton", "prepare_out",
           "paged_decode_kernel", "unit_last_stride"]
