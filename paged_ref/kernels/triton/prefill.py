"""``paged_prefill(backend="triton")``: a tiled Triton kernel for many query tokens per sequence.

One program per (query tile, KV head, sequence). A tile is ``BLOCK_M`` rows of queries: the
``GROUP`` query heads that share one KV head, for ``BLOCK_Q = BLOCK_M // GROUP`` consecutive
query tokens (row ``r`` is token ``r // GROUP``, head ``r % GROUP``). Packing the GQA group into
the rows means each K/V tile read from the cache serves every head of the group, and the
matrix products have enough rows for the tensor cores even when a sequence has few queries.

The program walks the sequence's keys ``BLOCK_N`` at a time, looks each key's physical block
up in the block table, loads K and V straight from the paged cache, and keeps an online
softmax (running max ``m``, sum ``l``, weighted sum ``acc``; scores in base 2) -- the
FlashAttention-2 loop. The causal diagonal is handled per tile, in two loops:

* keys ``[0, full_end)``: every row of the tile sees every key (they are at or before the
  tile's first query position), so no mask is computed at all;
* keys ``[full_end, kv_end)``: the diagonal band (and a sequence's last partial key tile),
  masked ``key <= query position`` and ``key < seq_len``;
* keys past the tile's last query position are never loaded: fully masked tiles are skipped.

A query row ``i`` of a sequence with ``q_len`` queries and ``seq_len`` cached tokens is token
``seq_len - q_len + i``: the cached prefix simply shifts the diagonal.

Measured on an H200 (``results/h200/prefill.json``; bf16, 32 q / 8 KV heads, D 128): 357-448
TFLOP/s, 0.84-0.90x FlashInfer's paged prefill, 52-65 % of the dense matmul rate. What is left is
the inner loop: the K/V tiles are gathered with pointer loads (rows of different blocks are not
one rectangle for TMA) and Triton 3.6 does not warp-specialise this loop on Hopper, so the
softmax does not overlap the next tile's matrix products as in FlashInfer's Hopper kernels.

Decode is not routed through this kernel: one query row per sequence in 16-row tiles reads the
cache at 3.2 TB/s where the decode kernels reach 4.2 TB/s (B64_L4096), and long sequences need
split-KV. ``paged_prefill(backend="auto")`` sends all-decode batches to the decode kernels; a
mixed batch's decode rows stay here, launched apart with small tiles (:data:`SHORT_CONFIG`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_ref import _device
from paged_ref.kernels.triton.decode import launch_constants, unit_last_stride
from paged_ref.kernels.triton.kv_formats import (
    KV_FP8_TENSOR,
    KV_FP8_TOKEN_HEAD,
    KV_INT4,
    KV_PLAIN,
    int4_halves,
    kv_kernel_args,
    load_scale_zero,
)
from paged_ref.kernels.triton.launch import launch


@dataclass(frozen=True)
class PrefillConfig:
    """Launch shape: ``block_m`` query rows (tokens x GQA heads) and ``block_n`` keys per tile,
    warps per program, pipeline depth. Both blocks are powers of two >= 16 (``tl.dot``)."""

    block_m: int = 128
    block_n: int = 64
    num_warps: int = 8
    num_stages: int = 3


#: Tiles for decode-like sequences in a mixed batch: 16 rows (one token x a GQA group of 16,
#: or 4 tokens x a group of 4), as the decode kernel uses.
SHORT_CONFIG = PrefillConfig(block_m=16, block_n=64, num_warps=4, num_stages=3)


def default_config(head_dim: int, dtype: torch.dtype, *,
                   interpret: bool | None = None) -> PrefillConfig:
    """The launch shape used when none is given (tuned on an H200; small in the interpreter,
    where a program's cost is its element count). ``interpret`` defaults to this machine's."""
    if _device.INTERPRET if interpret is None else interpret:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=1)
    if head_dim > 128 or dtype == torch.float32:
        return PrefillConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)
    # H200, bf16, D 128, GQA 4: 256 x 64 tiles, 8 warps, 3 pipeline stages was the best of
    # eleven shapes on each of the four prefill cases (results/h200/prefill.json, sweep).
    return PrefillConfig(block_m=256, block_n=64, num_warps=8, num_stages=3)


@triton.jit
def _load_kv(ptr, row, offs_d, key_ok, MASK_KEYS: tl.constexpr, HEAD_DIM: tl.constexpr,
             HEAD_DIM_PAD: tl.constexpr):
    """Rows ``row`` (element offsets) of one cache, [BLOCK_N, HEAD_DIM_PAD]; masked keys and
    padded dims read 0 (never the poison in unused slots)."""
    ptrs = ptr + row[:, None] + offs_d[None, :]
    if MASK_KEYS:
        if HEAD_DIM == HEAD_DIM_PAD:
            return tl.load(ptrs, mask=key_ok[:, None], other=0.0)
        return tl.load(ptrs, mask=key_ok[:, None] & (offs_d < HEAD_DIM)[None, :], other=0.0)
    if HEAD_DIM == HEAD_DIM_PAD:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=(offs_d < HEAD_DIM)[None, :], other=0.0)


@triton.jit
def _load_kv_values(ptr, scale_ptr, zero_ptr, row, srow, key_ok, MASK_KEYS: tl.constexpr,
                    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
                    KV_FORMAT: tl.constexpr, INT4_GROUPS: tl.constexpr,
                    DOT_UPCAST: tl.constexpr):
    """Rows ``row`` of one cache as numbers, [BLOCK_N, HEAD_DIM_PAD], for the same dots as a
    plain cache. Plain values and per-tensor e4m3 codes come as loaded (that scale is applied
    once, outside the loop); a per-token-head e4m3 scale, or INT4's (scale, zero) per half head,
    is applied to the tile here, in registers, in float16 (float32 when ``DOT_UPCAST``): the
    dots over a quantised cache are float16 ones, as in decode. ``srow``: the scales' offsets.

    Decode puts those scales on the ``[heads, keys]`` scores instead (kv_formats.py): there a
    tile has 16 query rows against 128 channels. Here it has up to 256 rows, so the
    ``[keys, channels]`` tile is the smaller side to scale."""
    # (One return: the compiler checks every return's type, even in a branch it drops.)
    if KV_FORMAT == KV_INT4:  # a byte holds channel i (low nibble) and i + HEAD_DIM / 2 (high)
        offs_h = tl.arange(0, HEAD_DIM // 2)
        ptrs = ptr + row[:, None] + offs_h[None, :]
        if MASK_KEYS:
            packed = tl.load(ptrs, mask=key_ok[:, None], other=0)
        else:
            packed = tl.load(ptrs)
        low, high = int4_halves(packed, DOT_UPCAST)  # codes 0..15 as float16 (or float32)
        s_lo, z_lo = load_scale_zero(scale_ptr, zero_ptr, srow, 0, key_ok)
        s_hi, z_hi = load_scale_zero(scale_ptr, zero_ptr, srow, INT4_GROUPS - 1, key_ok)
        # x = z + s c, one fused multiply-add an element (0 for masked keys)
        low = z_lo.to(low.dtype)[:, None] + s_lo.to(low.dtype)[:, None] * low
        high = z_hi.to(low.dtype)[:, None] + s_hi.to(low.dtype)[:, None] * high
        x = tl.reshape(tl.permute(tl.join(low, high), (0, 2, 1)), (BLOCK_N, HEAD_DIM))
    else:
        x = _load_kv(ptr, row, tl.arange(0, HEAD_DIM_PAD), key_ok, MASK_KEYS, HEAD_DIM,
                     HEAD_DIM_PAD)
        if KV_FORMAT == KV_FP8_TOKEN_HEAD:
            dot_type = tl.float32 if DOT_UPCAST else tl.float16
            s = tl.load(scale_ptr + srow, mask=key_ok, other=0.0).to(dot_type)
            x = x.to(dot_type) * s[:, None]
    return x


@triton.jit
def attend_key_span(
    acc, m, l,  # running state: [BLOCK_M, HEAD_DIM_PAD] fp32, [BLOCK_M] max (log2), [BLOCK_M] sum
    q,  # [BLOCK_M, HEAD_DIM_PAD] this tile's queries
    pos,  # [BLOCK_M] each row's position in the sequence
    k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head,
    start, end, seq_len,  # keys [start, end) of a sequence of seq_len tokens
    qk_scale, stride_kb, stride_kt, stride_kh,
    k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr,  # quantised caches (kv_formats.py)
    stride_sb, stride_st, stride_sh,  # the scales' strides: block, token-in-block, head
    MASKED: tl.constexpr, CAUSAL: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, KV_FORMAT: tl.constexpr,
    INT4_GROUPS: tl.constexpr,
):
    """Fold keys [start, end) into the online softmax. ``MASKED=False`` only for ranges that
    every row sees in full (no mask is built); ``MASKED=True`` applies ``key < seq_len`` and,
    when ``CAUSAL``, ``key <= pos``. A quantised cache is de-quantised as it is loaded
    (:func:`_load_kv_values`) into q's dtype, and the dots are those of a plain cache."""
    offs_n = tl.arange(0, BLOCK_N)
    for k0 in range(start, end, BLOCK_N):
        key = k0 + offs_n
        key_ok = key < seq_len
        # Logical -> physical: the block that holds each key, and the key's row in it.
        if MASKED:
            block = tl.load(table_row_ptr + key // BLOCK_SIZE, mask=key_ok, other=0)
        else:
            block = tl.load(table_row_ptr + key // BLOCK_SIZE)
        block = block.to(tl.int64)
        row = block * stride_kb + (key % BLOCK_SIZE) * stride_kt + kv_head * stride_kh
        srow = block * stride_sb + (key % BLOCK_SIZE) * stride_st + kv_head * stride_sh
        k = _load_kv_values(k_cache_ptr, k_scale_ptr, k_zero_ptr, row, srow, key_ok, MASKED,
                            BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, KV_FORMAT, INT4_GROUPS,
                            DOT_UPCAST).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [M, N] raw scores
        if MASKED:
            keep = key_ok[None, :]
            if CAUSAL:
                keep = keep & (key[None, :] <= pos[:, None])
            s = tl.where(keep, s * qk_scale, -1.0e30)  # finite: a fully masked row gives no NaN
            m_new = tl.maximum(m, tl.max(s, axis=1))
            p = tl.exp2(s - m_new[:, None])
        else:  # the scale goes inside the exponent: one fused multiply-add per score
            m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)  # qk_scale > 0
            p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        v = _load_kv_values(v_cache_ptr, v_scale_ptr, v_zero_ptr, row, srow, key_ok, MASKED,
                            BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, KV_FORMAT, INT4_GROUPS,
                            DOT_UPCAST).to(q.dtype)
        # Rescale what we have, then let the tensor cores add p @ v into it (no second
        # [BLOCK_M, HEAD_DIM] temporary).
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m = m_new
    return acc, m, l


@triton.jit(do_not_specialize=["num_tiles", "stride_bt"])
def paged_prefill_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, seq_ids_ptr, qk_scale, num_tiles,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt, stride_kb, stride_kt, stride_kh,
    k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr, stride_sb, stride_st, stride_sh,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, DOT_PRECISION: tl.constexpr,
    DOT_UPCAST: tl.constexpr, USE_SEQ_IDS: tl.constexpr, KV_FORMAT: tl.constexpr,
    INT4_GROUPS: tl.constexpr,
):
    """Grid (num_tiles, num_kv_heads, sequences): one tile of BLOCK_Q query tokens x GROUP
    heads. Sequence = program_id(2), or ``seq_ids[program_id(2)]`` when USE_SEQ_IDS (a launch
    for a subset of the batch). ``KV_FORMAT`` / ``INT4_GROUPS``: the cache's format
    (:mod:`paged_ref.kernels.triton.kv_formats`; the scale and zero pointers are unused when
    plain)."""
    tile = num_tiles - 1 - tl.program_id(0)  # the longest (last) tiles start first
    kv_head = tl.program_id(1)
    b = tl.program_id(2)
    if USE_SEQ_IDS:
        b = tl.load(seq_ids_ptr + b)
    q_start = tl.load(query_start_loc_ptr + b)
    q_len = tl.load(query_start_loc_ptr + b + 1) - q_start
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    q_idx = tile * BLOCK_Q + offs_m // GROUP  # query token within the sequence
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m < BLOCK_Q * GROUP) & (q_idx < q_len)
    pos = seq_len - q_len + q_idx  # the causal offset: queries are the last q_len tokens
    q_rows = (q_start + q_idx).to(tl.int64)
    q_mask = row_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=q_mask, other=0.0)
    if DOT_UPCAST:
        q = q.to(tl.float32)
    elif KV_FORMAT != KV_PLAIN:  # de-quantised K/V meet q in float16 dots (e4m3 -> float16 is
        q = q.to(tl.float16)  # one instruction for two values; -> bfloat16 is not)

    if CAUSAL:
        first_pos = seq_len - q_len + tile * BLOCK_Q
        kv_end = seq_len - q_len + tl.minimum(tile * BLOCK_Q + BLOCK_Q, q_len)  # last pos + 1
        full_end = (first_pos + 1) // BLOCK_N * BLOCK_N  # keys every row of the tile sees
    else:
        kv_end = seq_len
        full_end = seq_len // BLOCK_N * BLOCK_N
    m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    table_row = block_tables_ptr + b.to(tl.int64) * stride_bt
    if KV_FORMAT == KV_FP8_TENSOR:  # q . (s c) = s (q . c): K's one scale joins the score scale
        qk_scale = qk_scale * tl.load(k_scale_ptr)  # (positive: QuantizedKV checks it)
    acc, m, l = attend_key_span(
        acc, m, l, q, pos, k_cache_ptr, v_cache_ptr, table_row, kv_head, 0, full_end, seq_len,
        qk_scale, stride_kb, stride_kt, stride_kh, k_scale_ptr, v_scale_ptr, k_zero_ptr,
        v_zero_ptr, stride_sb, stride_st, stride_sh, False, CAUSAL, BLOCK_SIZE, BLOCK_N,
        HEAD_DIM, HEAD_DIM_PAD, DOT_PRECISION, DOT_UPCAST, KV_FORMAT, INT4_GROUPS)
    acc, m, l = attend_key_span(
        acc, m, l, q, pos, k_cache_ptr, v_cache_ptr, table_row, kv_head, full_end, kv_end,
        seq_len, qk_scale, stride_kb, stride_kt, stride_kh, k_scale_ptr, v_scale_ptr,
        k_zero_ptr, v_zero_ptr, stride_sb, stride_st, stride_sh, True, CAUSAL, BLOCK_SIZE,
        BLOCK_N, HEAD_DIM, HEAD_DIM_PAD, DOT_PRECISION, DOT_UPCAST, KV_FORMAT, INT4_GROUPS)

    out = acc / l[:, None]  # every real row saw at least its own token: l > 0
    if KV_FORMAT == KV_FP8_TENSOR:  # sum_t p_t (s c_t) = s sum_t p_t c_t
        out = out * tl.load(v_scale_ptr)
    o_rows = (q_start + q_idx).to(tl.int64)
    tl.store(out_ptr + o_rows[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    max_query_len: int | None = None,
    query_lens: list[int] | None = None,
    config: PrefillConfig | None = None,
    out: torch.Tensor | None = None,
    launches: tuple[Launch, ...] | None = None,
) -> torch.Tensor:
    """Launch :func:`paged_prefill_kernel`. With ``query_lens`` and no ``config``, a batch that
    mixes decode-like sequences (a few query rows) with long ones is launched twice: the short
    ones with small tiles (:data:`SHORT_CONFIG`), so that one query row does not pay for a
    128-row tile.

    Args:
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, causal: as for
            :func:`paged_ref.paged_prefill`, values already checked; any strides.
        max_query_len: the most query rows of any sequence (sizes the grid); pass it, or
            ``query_lens`` (host ints), to avoid a read-back.
        query_lens: host list of each sequence's query rows.
        config: launch shape, default :func:`default_config`.
        out: ``[T, Hq, D]`` of q's dtype, head_dim stride 1; default a new contiguous one.
        launches: :func:`plan_launches`' answer for these ``query_lens``, worked out ahead
            (a planned call's); ``config`` and ``max_query_len`` are then not read.

    Returns:
        ``out``: ``[total_query_tokens, Hq, D]`` in q's dtype.
    """
    # NOTE: the kernel reads head_dim, a table row and the lengths with stride 1 (the other
    # strides are passed): a copy otherwise (they are small).
    q, block_tables, seq_lens, query_start_loc = (unit_last_stride(t) for t in (
        q, block_tables, seq_lens, query_start_loc))
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = seq_lens.shape[0]
    if query_lens is not None:
        max_query_len = max(query_lens, default=0)
    elif max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max()) if batch else 0
    if q.shape[0] == 0 or max_query_len == 0:
        return out
    consts = launch_constants(q, k_cache, scale)
    consts.pop("GROUP_PAD")
    if _device.INTERPRET and q.dtype == torch.float16:
        # NumPy has no fast float16 matmul: the interpreter multiplies in float32 (as for bf16).
        consts.update(DOT_UPCAST=True, DOT_PRECISION="ieee")
    if consts["qk_scale"] < 0:  # the kernel needs a positive scale: (-q).k * |scale|
        q, consts["qk_scale"] = -q, -consts["qk_scale"]
    (k_data, v_data, *scales), formats = kv_kernel_args(k_cache, v_cache)
    consts.update(formats)
    args = (out, q, k_data, v_data, block_tables, seq_lens, query_start_loc)
    strides = (q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
               k_data.stride(0), k_data.stride(1), k_data.stride(2), *scales)
    if launches is None and config is None and query_lens is not None:
        launches = plan_launches(query_lens, q.shape[1], k_data.shape[2], q.shape[2], q.dtype,
                                 q.device)
    elif launches is None:
        config = config or default_config(q.shape[2], q.dtype)
        launches = (Launch(None, config, max_query_len, batch),)
    for one in launches:
        _launch(args, one.seq_ids, strides, consts, causal, one.config, one.max_query_len,
                one.num_seqs)
    return out


@dataclass(frozen=True)
class Launch:
    """One launch of :func:`paged_prefill_kernel`: the sequences it runs (``seq_ids``, int32 on
    the device, or None: all ``num_seqs`` of the batch in order), its tile shape, and the most
    query rows any of them has (which sizes the grid)."""

    seq_ids: torch.Tensor | None
    config: PrefillConfig
    max_query_len: int
    num_seqs: int


def plan_launches(query_lens: list[int], num_q_heads: int, num_kv_heads: int, head_dim: int,
                  dtype: torch.dtype, device: torch.device) -> tuple[Launch, ...]:
    """The launches for a batch with these host query rows: one with the default tiles; one
    with :data:`SHORT_CONFIG` when every sequence is decode-like (at most ``SHORT_CONFIG.block_m
    // GQA group`` rows); for a mixed batch, the long sequences with the default tiles and the
    short ones with small tiles, each launch's ids uploaded here. ``plan_prefill`` works this out
    once per step, so no layer copies ids to the GPU (each copy from pageable memory may wait
    for the GPU: on an H200 a 64 + 63-row mixed step took 12.4 ms where its kernels took 1.5)."""
    group = num_q_heads // num_kv_heads
    short_rows = max(1, SHORT_CONFIG.block_m // group)
    most = max(query_lens, default=0)
    if most <= short_rows:  # decode-like rows only: one launch, small tiles
        return (Launch(None, SHORT_CONFIG, most, len(query_lens)),)
    short = [b for b, n in enumerate(query_lens) if 0 < n <= short_rows]
    if not short:
        return (Launch(None, default_config(head_dim, dtype), most, len(query_lens)),)
    long_ = [b for b, n in enumerate(query_lens) if n > short_rows]
    # (a tensor each, not two slices of one: Triton compiles a pointer argument apart for
    # 16-byte aligned and unaligned addresses, and a slice's alignment follows len(long_), so a
    # step could compile a variant warm-up did not)
    long_ids, short_ids = (torch.tensor(ids, dtype=torch.int32, device=device)
                           for ids in (long_, short))
    return (Launch(long_ids, default_config(head_dim, dtype), most, len(long_)),
            Launch(short_ids, SHORT_CONFIG, max(query_lens[b] for b in short), len(short)))


def _launch(args, seq_ids, strides, consts, causal, config, max_query_len, num_seqs):
    block_m = max(config.block_m, triton.next_power_of_2(consts["GROUP"]))
    block_q = block_m // consts["GROUP"]
    num_tiles = triton.cdiv(max_query_len, block_q)
    grid = (num_tiles, args[2].shape[2], num_seqs)  # args[2]: K's data, [.., Hkv, ..]
    launch(paged_prefill_kernel, grid,
        *args, seq_ids, consts["qk_scale"], num_tiles, *strides,
        BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=config.block_n, CAUSAL=causal,
        USE_SEQ_IDS=seq_ids is not None, num_warps=config.num_warps,
        num_stages=config.num_stages,
        **{k: v for k, v in consts.items() if k != "qk_scale"},
    )


__all__ = ["SHORT_CONFIG", "Launch", "PrefillConfig", "attend_key_span", "default_config",
           "paged_prefill_kernel", "paged_prefill_triton", "plan_launches"]
