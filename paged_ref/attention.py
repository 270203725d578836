"""``paged_attention``: the public entry point, one function for every backend.

A call goes down three steps and does not come back up: check the inputs
(:mod:`paged_ref.validation`), plan (:func:`paged_ref.plan.make_plan`: the one place that
decides which backend runs and how to split), run (:func:`run_plan`: one kernel wrapper, or the
torch backend of :mod:`paged_ref.reference`):

* ``"torch"``        gather through the block table, then dense attention (the reference);
* ``"triton"``       one-pass Triton paged decode kernel;
* ``"triton_split"`` split-KV Triton kernel + log-sum-exp merge;
* ``"cuda"``         the hand-written CUDA kernels for FP8 / INT4 caches
                     (:mod:`paged_ref.kernels.cuda`; a GPU with nvcc);
* ``"auto"``         the fastest valid backend for the inputs and the device.

With ``plan=`` (from :func:`paged_ref.plan_decode`) the value checks and the decision were made
once on the host: the call reads nothing back and can be captured in a CUDA graph, and its
host path is short (:mod:`paged_ref.planned`: the tensors' metadata looked up among the
plan's bindings, then launches bound once; the full checks run for tensors not seen before).

Without a plan, on a GPU, the value checks run as a Triton kernel
(:mod:`paged_ref.kernels.triton.checks`) queued *before* the attention kernel, which reads the
checked lengths (``-1`` for a row that failed: skipped, never read); the host waits for the
checks' verdict only after both are queued, so the GPU never idles waiting for the host. That
plan covers every length the table can hold, so it depends on metadata only: a later call with
the same metadata, scale and backend reuses it and its bound launches (the value checks still
run, every call: :func:`paged_ref.planned.call_unplanned`). Elsewhere the values are checked
first (one read-back).
"""

from __future__ import annotations

import torch

from paged_ref import _device
from paged_ref.plan import (
    BACKENDS,
    DecodePlan,
    check_against_plan,
    cuda_refusal_for,
    dispatch,
    make_plan,
    triton_reads,
)
from paged_ref.planned import call_planned, call_unplanned, remember_unplanned, unplanned_key
from paged_ref.reference import paged_attention_torch
from paged_ref.validation import Lengths, check_out, check_scale, check_shapes, check_values

__all__ = ["BACKENDS", "checks_on_device", "choose_backend", "paged_attention", "run_plan"]



def checks_on_device(seq_lens: torch.Tensor) -> bool:
    """Are the value checks run by the Triton check kernel (a GPU, compiled Triton)?"""
    return seq_lens.is_cuda and _device.compiled_triton_on(seq_lens.device)


def choose_backend(q: torch.Tensor, k_cache, lengths: Lengths) -> str:
    """What ``backend="auto"`` runs for these (checked) inputs: :func:`paged_ref.plan.dispatch`."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    kv_format = getattr(k_cache, "format", None)
    refusal = cuda_refusal_for("auto", kv_format, q.dtype, q.device, head_dim=head_dim,
                               group=q.shape[1] // num_kv_heads, block_size=block_size)
    return dispatch("auto", q.device, batch=q.shape[0], num_kv_heads=num_kv_heads,
                    max_len=lengths.max_len, total_tokens=lengths.total_tokens,
                    cuda_refusal=refusal, readable=triton_reads(kv_format, head_dim))[0]


def run_plan(plan: DecodePlan, q, k_cache, v_cache, block_tables, seq_lens, out=None):
    """Run a plan on inputs already checked against it (no value is read back).

    Args:
        plan: from :func:`paged_ref.plan.make_plan` / :func:`paged_ref.plan_decode`.
        q, k_cache, v_cache, block_tables, seq_lens: as for :func:`paged_attention`.
        out: None (a new contiguous output) or a checked output tensor.

    Returns:
        ``[batch, num_q_heads, head_dim]`` in q's dtype (``out`` when given).
    """
    if plan.backend == "torch":
        result = paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens,
                                       scale=plan.scale, max_len=plan.max_seq_len)
        return result if out is None else out.copy_(result)
    if out is None:  # NOTE: always contiguous, whatever q's strides
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if plan.backend == "cuda":
        if q.shape[-1] > 1 and q.stride(-1) != 1:  # (the Triton wrappers copy q themselves)
            q = q.contiguous()  # NOTE: the CUDA kernels read head_dim with stride 1
        return plan.cuda.run(q, k_cache, v_cache, block_tables, seq_lens, out)
    if plan.split is None:
        from paged_ref.kernels.triton.decode import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens,
                                      scale=plan.scale, out=out, max_seq_len=plan.max_seq_len)
    from paged_ref.kernels.triton.split import paged_attention_split

    return paged_attention_split(q, k_cache, v_cache, block_tables, seq_lens, scale=plan.scale,
                                 plan=plan.split, scratch=plan.scratch, out=out,
                                 max_seq_len=plan.max_seq_len)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
    plan: DecodePlan | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention over a paged KV cache.

    Args:
        q: ``[batch, num_q_heads, head_dim]`` float16 / bfloat16 / float32, any strides.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype, contiguous;
            or a quantised cache, :class:`paged_ref.QuantizedKV` (FP8 / INT4 codes and their
            scales, see :mod:`paged_ref.quant`), de-quantised by every backend.
        v_cache: the same shape and dtype (or QuantizedKV format) as ``k_cache``.
        block_tables: int32 ``[batch, max_blocks_per_seq]``, any strides: token ``t`` of
            sequence ``b`` is at ``k_cache[block_tables[b, t // block_size], t % block_size]``.
        seq_lens: int32 ``[batch]``, any strides; table entries past
            ``ceil(seq_lens[b] / block_size)`` are ignored.
        scale: softmax scale, default ``head_dim ** -0.5``: a Python or NumPy real number,
            finite, ``abs(scale) <= 1e4``.
        backend: ``"auto"`` (default), ``"torch"``, ``"triton"``, ``"triton_split"``,
            ``"cuda"`` (``"auto"`` runs ``"cuda"`` on FP8 / INT4 caches where those kernels
            read the call).
        plan: from :func:`paged_ref.plan_decode`: the values were checked and the backend,
            split and scratch fixed there; this call then checks shapes only, reads no tensor
            value back and is CUDA-graph capturable (``scale``/``backend`` come from the plan;
            leave them default). Without a plan, lengths and used table entries are checked
            here (one read-back; on a GPU, a check kernel whose verdict is read after the
            attention kernel is queued; the split is then planned for lengths up to the
            table's capacity).
        out: optional ``[batch, num_q_heads, head_dim]`` tensor of q's dtype and device, unit
            stride in head_dim, to write into.

    Returns:
        ``[batch, num_q_heads, head_dim]`` in q's dtype, contiguous (``out`` when given); a
        row with ``seq_lens[b] == 0``, or whose every key scores -inf, is zeros. NaN or inf
        in q or in used cache entries propagate as in the float64 reference.

    Raises:
        TypeError: bad types or dtypes. ValueError: bad shapes, devices or values, or a
        backend that cannot run on these tensors here (each named).
    """
    if type(plan) is DecodePlan and scale is None and backend == "auto":
        result = call_planned(plan, q, k_cache, v_cache, block_tables, seq_lens, out)
        if result is not None:  # (else: not bindable; the path below checks and runs it)
            return result
    elif plan is None:  # metadata seen before on a GPU: the checks' kernel and its plan
        result = call_unplanned(q, k_cache, v_cache, block_tables, seq_lens, out, scale,
                                backend)
        if result is not None:
            return result
    raw_scale = scale
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(q, torch.Tensor) and q.is_cuda and q.get_device() != torch.cuda.current_device():
        # Tensors on another GPU than the current one: run there (kernels, checks, the
        # checks' event and copy all use the current device's stream).
        with torch.cuda.device(q.device):
            return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                   backend=backend, plan=plan, out=out)
    kv_format = getattr(k_cache, "format", None)
    if plan is not None and not isinstance(plan, DecodePlan):
        raise TypeError(f"plan must come from paged_ref.plan_decode, got {type(plan).__name__}")
    if plan is not None and (scale is not None or backend != "auto"):
        raise ValueError("scale and backend are fixed by the plan: pass them to plan_decode")
    scale = check_scale(scale)
    shapes = check_shapes(q, k_cache, v_cache, block_tables, seq_lens)
    check_out(out, q)
    if plan is None and shapes.batch > 0 and checks_on_device(seq_lens) and backend != "torch" \
            and (backend != "auto" or triton_reads(kv_format, shapes.head_dim)):
        key = unplanned_key(q, k_cache, v_cache, block_tables, seq_lens, out, raw_scale, backend)
        return _checked_while_running(key, shapes, backend, scale, kv_format, q, k_cache,
                                      v_cache, block_tables, seq_lens, out)
    if plan is not None:
        check_against_plan(plan, shapes, q, kv_format)
    else:  # checked first: on a GPU one kernel and four numbers back, else on the host
        stats = None
        if shapes.batch > 0 and checks_on_device(seq_lens):
            from paged_ref.kernels.triton.checks import length_stats

            stats = length_stats(block_tables, seq_lens, shapes.block_size, shapes.num_blocks)
        lengths = check_values(block_tables, seq_lens, shapes, stats)
        plan = make_plan(backend, shapes, q.dtype, q.device, max_len=lengths.max_len,
                         total_tokens=lengths.total_tokens, max_seq_len=lengths.max_len,
                         scale=scale, kv_format=kv_format)
    return run_plan(plan, q, k_cache, v_cache, block_tables, seq_lens, out)


def unknown_lengths(shapes) -> Lengths:
    """The lengths an unplanned GPU call is planned for, before its checks have read any:
    one row as long as the table holds, the others half of that on average (a ragged batch).

    A split finer than the true lengths need costs a few partial results more; one too coarse
    leaves a long row alone in the last wave. B32_ragged (lengths 64..16,384) planned as if
    every row were full got 2 chunks of 8,128 tokens, where its lengths take 8 of 2,048.
    """
    capacity = shapes.max_blocks_per_seq * shapes.block_size if shapes.num_blocks else 0
    return Lengths(capacity, capacity + (shapes.batch - 1) * capacity // 2)  # (no blocks: 0)


def _checked_while_running(key, shapes, backend, scale, kv_format, q, k_cache, v_cache,
                           block_tables, seq_lens, out):
    """The unplanned call on a GPU, the first time with this metadata (``key``): the checks
    and the attention kernel queued together, the verdict read after both.

    NOTE: the kernels read the checked lengths (-1 for a row that failed: skipped) and the
    plan covers every length the table can hold (:func:`unknown_lengths`), so it depends on
    metadata only: it is remembered, and later calls like this one take
    :func:`paged_ref.planned.call_unplanned`.
    """
    from paged_ref.kernels.triton.checks import start_checks

    pending = start_checks(block_tables, seq_lens, shapes.block_size, shapes.num_blocks)
    lens = pending.checked_lens
    lengths = unknown_lengths(shapes)
    plan = make_plan(backend, shapes, q.dtype, q.device, max_len=lengths.max_len,
                     total_tokens=lengths.total_tokens, max_seq_len=lengths.max_len,
                     scale=scale, kv_format=kv_format)
    remember_unplanned(key, shapes, plan)
    result = call_planned(plan, q, k_cache, v_cache, block_tables, lens, out)
    if result is None:  # (not bindable)
        result = run_plan(plan, q, k_cache, v_cache, block_tables, lens, out)
    check_values(block_tables, seq_lens, shapes, pending.stats())  # raises the named error
    return result
