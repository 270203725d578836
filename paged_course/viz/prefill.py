"""Pictures for lesson 08: the causal mask with a cached prefix, the kernel's tiles, a roofline.

    fig = draw_causal_offset(seq_len=40, q_len=24, block_q=8, block_n=8)
    counts = classify_tiles(seq_len=40, q_len=24, block_q=8, block_n=8)  # {"full": .., ...}
    fig = draw_roofline({"prefill P8_L2048": 820, "decode": 1.0}, peak_tflops=717, bw_gbps=4260)
"""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from paged_ref.cache_math import cdiv

TILE_COLORS = {"full": "tab:green", "masked": "tab:orange", "skipped": "0.85"}


def tile_key_span(first_pos: int, last_pos: int, seq_len: int, block_n: int,
                    causal: bool = True) -> tuple[int, int]:
    """``(full_end, kv_end)`` for a tile of query rows at tokens ``first_pos .. last_pos``, as
    the kernel computes them: key tiles below ``full_end`` need no mask, tiles from there up to
    ``kv_end`` are masked, tiles past ``kv_end`` are skipped."""
    if causal:
        return (first_pos + 1) // block_n * block_n, last_pos + 1
    return seq_len // block_n * block_n, seq_len


def classify_tiles(seq_len: int, q_len: int, block_q: int, block_n: int,
                   causal: bool = True) -> list[list[str]]:
    """For each query tile (``block_q`` query tokens) and key tile (``block_n`` keys): "full",
    "masked" or "skipped". Returns a [query tiles][key tiles] list of those names."""
    grid = []
    for t in range(cdiv(q_len, block_q)):
        first = seq_len - q_len + t * block_q
        last = seq_len - q_len + min((t + 1) * block_q, q_len) - 1
        full_end, kv_end = tile_key_span(first, last, seq_len, block_n, causal)
        grid.append(["full" if k0 + block_n <= full_end else "masked" if k0 < kv_end
                     else "skipped" for k0 in range(0, seq_len, block_n)])
    return grid


def draw_causal_offset(seq_len: int, q_len: int, *, block_q: int | None = None,
                       block_n: int | None = None, causal: bool = True) -> Figure:
    """Query rows (the last ``q_len`` tokens) x cache positions: dark where a row sees a key
    (cached prefix in blue, the queries' own tokens in purple), white where masked. With
    ``block_q`` / ``block_n``, the kernel's tiles are outlined: green = no mask needed, orange =
    masked (the diagonal band, a sequence's last partial tile), grey = never loaded."""
    prefix = seq_len - q_len
    fig = Figure(figsize=(min(12, 2 + seq_len * 0.22), 1.5 + q_len * 0.2), layout="constrained")
    ax = fig.subplots()
    for i in range(q_len):
        visible = prefix + i + 1 if causal else seq_len
        for j in range(visible):
            ax.add_patch(Rectangle((j, i), 1, 1, color="tab:blue" if j < prefix else "tab:purple",
                                   alpha=0.75, lw=0))
    if block_q and block_n:
        grid = classify_tiles(seq_len, q_len, block_q, block_n, causal)
        for t, row in enumerate(grid):
            for n, kind in enumerate(row):
                height = min(block_q, q_len - t * block_q)
                width = min(block_n, seq_len - n * block_n)
                ax.add_patch(Rectangle((n * block_n, t * block_q), width, height, fill=False,
                                       ec=TILE_COLORS[kind], lw=2.2))
    ax.axvline(prefix, color="k", lw=1, ls="--")
    ax.set_xlim(0, seq_len)
    ax.set_ylim(q_len, 0)
    ax.set_aspect("equal")
    ax.set_xlabel(f"key position in the cache (0 .. {seq_len - 1}); dashed: end of the cached "
                  f"prefix ({prefix} tokens)")
    ax.set_ylabel("query row i (token prefix + i)")
    title = f"seq_len {seq_len}, {q_len} query rows, causal={causal}"
    if block_q and block_n:
        title += (f"; tiles of {block_q} query tokens x {block_n} keys: green no mask, orange "
                  "masked, grey skipped")
    ax.set_title(title, fontsize=9)
    return fig


def draw_roofline(points: dict[str, float], *, peak_tflops: float, bw_gbps: float,
                  measured: dict[str, float] | None = None, title: str = "") -> Figure:
    """Log-log roofline: attainable TFLOP/s = min(peak, intensity x bandwidth), and each
    ``name -> FLOP per byte`` point placed on it; ``measured`` (``name -> TFLOP/s``) adds what
    a kernel reached as crosses below its point."""
    import numpy as np

    ridge = peak_tflops * 1e12 / (bw_gbps * 1e9)  # FLOP/byte where the two limits meet
    xs = np.logspace(-1, 4.5, 200)
    fig = Figure(figsize=(8, 4.2), layout="constrained")
    ax = fig.subplots()
    ax.loglog(xs, np.minimum(peak_tflops, xs * bw_gbps / 1e3), color="k")
    ax.axvline(ridge, color="k", lw=0.8, ls=":")
    ax.annotate(f"ridge {ridge:.0f} FLOP/B", (ridge, peak_tflops / 30), fontsize=8,
                rotation=90, ha="right")
    for i, (name, intensity) in enumerate(points.items()):
        y = min(peak_tflops, intensity * bw_gbps / 1e3)
        (dot,) = ax.plot([intensity], [y], "o")
        if measured and name in measured:
            ax.plot([intensity], [measured[name]], "x", color=dot.get_color(), ms=9)
        ax.annotate(name, (intensity, y), textcoords="offset points", xytext=(6, -12 - 11 * i),
                    fontsize=8, color=dot.get_color())
    ax.set(xlabel="arithmetic intensity (FLOP per byte of K/V, q and out); x = measured",
           ylabel="attainable TFLOP/s", title=title)
    return fig
