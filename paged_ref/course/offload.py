"""Copy a cached prefix back from host memory, or recompute it? The arithmetic (lesson 07).

A prefix-cache block evicted from the GPU can be kept in (pinned) host memory; a later prompt
with that prefix then copies it back over PCIe instead of recomputing it. Copying moves
``kv_bytes_per_token`` bytes per token; recomputing costs the prefix's prefill FLOPs, which grow
with the *square* of its length (causal attention), so the longer the prefix, the more offload
wins. ``tools/gpu/offload.py`` measures both on a GPU; :func:`estimate` does the arithmetic
from given rates.
"""

from __future__ import annotations

from paged_ref.cache_math import kv_bytes_per_token

#: A Llama-3-8B-shaped layer stack (bf16, blocks of 16 tokens).
LLAMA_8B = dict(num_layers=32, hidden=4096, num_q_heads=32, num_kv_heads=8, head_dim=128,
                intermediate=14336, block_size=16, dtype="bfloat16")

#: Prefix lengths measured and estimated, in tokens.
PREFIXES = [512, 1024, 2048, 4096, 8192, 16384, 32768]


def prefill_flops(n: int, shape: dict = LLAMA_8B) -> float:
    """FLOPs to prefill ``n`` tokens through the layer stack (no embedding / LM head):
    per layer ``2 n`` x (the q, k, v, o and 3 MLP weight matrices) + causal attention
    ``2 * 2 * (n^2 / 2) * num_q_heads * head_dim`` (QK^T and PV over half the square)."""
    h, kv = shape["hidden"], shape["num_kv_heads"] * shape["head_dim"]
    weights = h * (h + 2 * kv + h) + 3 * h * shape["intermediate"]
    attention = 2 * n * n * shape["num_q_heads"] * shape["head_dim"]
    return shape["num_layers"] * (2 * n * weights + attention)


def kv_bytes(n: int, shape: dict = LLAMA_8B) -> int:
    """Bytes of K/V of ``n`` tokens over all layers."""
    return n * kv_bytes_per_token(num_layers=shape["num_layers"],
                                  num_kv_heads=shape["num_kv_heads"],
                                  head_dim=shape["head_dim"], dtype=shape["dtype"])


def estimate(copy_gbps: float, tflops: float, prefixes=PREFIXES,
             shape: dict = LLAMA_8B) -> list[dict]:
    """Per prefix length: copy-back time at ``copy_gbps`` GB/s vs recompute time at
    ``tflops`` TFLOP/s (a lower bound: no real prefill runs at the matmul peak), in ms."""
    rows = []
    for n in prefixes:
        copy_ms = kv_bytes(n, shape) / (copy_gbps * 1e9) * 1e3
        recompute_ms = prefill_flops(n, shape) / (tflops * 1e12) * 1e3
        rows.append({"prefix_tokens": n, "MiB": kv_bytes(n, shape) / 2**20,
                     "copy_back_ms": copy_ms, "recompute_ms": recompute_ms,
                     "recompute / copy": recompute_ms / copy_ms})
    return rows


def breakeven_gbps(n: int, tflops: float, shape: dict = LLAMA_8B) -> float:
    """The host->device bandwidth (GB/s) at which copying ``n`` cached tokens back takes as
    long as recomputing them at ``tflops``: below it, recompute; above it, offload wins."""
    return kv_bytes(n, shape) / (prefill_flops(n, shape) / (tflops * 1e12)) / 1e9
