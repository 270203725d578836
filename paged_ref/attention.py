"""``paged_attention``: the public entry point, one function for every backend.

It checks the inputs (see :mod:`paged_ref.validation`), then hands them to a backend:

* ``"torch"``        gather through the block table, then dense attention (the reference);
* ``"triton"``       one-pass Triton paged decode kernel;
* ``"triton_split"`` split-KV Triton kernel + log-sum-exp merge;
* ``"auto"``         the fastest valid backend for the inputs and the device.
"""

from __future__ import annotations

import torch

from paged_ref import _device
from paged_ref.reference import paged_attention_torch
from paged_ref.validation import Lengths, check_shapes, check_values

BACKENDS = ("auto", "torch", "triton", "triton_split")


def _check_triton_usable(backend: str, q: torch.Tensor) -> None:
    if not _device.HAS_TRITON:
        raise RuntimeError(
            f"backend={backend!r} needs the triton package, which is not installed here "
            "(Triton has no wheels for macOS or Windows); use backend='torch'"
        )
    want = _device.triton_device()
    if q.device.type != want:
        where = "compiled for the GPU" if want == "cuda" else "run by Triton's interpreter"
        raise ValueError(
            f"backend={backend!r} needs {want} tensors on this machine (kernels are {where}); "
            f"q is on {q.device}"
        )


def choose_backend(q: torch.Tensor, k_cache: torch.Tensor, lengths: Lengths) -> str:
    """What ``backend="auto"`` runs: ``"torch"`` off the GPU (the interpreter is for learning,
    not speed); on a GPU ``"triton_split"`` when the split plan has more than one chunk,
    else the one-pass ``"triton"``."""
    if q.device.type != "cuda" or not _device.HAS_TRITON or _device.INTERPRET:
        return "torch"
    from paged_ref.kernels.triton_split import plan_for_inputs

    plan = plan_for_inputs(q, k_cache, lengths)
    return "triton_split" if plan.num_chunks > 1 else "triton"


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Decode attention over a paged KV cache.

    q            [batch, num_q_heads, head_dim]  float16 / bfloat16 / float32
    k_cache      [num_blocks, block_size, num_kv_heads, head_dim]  same dtype as q, contiguous
    v_cache      same shape and dtype as k_cache
    block_tables [batch, max_blocks_per_seq] int32: token t of sequence b is at
                 k_cache[block_tables[b, t // block_size], t % block_size]
    seq_lens     [batch] int32; table entries past ceil(seq_lens[b] / block_size) are ignored
    scale        softmax scale, default head_dim ** -0.5

    Returns [batch, num_q_heads, head_dim] in q's dtype; a row with seq_lens[b] == 0 is zeros.
    Raises TypeError for bad types/dtypes and ValueError for bad shapes, devices or values.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    shapes = check_shapes(q, k_cache, v_cache, block_tables, seq_lens, scale)
    lengths = check_values(block_tables, seq_lens, shapes)
    if backend == "auto":
        backend = choose_backend(q, k_cache, lengths)
    if backend == "torch":
        return paged_attention_torch(
            q, k_cache, v_cache, block_tables, seq_lens, scale=scale, max_len=lengths.max_len
        )
    _check_triton_usable(backend, q)
    from paged_ref.kernels.kv_formats import check_kernel_format

    check_kernel_format(k_cache)
    if backend == "triton":
        from paged_ref.kernels.triton_decode import paged_attention_triton

        return paged_attention_triton(q, k_cache, v_cache, block_tables, seq_lens, scale=scale)
    from paged_ref.kernels.triton_split import paged_attention_split, plan_for_inputs

    return paged_attention_split(
        q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
        plan=plan_for_inputs(q, k_cache, lengths),
    )
