"""``paged_attention``: the public entry point, one function for every backend.

It checks the inputs (see :mod:`paged_ref.validation`), asks :func:`paged_ref.plan.dispatch`
(the one place that decides) which backend runs and how to split, then runs it:

* ``"torch"``        gather through the block table, then dense attention (the reference);
* ``"triton"``       one-pass Triton paged decode kernel;
* ``"triton_split"`` split-KV Triton kernel + log-sum-exp merge;
* ``"cuda"``         the hand-written CUDA kernels for FP8 / INT4 caches
                     (:mod:`paged_ref.kernels.cuda`; a GPU with nvcc);
* ``"auto"``         the fastest valid backend for the inputs and the device.

With ``plan=`` (from :func:`paged_ref.plan_decode`) the value checks and the decision were made
once on the host: the call reads nothing back and can be captured in a CUDA graph.

Without a plan, on a GPU, the checks run as a kernel queued *before* the attention kernel, which
reads the checked lengths (``-1`` for a row that failed: skipped, never read); the host waits
for the checks' verdict only after both are queued (:func:`checked_while_running`), so the GPU
never idles waiting for the host. Elsewhere the values are checked first (one read-back).
"""

from __future__ import annotations

import torch

from paged_ref.plan import (
    BACKENDS,
    DecodePlan,
    check_against_plan,
    cuda_refusal_for,
    dispatch,
    make_plan,
)
from paged_ref.quant import check_kernel_format, kernels_read
from paged_ref.reference import paged_attention_torch
from paged_ref.validation import (
    Lengths,
    Shapes,
    check_out,
    check_shapes,
    check_values,
    checks_on_device,
    lengths_from_stats,
)

__all__ = ["BACKENDS", "checked_while_running", "choose_backend", "paged_attention", "run_plan"]


def choose_backend(q: torch.Tensor, k_cache: torch.Tensor, lengths: Lengths) -> str:
    """What ``backend="auto"`` runs for these inputs (see :func:`paged_ref.plan.dispatch`)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    refusal = cuda_refusal_for("auto", getattr(k_cache, "format", None), q.dtype, q.device,
                               head_dim=head_dim, group=q.shape[1] // num_kv_heads,
                               block_size=block_size)
    return dispatch("auto", q.device, batch=q.shape[0], num_kv_heads=num_kv_heads,
                    max_len=lengths.max_len, total_tokens=lengths.total_tokens,
                    cuda_refusal=refusal)[0]


def run_plan(plan: DecodePlan, q, k_cache, v_cache, block_tables, seq_lens, out=None):
    """Run a plan on inputs already checked against it (no value is read back)."""
    if plan.backend == "cuda":
        return plan.cuda.run(q, k_cache, v_cache, block_tables, seq_lens, out)
    if plan.backend == "torch":
        result = paged_attention_torch(q, k_cache, v_cache, block_tables, seq_lens,
                                       scale=plan.scale, max_len=plan.max_seq_len)
        return result if out is None else out.copy_(result)
    if plan.split is None:
        from paged_ref.kernels.triton.decode import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens,
                                      scale=plan.scale, out=out, max_seq_len=plan.max_seq_len)
    from paged_ref.kernels.triton.split import paged_attention_split

    return paged_attention_split(q, k_cache, v_cache, block_tables, seq_lens, scale=plan.scale,
                                 plan=plan.split, scratch=plan.scratch, out=out,
                                 max_seq_len=plan.max_seq_len)


def checked_while_running(backend: str, shapes: Shapes, q, k_cache, v_cache, block_tables,
                          seq_lens, scale, out):
    """An unplanned call of a Triton backend on a GPU, with no wait before the launch.

    1. queue the check kernel (it writes ``checked_lens``: ``seq_lens``, ``-1`` for a bad row)
       and the copy of its verdict to the host;
    2. plan from what the shapes say: every length may be up to the table's capacity
       (``max_blocks_per_seq * block_size``; the plan is right for any shorter one);
    3. queue the attention kernel(s) on ``checked_lens``;
    4. wait for the verdict only (a CUDA event after the check kernel): raise the named error
       if a check failed (rows of ``out`` with valid inputs may have been written then).
    """
    from paged_ref.kernels.triton.checks import start_checks

    pending = start_checks(block_tables, seq_lens, shapes.block_size, shapes.num_blocks)
    capacity = shapes.max_blocks_per_seq * shapes.block_size
    plan = make_plan(backend, shapes, q.dtype, q.device, max_len=capacity,
                     total_tokens=shapes.batch * capacity, max_seq_len=capacity, scale=scale,
                     kv_format=getattr(k_cache, "format", None))
    result = run_plan(plan, q, k_cache, v_cache, block_tables, pending.checked_lens, out)
    lengths_from_stats(pending.stats(), block_tables, seq_lens, shapes)
    return result


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

    q            [batch, num_q_heads, head_dim]  float16 / bfloat16 / float32, any strides
    k_cache      [num_blocks, block_size, num_kv_heads, head_dim]  same dtype as q, contiguous;
                 or a quantised cache, :class:`paged_ref.QuantizedKV` (FP8 / INT4 codes and
                 their scales, see :mod:`paged_ref.quant`), de-quantised by every backend
    v_cache      same shape and dtype (or QuantizedKV format) as k_cache
    block_tables [batch, max_blocks_per_seq] int32 (any strides): token t of sequence b is at
                 k_cache[block_tables[b, t // block_size], t % block_size]
    seq_lens     [batch] int32 (any strides); table entries past ceil(seq_lens[b] / block_size)
                 are ignored
    scale        softmax scale, default head_dim ** -0.5; abs(scale) <= 1e4
    backend      "auto" (default), "torch", "triton", "triton_split", "cuda" ("auto" runs
                 "cuda" on FP8 / INT4 caches where those kernels read the call)
    plan         from :func:`paged_ref.plan_decode`: the values were checked and the backend,
                 split and scratch fixed there; this call then checks shapes only, reads no
                 tensor value back and is CUDA-graph capturable (``scale``/``backend`` come
                 from the plan; leave them default). Without a plan, lengths and used table
                 entries are checked here (one read-back; on a GPU, a check kernel whose
                 verdict is read after the attention kernel is queued; the split is then
                 planned for lengths up to the table's capacity).
    out          optional [batch, num_q_heads, head_dim] tensor of q's dtype to write into

    Returns [batch, num_q_heads, head_dim] in q's dtype (``out`` when given); a row with
    seq_lens[b] == 0, or whose every key scores -inf, is zeros.
    Raises TypeError for bad types/dtypes and ValueError for bad shapes, devices or values.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if isinstance(q, torch.Tensor) and q.is_cuda and q.get_device() != torch.cuda.current_device():
        # Tensors on another GPU than the current one: run there (kernels, checks, the
        # checks' event and copy all use the current device's stream).
        with torch.cuda.device(q.device):
            return paged_attention(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                                   backend=backend, plan=plan, out=out)
    if plan is not None:
        if not isinstance(plan, DecodePlan):
            raise TypeError(f"plan must come from paged_ref.plan_decode, got {type(plan).__name__}")
        if scale is not None or backend != "auto":
            raise ValueError("scale and backend are fixed by the plan: pass them to plan_decode")
        shapes = check_shapes(q, k_cache, v_cache, block_tables, seq_lens)
        check_against_plan(plan, shapes, q)
    else:
        shapes = check_shapes(q, k_cache, v_cache, block_tables, seq_lens, scale)
        if backend == "auto" and not kernels_read(k_cache):
            backend = "torch"  # a quantised layout the Triton kernels do not read
        if backend != "torch" and shapes.batch and checks_on_device(seq_lens):
            if out is not None:
                check_out(out, q)
            check_kernel_format(k_cache)
            return checked_while_running(backend, shapes, q, k_cache, v_cache, block_tables,
                                         seq_lens, scale, out)
        lengths = check_values(block_tables, seq_lens, shapes)
        plan = make_plan(backend, shapes, q.dtype, q.device, max_len=lengths.max_len,
                         total_tokens=lengths.total_tokens, max_seq_len=lengths.max_len,
                         scale=scale, kv_format=getattr(k_cache, "format", None))
    if out is not None:
        check_out(out, q)
    if plan.backend != "torch":
        check_kernel_format(k_cache)
    return run_plan(plan, q, k_cache, v_cache, block_tables, seq_lens, out)
