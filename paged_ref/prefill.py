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

import torch

from paged_ref import _device
from paged_ref.attention import run_plan
from paged_ref.cache_math import default_scale, token_slots
from paged_ref.plan import UNREADABLE, make_plan, triton_reads
from paged_ref.prefill_plan import PREFILL_BACKENDS, PrefillPlan, check_planned_prefill
from paged_ref.reference import float64_slots, gather_kv
from paged_ref.validation import PrefillLengths, check_prefill_inputs


def prefill_attention_torch(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, *,
                            scale=None, causal=True, lengths: PrefillLengths | None = None):
    """``backend="torch"``: per sequence, gather its K/V through the block table, then dense
    masked attention (float32 accumulation; float64 for float64 inputs). Inputs are assumed
    valid.

    Args:
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, causal: as for
            :func:`paged_prefill`.
        lengths: the checks' host lengths; given, nothing is read back from the device.

    Returns:
        ``[total_query_tokens, num_q_heads, head_dim]`` in q's dtype, contiguous.
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
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
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
    for clarity: the answer every backend is checked against.

    Args:
        q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, causal: as for
            :func:`paged_prefill` (any float dtype; QuantizedKV caches are de-quantised).

    Returns:
        float64 ``[total_query_tokens, num_q_heads, head_dim]`` on the CPU.
    """
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
    sequences, or the CUDA kernels on FP8 / INT4 caches) read the cache faster than the
    prefill kernel's 16-row tiles (on the H200, B64_L4096: 4.28 vs 3.21 TB/s). The checks
    are done: plan (:func:`paged_ref.plan.make_plan`) and run."""
    plan = make_plan("auto", lengths.shapes, q.dtype, q.device, max_len=lengths.max_seq_len,
                     total_tokens=sum(lengths.seq_lens), max_seq_len=lengths.max_seq_len,
                     scale=scale, kv_format=getattr(k_cache, "format", None))
    return run_plan(plan, q, k_cache, v_cache, block_tables, seq_lens)


def choose_prefill_backend(q: torch.Tensor) -> str:
    """What ``backend="auto"`` runs: the Triton kernel on a GPU (the decode kernels when every
    sequence has exactly one query row), ``"torch"`` elsewhere (the interpreter is for
    learning, not speed)."""
    return "triton" if _device.compiled_triton_on(q.device) else "torch"


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
    plan: PrefillPlan | None = None,
) -> torch.Tensor:
    """Prefill / chunked-prefill attention over a paged KV cache.

    Args:
        q: ``[total_query_tokens, num_q_heads, head_dim]``, the cache's dtype (any compute
            dtype for a quantised cache), any strides.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, contiguous; or
            quantised caches (:class:`paged_ref.QuantizedKV`, FP8 / INT4 codes and their
            scales), de-quantised by both backends (the Triton kernel in registers).
        block_tables: int32 ``[batch, max_blocks_per_seq]``; entries past a sequence's blocks
            are ignored.
        seq_lens: int32 ``[batch]``: cached tokens per sequence, the queries' own included.
        query_start_loc: int32 ``[batch + 1]``: 0, then cumulative query rows; sequence ``b``
            owns rows ``query_start_loc[b]:query_start_loc[b+1]``, its LAST ``q_len_b`` tokens.
        scale: softmax scale, default ``head_dim ** -0.5`` (a real number, as for
            :func:`paged_ref.paged_attention`).
        causal: True: row ``i`` of sequence ``b`` sees positions ``0 .. seq_lens[b] - q_len_b
            + i``; False: every row sees all ``seq_lens[b]`` positions.
        backend: ``"auto"`` (default), ``"torch"`` or ``"triton"``.
        plan: from :func:`paged_ref.plan_prefill` for these lengths: then only shapes,
            dtypes and devices are checked, no value is read back (the plan holds the
            backend, scale and causal: leave those arguments at their defaults).

    Returns:
        ``[total_query_tokens, num_q_heads, head_dim]`` in q's dtype, contiguous. NaN or inf
        in q or in used cache entries propagate as in the float64 reference.

    Raises:
        TypeError: bad types or dtypes. ValueError: bad shapes, devices or values, or a
        backend that cannot run on these tensors here (each named).
    """
    if plan is not None:
        return _planned(plan, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                        scale=scale, causal=causal, backend=backend)
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"backend must be one of {PREFILL_BACKENDS}, got {backend!r}")
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    lengths = check_prefill_inputs(q, k_cache, v_cache, block_tables, seq_lens,
                                   query_start_loc, scale)
    scale = None if scale is None else float(scale)
    readable = triton_reads(getattr(k_cache, "format", None), lengths.shapes.head_dim)
    if backend == "auto":
        backend = choose_prefill_backend(q) if readable else "torch"
        if backend == "triton" and lengths.query_lens and max(lengths.query_lens) == 1 and (
                min(lengths.query_lens) == 1):
            return _decode(q, k_cache, v_cache, block_tables, seq_lens, scale, lengths)
    if backend == "torch":
        return prefill_attention_torch(q, k_cache, v_cache, block_tables, seq_lens,
                                       query_start_loc, scale=scale, causal=causal,
                                       lengths=lengths)
    _device.check_triton_device(backend, "q", q.device)
    if not readable:
        raise ValueError(UNREADABLE)
    from paged_ref.kernels.triton.prefill import paged_prefill_triton

    return paged_prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                scale=scale, causal=causal, query_lens=lengths.query_lens)


def _planned(plan, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, **given):
    """``paged_prefill(..., plan=plan)``: the metadata checked against the plan, then the
    planned backend on the plan's host lengths (no value read back)."""
    defaults = {"scale": None, "causal": True, "backend": "auto"}
    set_too = [k for k, v in given.items() if v != defaults[k]]
    if set_too:
        raise ValueError(f"{', '.join(set_too)}: the plan's (plan_prefill(..., "
                         f"{set_too[0]}=...)), not given with plan=")
    check_planned_prefill(plan, q, k_cache, v_cache, block_tables, seq_lens, query_start_loc)
    if plan.backend == "decode":
        return run_plan(plan.decode, q, k_cache, v_cache, block_tables, seq_lens)
    lengths = PrefillLengths(list(plan.seq_lens), list(plan.query_lens))
    if plan.backend == "torch":
        return prefill_attention_torch(q, k_cache, v_cache, block_tables, seq_lens,
                                       query_start_loc, scale=plan.scale, causal=plan.causal,
                                       lengths=lengths)
    from paged_ref.kernels.triton.prefill import paged_prefill_triton

    return paged_prefill_triton(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
                                scale=plan.scale, causal=plan.causal,
                                query_lens=lengths.query_lens, launches=plan.launches)


__all__ = [
    "PREFILL_BACKENDS",
    "PrefillLengths",
    "check_prefill_inputs",
    "paged_prefill",
    "paged_prefill_reference",
    "prefill_attention_torch",
]
