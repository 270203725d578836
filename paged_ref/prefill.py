"""``paged_prefill``: attention for many query tokens per sequence over the paged cache.

Prefill (a new prompt), chunked prefill (the next chunk of a long prompt) and a prefix-cache
hit (the uncached rest of a prompt) all look the same to attention: sequence ``b`` has
``seq_lens[b]`` tokens in the cache, and its last ``q_len_b`` tokens ask the questions. Their
K/V are already in the cache (a serving engine writes them through the slot mapping first).

Query rows are packed one sequence after another ("varlen"), as in FlashAttention's
``cu_seqlens_q`` and FlashInfer's ``qo_indptr``::

    q                [total_query_tokens, num_q_heads, head_dim]
    query_start_loc  int32 [batch + 1]: sequence b owns q rows [query_start_loc[b], [b+1])
    k_cache, v_cache [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables     int32 [batch, max_blocks_per_seq]
    seq_lens         int32 [batch]: tokens in the cache, the queries' own tokens included

Causal with an offset: query row ``i`` of sequence ``b`` is token
``p = seq_lens[b] - q_len_b + i`` and sees cache positions ``0 .. p``. A cached prefix is just
tokens before the queries; a decode step is ``q_len_b == 1`` (it sees everything).
``causal=False`` lets every row see all ``seq_lens[b]`` positions.

Backends: ``"torch"`` (gather, then dense masked attention: the reference), ``"triton"`` (the
tiled kernel of :mod:`paged_ref.kernels.triton.prefill`), ``"auto"`` (``"triton"`` on a GPU,
``"torch"`` on a CPU). :func:`paged_prefill_reference` is the float64 answer for tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paged_ref import _device
from paged_ref.cache_math import default_scale, token_slots
from paged_ref.quant import check_kernel_format, kernels_read
from paged_ref.reference import float64_slots, gather_kv
from paged_ref.validation import HOST_CHECK_MAX_ENTRIES, _tensor, check_shapes, check_values

PREFILL_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class PrefillLengths:
    """What the checks read back (host ints): per sequence its cache length and query rows."""

    seq_lens: list[int]
    query_lens: list[int]

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)


def check_prefill_inputs(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                         scale=None) -> PrefillLengths:
    """Every check of ``paged_attention`` plus those of ``query_start_loc``.

    Raises ``TypeError`` for bad types/dtypes and ``ValueError`` for bad shapes, devices or
    values, naming the argument. Reads values back from the device once (one copy; a table of
    more than ``HOST_CHECK_MAX_ENTRIES`` entries is checked on the device).
    """
    _tensor("q", q, 3, "[total_query_tokens, num_q_heads, head_dim]")
    _tensor("block_tables", block_tables, 2, "[batch, max_blocks_per_seq]")
    _tensor("seq_lens", seq_lens, 1, "[batch]")
    _tensor("query_start_loc", query_start_loc, 1, "[batch + 1]")
    if query_start_loc.dtype != torch.int32:
        raise TypeError(
            f"query_start_loc must be torch.int32, got {query_start_loc.dtype} "
            "(use .to(torch.int32))"
        )
    batch = seq_lens.shape[0]
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows, seq_lens has {batch}")
    if query_start_loc.shape[0] != batch + 1:
        raise ValueError(
            f"query_start_loc must have batch + 1 = {batch + 1} entries (one per sequence "
            f"plus the end), got {query_start_loc.shape[0]}"
        )
    if query_start_loc.device != q.device:
        raise ValueError(f"query_start_loc is on {query_start_loc.device} but q is on {q.device}")
    # check_shapes validates a decode-shaped q [batch, Hq, D]: hand it a stand-in with q's
    # dtype, device, heads and head_dim (one element, expanded: nothing is copied).
    q_like = q.new_empty(()).expand(batch, q.shape[1], q.shape[2])
    shapes = check_shapes(q_like, k_cache, v_cache, block_tables, seq_lens, scale)
    if block_tables.numel() <= HOST_CHECK_MAX_ENTRIES:
        # One copy to the host of everything the checks read, then the checks there.
        packed = torch.cat([query_start_loc, seq_lens, block_tables.flatten()]).cpu()
        query_start_loc, seq_lens = packed[: batch + 1], packed[batch + 1 : 2 * batch + 1]
        block_tables = packed[2 * batch + 1 :].view(block_tables.shape)
    check_values(block_tables, seq_lens, shapes)
    starts, lens = query_start_loc.tolist(), seq_lens.tolist()
    total = q.shape[0]
    if starts[0] != 0:
        raise ValueError(f"query_start_loc[0] must be 0, got {starts[0]}")
    if starts[-1] != total:
        raise ValueError(
            f"query_start_loc[-1] = {starts[-1]} must equal the rows of q ({total})"
        )
    query_lens = [starts[b + 1] - starts[b] for b in range(batch)]
    for b, n in enumerate(query_lens):
        if n < 0:
            raise ValueError(
                f"query_start_loc must be non-decreasing, but query_start_loc[{b + 1}] = "
                f"{starts[b + 1]} < query_start_loc[{b}] = {starts[b]}"
            )
    for b, n in enumerate(query_lens):
        if n > lens[b]:
            raise ValueError(
                f"sequence {b} has {n} query rows (query_start_loc[{b + 1}] - "
                f"query_start_loc[{b}]) but only seq_lens[{b}] = {lens[b]} tokens in the cache; "
                "the queries are the last tokens of the sequence, so their K/V must be cached"
            )
    return PrefillLengths(lens, query_lens)


def prefill_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                            scale=None, causal=True, lengths: PrefillLengths | None = None):
    """``backend="torch"``: per sequence, gather its K/V through the block table, then dense
    masked attention (float32 accumulation; float64 for float64 inputs).

    Inputs are assumed valid; ``lengths`` (host ints from the checks) saves reading them back.
    Returns [total_query_tokens, num_q_heads, head_dim] in q's dtype.
    """
    if lengths is None:
        starts = query_start_loc.tolist()
        lengths = PrefillLengths(seq_lens.tolist(),
                                 [starts[b + 1] - starts[b] for b in range(len(starts) - 1)])
    num_q_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    scale = default_scale(head_dim, scale)
    acc = torch.promote_types(q.dtype, torch.float32)
    out = torch.empty_like(q)
    start = 0
    for b, (seq_len, q_len) in enumerate(zip(lengths.seq_lens, lengths.query_lens, strict=True)):
        rows = slice(start, start + q_len)
        start += q_len
        if q_len == 0:
            continue
        k, v, _ = gather_kv(k_cache, v_cache, block_tables[b : b + 1], seq_lens[b : b + 1],
                            seq_len)  # [1, seq_len, Hkv, D]
        qb = q[rows].to(acc).view(q_len, num_kv_heads, group, head_dim)
        scores = torch.einsum("qhgd,khd->hgqk", qb, k[0].to(acc)) * scale  # [Hkv, G, q, k]
        if causal:
            # Row i is token seq_len - q_len + i: it sees keys 0 .. that position.
            pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
            keys = torch.arange(seq_len, device=q.device)
            scores = scores.masked_fill(keys[None, :] > pos[:, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1)  # every row sees at least its own token
        ob = torch.einsum("hgqk,khd->qhgd", probs, v[0].to(acc))
        out[rows] = ob.reshape(q_len, num_q_heads, head_dim).to(q.dtype)
    return out


def paged_prefill_reference(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                            scale=None, causal=True) -> torch.Tensor:
    """Prefill attention in float64 on the CPU, one sequence and query head at a time, written
    for clarity: the answer every backend is checked against. Returns float64 [T, Hq, D]."""
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    total, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    scale = default_scale(head_dim, scale)
    q64, k_flat, v_flat = float64_slots(q, k_cache, v_cache)
    out = torch.zeros(total, num_q_heads, head_dim, dtype=torch.float64)
    starts = query_start_loc.tolist()
    for b, seq_len in enumerate(seq_lens.tolist()):
        q_len = starts[b + 1] - starts[b]
        if q_len == 0:
            continue
        slots = torch.tensor(token_slots(block_tables[b].tolist(), seq_len, block_size))
        # Row i is token seq_len - q_len + i; causal: it sees keys 0 .. that position.
        pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        visible = torch.arange(seq_len)[None, :] <= pos if causal else torch.ones(
            q_len, seq_len, dtype=torch.bool)
        for h in range(num_q_heads):
            k = k_flat[slots, h // group]  # [seq_len, D]
            v = v_flat[slots, h // group]
            scores = (q64[starts[b] : starts[b + 1], h] @ k.T) * scale  # [q_len, seq_len]
            p = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=1)
            out[starts[b] : starts[b + 1], h] = p @ v
    return out


def _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, lengths: PrefillLengths):
    """One query row per sequence is a decode step: the decode kernels (with split-KV for long
    sequences) read the cache faster than the prefill kernel's 16-row tiles (on the H200,
    B64_L4096: 4.28 vs 3.21 TB/s, ``results/h200/prefill.json``)."""
    from paged_ref.attention import choose_backend
    from paged_ref.kernels.triton.decode import paged_attention_triton
    from paged_ref.kernels.triton.split import paged_attention_split, plan_for_inputs
    from paged_ref.validation import Lengths

    info = Lengths(lengths.max_seq_len, sum(lengths.seq_lens))
    backend = choose_backend(q, k_cache, info)
    if backend == "cuda":  # an FP8 / INT4 cache the hand-written CUDA kernels read
        from paged_ref.kernels.cuda import paged_attention_cuda

        return paged_attention_cuda(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                    max_len=info.max_len, total_tokens=info.total_tokens)
    if backend == "triton":
        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale=scale)
    return paged_attention_split(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                 plan=plan_for_inputs(q, k_cache, info))


def choose_prefill_backend(q: torch.Tensor) -> str:
    """What ``backend="auto"`` runs: the Triton kernel on a GPU (the decode kernels when every
    sequence has exactly one query row), ``"torch"`` elsewhere (the interpreter is for
    learning, not speed)."""
    if q.device.type == "cuda" and _device.HAS_TRITON and not _device.INTERPRET:
        return "triton"
    return "torch"


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float | None = None,
    causal: bool = True,
    backend: str = "auto",
) -> torch.Tensor:
    """Prefill / chunked-prefill attention over a paged KV cache.

    q               [total_query_tokens, num_q_heads, head_dim], the cache's dtype
    k_cache,v_cache [num_blocks, block_size, num_kv_heads, head_dim], contiguous; or a
                    quantised cache (:class:`paged_ref.QuantizedKV`, FP8 / INT4 codes and their
                    scales), de-quantised by both backends (the Triton kernel in registers)
    block_tables    int32 [batch, max_blocks_per_seq]; entries past a sequence's blocks ignored
    seq_lens        int32 [batch]: cached tokens per sequence, the queries' own included
    query_start_loc int32 [batch + 1]: 0, then cumulative query rows; sequence b owns rows
                    query_start_loc[b]:query_start_loc[b+1], its LAST q_len_b tokens
    scale           softmax scale, default head_dim ** -0.5
    causal          True: row i of sequence b sees positions 0 .. seq_lens[b] - q_len_b + i;
                    False: every row sees all seq_lens[b] positions

    Returns [total_query_tokens, num_q_heads, head_dim] in q's dtype.
    Raises TypeError for bad types/dtypes and ValueError for bad shapes, devices or values.
    """
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"backend must be one of {PREFILL_BACKENDS}, got {backend!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    lengths = check_prefill_inputs(q, k_cache, v_cache, block_tables, seq_lens,
                                   query_start_loc, scale)
    if backend == "auto":
        backend = choose_prefill_backend(q) if kernels_read(k_cache) else "torch"
        if backend == "triton" and lengths.query_lens and max(lengths.query_lens) == 1 and (
                min(lengths.query_lens) == 1):
            return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, lengths)
    if backend == "torch":
        return prefill_attention_torch(q, k_cache, v_cache, block_tables, seq_lens,
                                       query_start_loc, scale=scale, causal=causal,
                                       lengths=lengths)
    from paged_ref.kernels.triton.prefill import paged_prefill_triton
    from paged_ref.plan import check_backend_usable

    check_backend_usable(backend, q.device)
    check_kernel_format(k_cache)
    return paged_prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                scale=scale, causal=causal, query_lens=lengths.query_lens)


__all__ = [
    "PREFILL_BACKENDS",
    "PrefillLengths",
    "check_prefill_inputs",
    "paged_prefill",
    "paged_prefill_reference",
    "prefill_attention_torch",
]
