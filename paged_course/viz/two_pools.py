"""Lesson 11's picture: two engines' pools, two block tables, and the blocks moving between.

    draw_transfer(m0, m1, "req", src_seq="req")   # m0: prefill engine's manager, m1: decode's

Each pool is a grid of its blocks, coloured by the request that holds them (grey: free); the
moved request's blocks are outlined, numbered by their place in its block table, and an arrow
joins logical block ``j`` on the left to logical block ``j`` on the right: the same tokens,
other physical ids.
"""

from __future__ import annotations

from collections.abc import Hashable

from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch, Rectangle

from paged_course.viz.style import FREE_COLOR, seq_color
from paged_ref.memory.manager import KVCacheManager


def _owners(manager: KVCacheManager) -> dict[int, Hashable]:
    return {b: s for s in manager.seq_ids for b in manager.block_table(s)}


def _draw_pool(ax, manager: KVCacheManager, seq_id: Hashable, title: str, cols: int):
    owners = _owners(manager)
    rows = -(-manager.num_blocks // cols)
    centres = {}
    table = manager.block_table(seq_id)
    for b in range(manager.num_blocks):
        r, c = divmod(b, cols)
        x, y = c, rows - 1 - r
        owner = owners.get(b)
        moved = owner == seq_id
        ax.add_patch(Rectangle((x + 0.05, y + 0.05), 0.9, 0.9,
                               facecolor=FREE_COLOR if owner is None else seq_color(owner),
                               alpha=1.0 if moved or owner is None else 0.35,
                               edgecolor="black" if moved else "white",
                               linewidth=2.0 if moved else 0.5))
        label = f"{b}" if not moved else f"{b}\n[{table.index(b)}]"
        ax.text(x + 0.5, y + 0.5, label, ha="center", va="center", fontsize=6.5)
        centres[b] = (x + 0.5, y + 0.5)
    ax.set_xlim(0, cols)
    ax.set_ylim(0, rows)
    ax.set_aspect("equal")
    ax.axis("off")
    ax.set_title(title, fontsize=9)
    return centres, table


def draw_transfer(src: KVCacheManager, dst: KVCacheManager, seq_id: Hashable, *,
                  dst_seq_id: Hashable | None = None, cols: int = 8,
                  max_arrows: int = 12) -> Figure:
    """Two pools side by side; arrows from ``seq_id``'s blocks in ``src`` to the blocks that
    ``dst`` gave them (``dst_seq_id``, default the same id). Labels: ``physical [logical]``."""
    dst_seq_id = seq_id if dst_seq_id is None else dst_seq_id
    fig = Figure(figsize=(9, 2.8))
    ax0, ax1 = fig.subplots(1, 2)
    n = src.seq_len(seq_id)
    c0, t0 = _draw_pool(ax0, src, seq_id, f"rank 0 (prefill): {seq_id!r}, {n} tokens in "
                        f"blocks {table_text(src.block_table(seq_id))}", cols)
    c1, t1 = _draw_pool(ax1, dst, dst_seq_id, "rank 1 (decode): blocks its allocator gave "
                        f"{table_text(dst.block_table(dst_seq_id))}", cols)
    for j, (a, b) in enumerate(zip(t0, t1, strict=True)):
        if j >= max_arrows:
            break
        fig.add_artist(ConnectionPatch(c0[a], c1[b], "data", "data", axesA=ax0, axesB=ax1,
                                       arrowstyle="->", color=seq_color(seq_id), alpha=0.7,
                                       linewidth=1.0))
    fig.suptitle("Moving a sequence: same tokens, same logical order, other physical blocks",
                 fontsize=10)
    return fig


def table_text(table: list[int], limit: int = 8) -> str:
    """A block table as text, shortened after ``limit`` entries."""
    more = f", ... ({len(table)} blocks)" if len(table) > limit else ""
    return "[" + ", ".join(map(str, table[:limit])) + more + "]"


def draw_transfer_vs_recompute(result: dict) -> Figure:
    """Milliseconds per prompt length: each transfer mode vs recomputing the prefill, from a
    ``python -m paged_bench transfer`` result (log-log axes)."""
    fig = Figure(figsize=(6.5, 3.4))
    ax = fig.subplots()
    # (message-size sweep rows, "transfer_packed[chunk=N MiB]", are in the table, not here)
    backends = sorted({r["backend"] for r in result["results"] if "[" not in r["backend"]})
    for backend in backends:
        rows = sorted((r for r in result["results"] if r["backend"] == backend),
                      key=lambda r: r["prompt_tokens"])
        style = "--" if backend.startswith("recompute") else "-"
        ax.plot([r["prompt_tokens"] for r in rows], [r["ms"] for r in rows], style, marker="o",
                label=backend.replace("transfer_", "move: ").replace("_8b", " (8B-like)"))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("ms")
    ax.set_title(f"{result['gpu']} x2: moving a prompt's K/V vs recomputing it", fontsize=9)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def transfer_table(result: dict) -> str:
    """The transfer result as a text table: case, backend, ms, GB/s, % of the copy ceiling."""
    from tabulate import tabulate

    rows = [[r["case"], r["backend"], f"{r['ms']:.3f}",
             f"{r['gbps']:.1f}" if "gbps" in r else "",
             f"{r['pct_p2p_copy_bw']:.1f}" if "pct_p2p_copy_bw" in r else ""]
            for r in result["results"]]
    return tabulate(rows, headers=["case", "backend", "ms", "GB/s", "% of copy"])


def moving_wins(result: dict, mode: str = "packed") -> list[tuple[int, float, float]]:
    """``(prompt_tokens, transfer ms, recompute ms)`` for each prompt measured both ways."""
    move = {r["prompt_tokens"]: r["ms"] for r in result["results"]
            if r["backend"] == f"transfer_{mode}"}
    redo = {r["prompt_tokens"]: r["ms"] for r in result["results"]
            if r["backend"].startswith("recompute")}
    return [(n, move[n], redo[n]) for n in sorted(move) if n in redo]
