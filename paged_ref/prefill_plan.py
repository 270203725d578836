"""``plan_prefill``: plan a prefill batch once, from lengths on the host; then
``paged_prefill(..., plan=plan)`` checks only shapes, dtypes and devices and reads no tensor
value back -- FlashInfer's ``plan()`` / ``run()``, and what ``plan_decode`` is for decode.

Why: the unplanned ``paged_prefill`` checks every value (lengths, table entries) on the host,
one copy back from the GPU per call. The copy waits for the GPU to finish what it was given,
so the GPU then idles while the host checks and launches: on the H200 the public call ran at
0.52-0.78x FlashInfer where its own kernel runs at 0.83-0.91x (``results/h200/prefill.json``).
An engine knows each step's lengths on the host before it builds the tensors: it plans once per
step, and every layer's call reuses the plan::

    plan = plan_prefill(query_lens, seq_lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                        block_size=16, dtype=torch.bfloat16, device="cuda")
    for layer in layers:
        out = paged_prefill(q, k_cache, v_cache, block_tables, seq_lens_t, query_start_loc,
                            plan=plan)

A planned call trusts the tensors' values: ``seq_lens`` and ``query_start_loc`` must hold the
plan's lengths and every used table entry a block of the cache (as FlashInfer's ``run()`` trusts
its ``plan()``). Everything it can see without reading values -- sizes, dtypes, devices, a
table too short for the plan -- is checked on every call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from paged_ref import _device
from paged_ref.plan import (
    UNREADABLE,
    DecodePlan,
    check_against_plan,
    check_plan_sizes,
    host_lengths,
    plan_decode,
    triton_reads,
)
from paged_ref.quant import KVFormat
from paged_ref.validation import check_scale, check_shapes, check_tensor

PREFILL_BACKENDS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class PrefillPlan:
    """What a planned prefill call runs: ``backend`` ``"torch"``, ``"triton"`` (the prefill
    kernel; a mixed batch's short rows in a second launch with small tiles) or ``"decode"``
    (every sequence has one query row: the decode kernels of ``decode``, faster there).
    Host lengths per sequence: ``query_lens`` (query rows) and ``seq_lens`` (cache tokens).
    ``launches``: the Triton backend's kernel launches (``plan_launches``: a mixed batch's
    row ids already on the device), the same for every layer; None: worked out at the call."""

    backend: str
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    causal: bool
    scale: float | None
    kv_format: KVFormat | None = None
    decode: DecodePlan | None = None
    launches: tuple | None = field(default=None, compare=False, repr=False)

    @property
    def batch(self) -> int:
        return len(self.seq_lens)

    @property
    def total_query_tokens(self) -> int:
        return sum(self.query_lens)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens, default=0)


def plan_prefill(
    query_lens: Sequence[int],
    seq_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    scale: float | None = None,
    causal: bool = True,
    backend: str = "auto",
    kv_format=None,
) -> PrefillPlan:
    """Plan prefill attention for a batch whose lengths the caller has on the host.

    Args:
        query_lens: query rows of each sequence (ints >= 0; a list or a 1-D CPU int tensor).
        seq_lens: cache tokens of each sequence, its query rows' own included
            (``query_lens[b] <= seq_lens[b]``); as long as ``query_lens``.
        num_q_heads, num_kv_heads, head_dim, block_size: as the planned calls' ``q`` and
            caches (ints >= 1, ``num_q_heads % num_kv_heads == 0``).
        dtype: q's dtype, float16 / bfloat16 / float32.
        device: where the planned calls' tensors are.
        scale: softmax scale, default ``head_dim ** -0.5``.
        causal: as for :func:`paged_ref.paged_prefill`.
        backend: ``"auto"`` (the Triton kernels on a GPU, ``"torch"`` elsewhere), ``"torch"``
            or ``"triton"``.
        kv_format: the caches' :class:`~paged_ref.KVFormat` or its name when quantised.

    Returns:
        PrefillPlan.

    Raises:
        TypeError: a bad type. ValueError: a bad value, or a backend that cannot run on
        ``device`` here (each named).
    """
    q_lens, lens = host_lengths(query_lens), host_lengths(seq_lens)
    if len(q_lens) != len(lens):
        raise ValueError(f"query_lens has {len(q_lens)} sequences, seq_lens has {len(lens)}")
    for b, (n, s) in enumerate(zip(q_lens, lens, strict=True)):
        if n < 0 or s < 0:
            raise ValueError(f"query_lens[{b}] = {n} and seq_lens[{b}] = {s} must be >= 0")
        if n > s:
            raise ValueError(f"query_lens[{b}] = {n} > seq_lens[{b}] = {s}: the queries are the "
                             "last tokens of the sequence, so their K/V must be cached")
    sizes, device = check_plan_sizes(num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                                     device)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if backend not in PREFILL_BACKENDS:
        raise ValueError(f"backend must be one of {PREFILL_BACKENDS}, got {backend!r}")
    scale = check_scale(scale)
    kv_format = None if kv_format is None else KVFormat.parse(kv_format)
    readable = triton_reads(kv_format, head_dim)
    if backend == "auto":  # as the unplanned "auto": one row each goes to the decode kernels
        one_row = bool(q_lens) and all(n == 1 for n in q_lens)
        compiled = readable and _device.compiled_triton_on(device)
        backend = ("decode" if one_row else "triton") if compiled else "torch"
    elif backend == "triton":
        _device.check_triton_device(backend, "device", device)
        if not readable:
            raise ValueError(UNREADABLE)
    decode = plan_decode(lens, **sizes, dtype=dtype, device=device, scale=scale,
                         kv_format=kv_format) if backend == "decode" else None
    launches = None
    if backend == "triton":
        from paged_ref.kernels.triton.prefill import plan_launches

        launches = plan_launches(q_lens, num_q_heads, num_kv_heads, head_dim, dtype, device)
    return PrefillPlan(backend, tuple(q_lens), tuple(lens), *sizes.values(), dtype=dtype,
                       device=device, causal=causal, scale=scale, kv_format=kv_format,
                       decode=decode, launches=launches)


def check_planned_prefill(plan: PrefillPlan, q, k_cache, v_cache, block_tables, seq_lens,
                          query_start_loc) -> None:
    """The metadata of a planned call (no value read back) against ``plan``.

    Raises:
        TypeError: a wrong type or dtype. ValueError: a shape, device, format or size other
        than planned (named).
    """
    if not isinstance(plan, PrefillPlan):
        raise TypeError(f"plan must be a PrefillPlan (from plan_prefill), got "
                        f"{type(plan).__name__}")
    check_tensor("q", q, 3, "[total_query_tokens, num_q_heads, head_dim]")
    check_tensor("seq_lens", seq_lens, 1, "[batch]")
    check_tensor("query_start_loc", query_start_loc, 1, "[batch + 1]")
    if query_start_loc.dtype != torch.int32:
        raise TypeError(f"query_start_loc must be torch.int32, got {query_start_loc.dtype}")
    if query_start_loc.shape[0] != plan.batch + 1 or query_start_loc.device != q.device:
        raise ValueError(f"query_start_loc is [{query_start_loc.shape[0]}] on "
                         f"{query_start_loc.device}; the plan is for [{plan.batch + 1}] on "
                         f"{plan.device}")
    if q.shape[0] != plan.total_query_tokens:
        raise ValueError(f"q has {q.shape[0]} rows; the plan is for "
                         f"sum(query_lens) = {plan.total_query_tokens}")
    # (check_shapes validates a decode-shaped q [batch, Hq, D]: a stand-in, nothing copied)
    q_like = q.new_empty(()).expand(seq_lens.shape[0], q.shape[1], q.shape[2])
    shapes = check_shapes(q_like, k_cache, v_cache, block_tables, seq_lens, plan.scale)
    check_against_plan(plan, shapes, q, getattr(k_cache, "format", None))
    if getattr(k_cache, "format", None) != plan.kv_format:
        raise ValueError(f"k_cache is a {getattr(k_cache, 'format', None)} cache; the plan is "
                         f"for {plan.kv_format}")


__all__ = ["PREFILL_BACKENDS", "PrefillPlan", "check_planned_prefill", "plan_prefill"]
