"""Copy a cached prefix back from host memory, or recompute it? The arithmetic (lesson 07).

A prefix-cache block evicted from the GPU can be kept in (pinned) host memory; a later prompt
with that prefix then copies it back over PCIe instead of recomputing it. Copying moves
``kv_bytes_per_token`` bytes per token; recomputing costs the prefix's prefill FLOPs, which grow
with the *square* of its length (causal attention), so the longer the prefix, the more offload
wins. ``tools/gpu/offload.py`` measures both on a GPU (:func:`load_measured` and
:func:`describe_measured` read and report its JSON); :func:`estimate` does the arithmetic from
given rates.
"""

from __future__ import annotations

import json
from pathlib import Path

from tabulate import tabulate

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


# ---- the GPU measurement (tools/gpu/offload.py writes results/<gpu>/offload.json) -------

#: Columns of a measured row shown in lesson 07, in this order.
MEASURED_COLUMNS = ["prefix_tokens", "copy_back_ms", "bulk_h2d_ms", "recompute_ms",
                    "recompute_over_copy"]
_MEASURED_KEYS = ["gpu", "torch", "date", "pinned_h2d_gbps", "matmul_tflops", "results"]


def load_measured(path) -> dict | None:
    """The JSON that ``tools/gpu/offload.py`` wrote at ``path``, or None if there is none.

    Raises:
        ValueError: the file lacks a key this lesson reads (names the key and the file).
    """
    path = Path(path)
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    missing = [k for k in _MEASURED_KEYS if k not in data]
    missing += [f"results[{i}].{k}" for i, row in enumerate(data.get("results", []))
                for k in MEASURED_COLUMNS if k not in row]
    if missing:
        raise ValueError(f"{path}: missing {', '.join(missing)} (not written by "
                         f"tools/gpu/offload.py?)")
    return data


def offload_wins_from(results: list[dict]) -> int | None:
    """The shortest measured prefix (tokens) from which copying back beats recomputing at
    every longer prefix measured (``recompute_over_copy > 1``), or None if it never does."""
    rows = sorted(results, key=lambda r: r["prefix_tokens"])
    wins = None
    for row in reversed(rows):
        if row["recompute_over_copy"] <= 1:
            break
        wins = row["prefix_tokens"]
    return wins


def describe_measured(data: dict) -> str:
    """Lesson 07's report of a measurement: where and when it ran, the rates, one row per
    prefix length, and from which prefix length copying back beats recomputing."""
    rows = sorted(data["results"], key=lambda r: r["prefix_tokens"])
    head = (f"{data['gpu']}, torch {data['torch']}, {data['date']} (tools/gpu/offload.py): "
            f"pinned host->device {data['pinned_h2d_gbps']:.1f} GB/s, dense bf16 matmul "
            f"{data['matmul_tflops']:.0f} TFLOP/s")
    table = tabulate([[r[k] for k in MEASURED_COLUMNS] for r in rows],
                     headers=MEASURED_COLUMNS, floatfmt=".2f")
    first = offload_wins_from(rows)
    ratios = {r["prefix_tokens"]: r["recompute_over_copy"] for r in rows}
    if first is None:
        verdict = ("an ideal recompute (at the matmul rate) is faster than copying back at "
                   f"every prefix measured (up to {rows[-1]['prefix_tokens']} tokens); a real "
                   "prefill runs below that rate, so this does not decide it")
    elif first == rows[0]["prefix_tokens"]:
        verdict = (f"copying back beats even an ideal recompute at every prefix measured: "
                   f"{ratios[first]:.1f}x faster at {first} tokens, "
                   f"{ratios[rows[-1]['prefix_tokens']]:.1f}x at {rows[-1]['prefix_tokens']}")
    else:
        verdict = (f"copying back beats even an ideal recompute from {first} tokens up "
                   f"({ratios[first]:.1f}x faster there); below that an ideal recompute is "
                   f"faster (a real prefill, below the matmul rate, may not be)")
    return f"{head}\n{table}\n{verdict}"
