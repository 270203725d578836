"""The runner's fused layer ops: each is one kernel on a GPU, a few torch ops elsewhere.

    add_rms_norm(h, delta, weight, eps)  -> h + delta, rmsnorm(h + delta) * weight
    rope_write_kv(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads)
                                         -> q rotated; k rotated and v written to the cache
    silu_mul(gate_up)                    -> silu(gate) * up
    fuse_linears(*linears)               -> one weight (and bias) for several projections

Shapes: ``h``, ``delta`` ``[T, hidden]``; ``qkv`` ``[T, (Hq + 2 Hkv) * D]`` (q heads, then k,
then v); ``cos``, ``sin`` ``[T, D]`` (the model's ``rotary_emb``'s); ``gate_up`` ``[T, 2 I]``.
``backend="torch"`` is Hugging Face's own arithmetic (the CPU path and the reference);
``"triton"`` runs :mod:`paged_ref.kernels.triton.fused` (compiled on a GPU, interpreted on CPU
tensors) with the same roundings; ``"auto"``: Triton on a CUDA device. Nothing reads a value
back or allocates by value (every op runs inside a CUDA graph); inputs are not checked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from paged_ref import _device
from paged_ref.kv_write import write_kv_torch
from paged_ref.quant import QuantizedKV, write_slots

FUSED_BACKENDS = ("auto", "torch", "triton")


def choose_backend(backend: str, device: torch.device, name: str = "the model") -> str:
    """``"torch"`` or ``"triton"`` for tensors on ``device`` (``"auto"``: compiled Triton on a
    GPU, torch elsewhere). ValueError for an unknown backend, or ``"triton"`` where Triton
    cannot run on ``device`` (:func:`paged_ref._device.check_triton_device`; ``name`` is what
    is on it, for the message)."""
    if backend not in FUSED_BACKENDS:
        raise ValueError(f"fused_backend must be one of {FUSED_BACKENDS}, got {backend!r}")
    if backend == "auto":
        return "triton" if _device.compiled_triton_on(device) else "torch"
    if backend == "triton":
        _device.check_triton_device("fused_backend='triton'", name, device)
    return backend


def fuse_linears(*linears: torch.nn.Linear) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The weights of ``linears`` (same input size) stacked into one ``[sum of out, in]``
    matrix, and their biases into one vector (None when they have none): ``F.linear(x, w, b)``
    is then the outputs of all of them side by side. A copy: the modules stay as they are."""
    with torch.no_grad():
        weight = torch.cat([m.weight for m in linears]).contiguous()
        has_bias = [m.bias is not None for m in linears]
        if any(has_bias) and not all(has_bias):
            raise ValueError("fuse_linears: either every projection has a bias or none has")
        bias = torch.cat([m.bias for m in linears]) if all(has_bias) else None
    return weight, bias


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after adding ``delta`` (``h`` itself when ``delta`` is None), and
    that stream RMS-normalised and scaled by ``weight`` (as ``LlamaRMSNorm``)."""
    if choose_backend(backend, h.device, "h") == "triton":
        from paged_ref.kernels.triton.fused import add_rms_norm_triton

        return add_rms_norm_triton(h.contiguous(), None if delta is None else
                                   delta.contiguous(), weight, eps)
    if delta is not None:
        h = h + delta
    x = h.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return h, weight * x.to(h.dtype)


def rope_write_kv(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, k_cache, v_cache,
                  slot_mapping: torch.Tensor, num_q_heads: int, *,
                  backend: str = "auto") -> torch.Tensor:
    """Split ``qkv`` into heads, rotate q and k (``apply_rotary_pos_emb``), store token ``i``'s
    k and v in cache slot ``slot_mapping[i]`` (int64); returns q ``[T, num_q_heads, D]``.

    ``k_cache`` / ``v_cache`` are ``[num_blocks, block_size, Hkv, D]`` tensors, or
    :class:`paged_ref.QuantizedKV` caches: the Triton kernel then writes k and v into a
    ``[T, Hkv, D]`` buffer (slot ``i`` = row ``i``) and :func:`write_kv` quantises them in.
    """
    num_kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]
    num_tokens = qkv.shape[0]
    if choose_backend(backend, qkv.device, "qkv") == "torch":
        q, k, v = qkv.view(num_tokens, -1, head_dim).split(
            [num_q_heads, num_kv_heads, num_kv_heads], dim=1)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)
        write_kv(k_cache, v_cache, k, v.contiguous(), slot_mapping)
        return q
    from paged_ref.kernels.triton.fused import rope_write_triton

    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    if isinstance(k_cache, torch.Tensor) and k_cache.dtype == qkv.dtype:
        return rope_write_triton(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_q_heads)
    k, v = (qkv.new_empty(num_tokens, num_kv_heads, head_dim) for _ in range(2))
    rows = torch.arange(num_tokens, device=qkv.device)
    q = rope_write_triton(qkv, cos, sin, k, v, rows, num_q_heads)
    write_kv(k_cache, v_cache, k, v, slot_mapping)
    return q


def write_kv(k_cache, v_cache, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store token ``i``'s ``k``, ``v`` (``[T, Hkv, D]``) at slot ``slot_mapping[i]`` (int64),
    unchecked (the runner builds the slots; CUDA-graph capturable). A quantised cache
    quantises on the way in: on a GPU in one Triton kernel for K and V (the bytes of
    ``quant.write_slots``, which a CPU runs)."""
    if not isinstance(k_cache, QuantizedKV):
        return write_kv_torch(k, v, k_cache, v_cache, slot_mapping)
    if k_cache.data.is_cuda:  # (imported here: Triton is only needed where a GPU is)
        from paged_ref.kernels.triton.quant_write import quant_write_triton

        return quant_write_triton(k_cache, v_cache, k, v, slot_mapping)
    write_slots(k_cache, k, slot_mapping)
    write_slots(v_cache, v, slot_mapping)


def silu_mul(gate_up: torch.Tensor, *, backend: str = "auto") -> torch.Tensor:
    """``silu(gate) * up`` where ``gate_up`` is ``[T, 2 I]`` = ``[gate | up]``; ``[T, I]``."""
    if choose_backend(backend, gate_up.device, "gate_up") == "triton":
        from paged_ref.kernels.triton.fused import silu_mul_triton

        return silu_mul_triton(gate_up.contiguous())
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


__all__ = ["FUSED_BACKENDS", "add_rms_norm", "choose_backend", "fuse_linears", "rope_write_kv",
           "silu_mul", "write_kv"]
