"""``backend="triton_split"``: split-KV (flash-decoding) with a log-sum-exp merge.

One program per (sequence, KV head) gives only ``batch x num_kv_heads`` programs: 8 for one
long sequence with 8 KV heads, on a GPU with 132 multiprocessors. Split-KV cuts each sequence
into chunks of ``chunk_size`` tokens and runs one program per (sequence, KV head, chunk):

* stage 1 (:func:`split_kv_kernel`): each program runs the online softmax of
  :func:`paged_ref.kernels.triton.decode.attend_tokens` over its chunk and writes the
  normalised partial output ``o_c`` and its log-sum-exp ``lse_c`` (log2 units);
* stage 2 (:func:`merge_heads`): ``out = sum_c w_c o_c`` with
  ``w_c = 2^(lse_c - lse)``, ``lse = log2(sum_c 2^lse_c)``; done by a second kernel
  (:func:`merge_kernel`), or, with ``SplitPlan(fused_merge=True)``, inside the split kernel
  by the last program of each (sequence, KV head) to finish (an atomic counter): one launch.
  Measured on an H200 the fused merge was slower (see ``FUSED_MERGE_MAX_CHUNKS``), so plans
  use the second kernel; under a CUDA graph the second launch costs no host time anyway.

:func:`plan_split` picks ``chunk_size`` from the batch, the KV heads, the lengths and the
number of multiprocessors; it depends only on those numbers, so the result is deterministic.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_ref.cache_math import split_chunks
from paged_ref.kernels.triton.decode import (
    KernelConfig,
    attend_tokens,
    default_config,
    launch_constants,
    load_group_queries,
    paged_attention_triton,
    prepare_out,
    unit_last_stride,
)
from paged_ref.kernels.triton.kv_formats import kv_kernel_args
from paged_ref.kernels.triton.launch import launch
from paged_ref.validation import Lengths

#: Programs that run at once on one multiprocessor (a rough figure for these kernels).
PROGRAMS_PER_SM = 4
#: Split only when the longest sequence is this many times an even share of the work.
IMBALANCE = 1.5
#: Never split finer than this many tokens: each chunk costs a partial write and a merge read.
MIN_CHUNK = 256
#: Chunks merged per step of :func:`merge_heads` (the merge kernel's; see fused_chunk_tile).
CHUNK_TILE = 16
#: The fused merge holds [GQA group, chunks, head_dim] partials in registers at once: at most
#: this many values (64 float32 registers a thread at 4 warps), so big groups take fewer chunks
#: a step.
MERGE_TILE_ELEMENTS = 8192
#: Plans with at most this many chunks merge inside the split kernel (one launch). 0: never.
#: Measured on an H200 (results/h200/decode.json, 2026-11-30, fused for B4_L2048, B8_L32768,
#: B32_ragged): slower than the separate merge kernel of the previous run (chunks.json) on each:
#: B4_L2048 0.0203 vs 0.0134 ms replayed from a CUDA graph, B8 93.6 vs 95.5 %, B32_ragged
#: 84.8 vs 90.5 % of copy bandwidth; the last program's serial merge (and the merge code's
#: registers in every program) cost more than the second launch saves.
FUSED_MERGE_MAX_CHUNKS = 0
#: ...but outside a CUDA graph a launch costs host time, and a small call is bound by it: plans
#: with at most this much work (tokens x KV heads) merge inside the split kernel when run
#: eagerly, and use the second kernel when captured. Measured on an H200 (B4_L2048, 65,536
#: token-heads, planned eager calls): 0.0291 ms fused (results/h200/decode.json) vs 0.0345 ms
#: with the merge kernel (bench_separate_merge.json); replayed from a graph, 0.0291 vs 0.0226.
EAGER_FUSED_MAX_WORK = 1 << 17


@dataclass(frozen=True)
class SplitPlan:
    """How the sequences are cut: ``num_chunks`` chunks of ``chunk_size`` tokens (the last
    chunk of a sequence may be short; chunks past a sequence's end do nothing).

    ``fused_merge``: the last program to finish a (sequence, KV head) merges its chunks itself
    (an atomic counter tells it that it is last), so the whole call is one launch (for any
    chunk count; :func:`plan_split` asks for it up to ``FUSED_MERGE_MAX_CHUNKS``, measured
    slower, so never by default). Otherwise a second kernel merges."""

    chunk_size: int
    num_chunks: int
    fused_merge: bool = False
    eager_fused_merge: bool = False  # fused when run eagerly, merge kernel when captured


@functools.lru_cache(maxsize=None)
def num_multiprocessors(device: torch.device | str | None = None) -> int:
    """Streaming multiprocessors of the CUDA device (132 on an H100/H200 SXM); 132 on a CPU,
    so that plans made in the interpreter look like the ones made on a GPU."""
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        return torch.cuda.get_device_properties(device or 0).multi_processor_count
    return 132


def plan_split(
    *,
    batch: int,
    num_kv_heads: int,
    max_len: int,
    total_tokens: int,
    num_sms: int = 132,
    tile: int = 64,
    programs_per_sm: int = PROGRAMS_PER_SM,
    min_chunk: int = MIN_CHUNK,
) -> SplitPlan:
    """Chunk size and count for ``batch`` sequences holding ``total_tokens`` tokens in all.

    The GPU runs about ``slots = num_sms x programs_per_sm`` programs at once, and the work is
    ``total_tokens x num_kv_heads`` token-heads, so an even share is ``work / slots`` tokens per
    program. Without splitting, one program walks a whole sequence, so the longest sequence
    sets the time. Split only when ``max_len`` exceeds the even share by ``IMBALANCE``; then cut
    into equal chunks of about the even share (at least ``min_chunk``, a multiple of ``tile``),
    half of it when the lengths are ragged (the longest well above the mean).
    Uses only these numbers, so the plan (and the result) is the same on every call.
    """
    if max_len <= 0:
        return SplitPlan(chunk_size=1, num_chunks=1)
    share = total_tokens * num_kv_heads / (num_sms * programs_per_sm)
    if max_len <= IMBALANCE * share:
        return SplitPlan(chunk_size=max_len, num_chunks=1)
    if max_len > IMBALANCE * total_tokens / batch:
        # Ragged batch: every sequence ends in a partial chunk, so programs differ in length;
        # cutting twice as fine evens out the last wave.
        share /= 2
    # Cut the longest sequence into equal chunks of about the even share (never a short tail).
    num_chunks = max(1, round(max_len / max(share, min_chunk)))
    chunk, num_chunks = split_chunks(max_len, num_chunks, tile)
    if num_chunks == 1:
        return SplitPlan(chunk_size=max_len, num_chunks=1)
    return SplitPlan(chunk_size=chunk, num_chunks=num_chunks,
                     fused_merge=num_chunks <= FUSED_MERGE_MAX_CHUNKS,
                     eager_fused_merge=total_tokens * num_kv_heads <= EAGER_FUSED_MAX_WORK)


def plan_for_inputs(q: torch.Tensor, k_cache: torch.Tensor, lengths: Lengths) -> SplitPlan:
    """:func:`plan_split` for these inputs on their device (``lengths`` from the checks)."""
    return plan_split(
        batch=q.shape[0], num_kv_heads=k_cache.shape[2], max_len=lengths.max_len,
        total_tokens=lengths.total_tokens, num_sms=num_multiprocessors(q.device),
    )


@triton.jit
def merge_heads(
    out_ptr, part_out_ptr, part_lse_ptr, b, head0, num_heads, used, stride_ob, stride_oh,
    num_q_heads, num_chunks, HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr, CHUNK_TILE: tl.constexpr,
):
    """out[b, h] = sum_c 2^(lse_c - lse) o_c over chunks c < ``used`` (zeros when none), for
    the ``num_heads`` heads ``head0, head0 + 1, ...`` at once (``HEADS`` >= num_heads, a power
    of 2: the fused merge does a whole GQA group, the merge kernel one head).

    One pass over the chunks, CHUNK_TILE at a time, with a running max (as the online softmax
    does; all ``-inf`` adds nothing): each step loads the log-sum-exps and the partials together,
    so a plan of up to CHUNK_TILE chunks waits for memory once, not once per head and pass.
    Partials are loaded with ``.cg`` (L2, not L1): other programs wrote them.
    """
    offs_h = tl.arange(0, HEADS)
    offs_c = tl.arange(0, CHUNK_TILE)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    h_mask = offs_h < num_heads
    d_mask = offs_d < HEAD_DIM
    rows = (b * num_q_heads + head0 + offs_h) * num_chunks  # [HEADS] first chunk of each head
    m = tl.full([HEADS], float("-inf"), dtype=tl.float32)
    total = tl.zeros([HEADS], dtype=tl.float32)
    acc = tl.zeros([HEADS, HEAD_DIM_PAD], dtype=tl.float32)
    for c0 in range(0, used, CHUNK_TILE):
        hc_mask = h_mask[:, None] & (c0 + offs_c < used)[None, :]
        chunk = rows[:, None] + c0 + offs_c[None, :]  # [HEADS, CHUNK_TILE]
        lse = tl.load(part_lse_ptr + chunk, mask=hc_mask, other=float("-inf"),
                      cache_modifier=".cg")
        parts = tl.load(part_out_ptr + chunk[:, :, None].to(tl.int64) * HEAD_DIM
                        + offs_d[None, None, :], mask=hc_mask[:, :, None]
                        & d_mask[None, None, :], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, tl.max(lse, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        w = tl.exp2(lse - m_safe[:, None])  # 0 where lse is -inf (masked or empty chunks)
        acc = acc * alpha[:, None] + tl.sum(parts * w[:, :, None], axis=1)
        total = total * alpha + tl.sum(w, axis=1)
        m = m_new
    out = acc / tl.where(total > 0, total, 1.0)[:, None]  # empty sequence -> zeros
    ptrs = out_ptr + b * stride_ob + (head0 + offs_h)[:, None] * stride_oh + offs_d[None, :]
    tl.store(ptrs, out.to(out_ptr.dtype.element_ty), mask=h_mask[:, None] & d_mask[None, :])


@triton.jit
def split_kv_kernel(
    part_out_ptr,  # [batch, num_q_heads, num_chunks, HEAD_DIM] fp32, normalised partial outputs
    part_lse_ptr,  # [batch, num_q_heads, num_chunks] fp32, log2-sum-exp of each chunk
    counter_ptr,  # [batch, num_kv_heads] int32, zero between launches (FUSED_MERGE only)
    out_ptr,  # [batch, num_q_heads, HEAD_DIM] (FUSED_MERGE only)
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, seq_lens_ptr, qk_scale, chunk_size,
    max_seq_len, stride_qb, stride_qh, stride_ob, stride_oh, stride_bt,
    stride_kb, stride_kt, stride_kh,
    k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr, stride_sb, stride_st, stride_sh,
    num_q_heads, num_chunks,
    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, TILE: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr,
    FUSED_MERGE: tl.constexpr, CHUNK_TILE: tl.constexpr, GROUP_P2: tl.constexpr,
    KV_FORMAT: tl.constexpr, INT4_GROUPS: tl.constexpr, PREFETCH: tl.constexpr,
):
    """Grid (batch, num_kv_heads, num_chunks): attention over one chunk of one sequence.

    With FUSED_MERGE, each program that wrote a chunk adds 1 to its (sequence, KV head)
    counter; the one that sees ``used - 1`` (the last to finish) merges the group's heads and
    resets the counter to 0 for the next launch. An empty sequence is written (zeros) by chunk 0.
    A row of length ``-1`` (one the value checks rejected) is skipped: nothing read or written.
    """
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    c = tl.program_id(2)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_seq_len)
    used = tl.cdiv(seq_len, chunk_size)  # chunks that hold tokens of this sequence
    start = c * chunk_size
    if start < seq_len:  # chunks past the end of this sequence have nothing to do
        end = tl.minimum(start + chunk_size, seq_len)
        q = load_group_queries(q_ptr, b, kv_head, stride_qb, stride_qh,
                               GROUP, GROUP_PAD, HEAD_DIM, HEAD_DIM_PAD)
        if DOT_UPCAST:
            q = q.to(tl.float32)
        acc, m, l = attend_tokens(
            q, k_cache_ptr, v_cache_ptr, block_tables_ptr + b.to(tl.int64) * stride_bt, kv_head,
            start, end, qk_scale, stride_kb, stride_kt, stride_kh,
            BLOCK_SIZE, HEAD_DIM, HEAD_DIM_PAD, GROUP_PAD, TILE, DOT_PRECISION, DOT_UPCAST,
            k_scale_ptr, v_scale_ptr, k_zero_ptr, v_zero_ptr, stride_sb, stride_st, stride_sh,
            KV_FORMAT, INT4_GROUPS, PREFETCH,
        )
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        heads = kv_head * GROUP + offs_g
        g_mask = offs_g < GROUP
        row = (b * num_q_heads + heads) * num_chunks + c  # [GROUP_PAD] index into part_lse
        tl.store(part_lse_ptr + row, m + tl.log2(l), mask=g_mask)  # -inf when l == 0
        ptrs = part_out_ptr + row[:, None].to(tl.int64) * HEAD_DIM + offs_d[None, :]
        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(ptrs, o, mask=g_mask[:, None] & (offs_d < HEAD_DIM)[None, :])
        if FUSED_MERGE:
            tl.debug_barrier()  # every thread's partial stores come before the release below
            counter = counter_ptr + b * tl.num_programs(1) + kv_head
            done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if done == used - 1:  # the last chunk of this group to finish: merge
                merge_heads(out_ptr, part_out_ptr, part_lse_ptr, b, kv_head * GROUP, GROUP,
                            used, stride_ob, stride_oh, num_q_heads, num_chunks,
                            GROUP_P2, HEAD_DIM, HEAD_DIM_PAD, CHUNK_TILE)
                tl.store(counter, 0)
    else:
        if FUSED_MERGE:
            if (c == 0) & (seq_len == 0):  # an empty sequence (c == 0 is past its end): zeros
                merge_heads(out_ptr, part_out_ptr, part_lse_ptr, b, kv_head * GROUP, GROUP, 0,
                            stride_ob, stride_oh, num_q_heads, num_chunks,
                            GROUP_P2, HEAD_DIM, HEAD_DIM_PAD, CHUNK_TILE)


@triton.jit
def merge_kernel(
    out_ptr, part_out_ptr, part_lse_ptr, seq_lens_ptr, chunk_size, max_seq_len,
    stride_ob, stride_oh, num_q_heads, num_chunks,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, CHUNK_TILE: tl.constexpr,
):
    """Grid (batch, num_q_heads): out[b, h] from the chunks of sequence b (:func:`merge_heads`);
    a row of length ``-1`` (rejected by the value checks) is left as it is."""
    b = tl.program_id(0)
    seq_len = tl.minimum(tl.load(seq_lens_ptr + b), max_seq_len)
    if seq_len >= 0:
        merge_heads(out_ptr, part_out_ptr, part_lse_ptr, b, tl.program_id(1), 1,
                    tl.cdiv(seq_len, chunk_size), stride_ob, stride_oh, num_q_heads, num_chunks,
                    1, HEAD_DIM, HEAD_DIM_PAD, CHUNK_TILE)


@dataclass
class SplitScratch:
    """Buffers a split launch writes: partial outputs and log-sum-exps, and the fused merge's
    counters (zeros; each launch leaves them zero). A plan allocates them once."""

    part_out: torch.Tensor  # [batch, num_q_heads, num_chunks, head_dim] float32
    part_lse: torch.Tensor  # [batch, num_q_heads, num_chunks] float32
    counters: torch.Tensor  # [batch, num_kv_heads] int32 (fused merge only; else unused)

    @classmethod
    def allocate(cls, batch: int, num_q_heads: int, num_kv_heads: int, head_dim: int,
                 plan: SplitPlan, device) -> SplitScratch:
        f32 = dict(dtype=torch.float32, device=device)
        return cls(
            part_out=torch.empty(batch, num_q_heads, plan.num_chunks, head_dim, **f32),
            part_lse=torch.empty(batch, num_q_heads, plan.num_chunks, **f32),
            # zeros only where the fused merge counts (a memset is a launch); else a stand-in
            counters=torch.zeros(batch, num_kv_heads, dtype=torch.int32, device=device)
            if plan.fused_merge or plan.eager_fused_merge
            else torch.empty(1, dtype=torch.int32, device=device),
        )


def fused_chunk_tile(heads: int, head_dim_pad: int) -> int:
    """Chunks a step of the fused merge of ``heads`` (a power of 2) heads: CHUNK_TILE, fewer
    when ``heads x chunks x head_dim_pad`` would pass ``MERGE_TILE_ELEMENTS``."""
    return max(1, min(CHUNK_TILE, MERGE_TILE_ELEMENTS // (heads * head_dim_pad)))


def capturing(t: torch.Tensor) -> bool:
    """Is ``t``'s stream being captured into a CUDA graph (where launches cost no host time)?"""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def paged_attention_split(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    plan: SplitPlan | None = None,
    max_len: int | None = None,
    config: KernelConfig | None = None,
    out: torch.Tensor | None = None,
    scratch: SplitScratch | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """Split-KV decode. Inputs as in ``paged_attention`` (already checked).

    ``plan`` fixes the chunking (else :func:`plan_split` is called, which reads the lengths
    back from the device). ``scratch`` (from a plan; else allocated here) holds the partials.
    Lengths are clamped to ``max_seq_len`` (default: what the table holds), which must not
    exceed ``plan.num_chunks * plan.chunk_size``. Returns [batch, num_q_heads, head_dim] in
    q's dtype.
    """
    config = config or default_config(q, k_cache)
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out, done = prepare_out(out, q, k_cache)
    if done:
        return out
    if plan is None:
        max_len = int(seq_lens.max()) if max_len is None else max_len
        plan = plan_for_inputs(q, k_cache, Lengths(max_len, int(seq_lens.sum())))
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * k_cache.shape[1]
    if plan.num_chunks == 1:  # one chunk per sequence is the one-pass kernel, with no merge
        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                      config=config, out=out, max_seq_len=max_seq_len)
    max_seq_len = min(max_seq_len, plan.num_chunks * plan.chunk_size)
    q, block_tables, seq_lens = (unit_last_stride(t) for t in (q, block_tables, seq_lens))
    consts = launch_constants(q, k_cache, scale)
    qk_scale = consts.pop("qk_scale")
    if scratch is None:
        scratch = SplitScratch.allocate(batch, num_q_heads, num_kv_heads, head_dim, plan,
                                        q.device)
    (k_data, v_data, *scales), formats = kv_kernel_args(k_cache, v_cache)
    fused = plan.fused_merge or (plan.eager_fused_merge and not capturing(q))
    group_p2 = triton.next_power_of_2(consts["GROUP"])
    launch(
        split_kv_kernel, (batch, num_kv_heads, plan.num_chunks),
        scratch.part_out, scratch.part_lse, scratch.counters, out,
        q, k_data, v_data, block_tables, seq_lens, qk_scale, plan.chunk_size, max_seq_len,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), block_tables.stride(0),
        k_data.stride(0), k_data.stride(1), k_data.stride(2), *scales,
        num_q_heads, plan.num_chunks,
        TILE=config.tile, PREFETCH=config.prefetch, **config.launch_options(),
        FUSED_MERGE=fused,
        CHUNK_TILE=fused_chunk_tile(group_p2, consts["HEAD_DIM_PAD"]), GROUP_P2=group_p2,
        **consts, **formats,
    )
    if not fused:
        launch(
            merge_kernel, (batch, num_q_heads),
            out, scratch.part_out, scratch.part_lse, seq_lens, plan.chunk_size, max_seq_len,
            out.stride(0), out.stride(1), num_q_heads, plan.num_chunks,
            HEAD_DIM=head_dim, HEAD_DIM_PAD=consts["HEAD_DIM_PAD"],
            CHUNK_TILE=CHUNK_TILE, num_warps=4,
        )
    return out
