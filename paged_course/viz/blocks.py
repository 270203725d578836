"""Pictures of block tables and KV memory (lessons 01-03).

Every picture is drawn by a pure function that returns a :class:`matplotlib.figure.Figure`
(never shown, never registered with pyplot), so a notebook displays it as a cell's value and
the same image appears on GitHub, in nbconvert HTML and in CI:

    draw_block_tables(manager)                          # requests -> blocks, the block pool
    draw_contiguous_vs_paged([7, 3, 12], max_len=16, block_size=4)
    draw_token_lookup([5, 2, 7], seq_len=11, block_size=4, token=9)
    draw_memory_shares(results, paper=simulate.PAPER_TOKEN_SHARE)   # lesson 01
    draw_decode_trace(trace, prompt_lens=[3, 9], block_size=4)       # lesson 03
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch, FancyArrowPatch, Rectangle

from paged_course.viz.style import EMPTY_COLOR, FREE_COLOR, draw_block, pct, seq_color
from paged_ref.cache_math import blocks_needed, cdiv, token_slot, tokens_in_block
from paged_ref.memory.manager import KVCacheManager


def draw_block_tables(manager: KVCacheManager, *, title: str | None = None,
                      pool_columns: int = 8, arrows: bool | None = None) -> Figure:
    """Each request's block table (logical -> physical) next to the physical block pool.

    Left: one row per request (oldest first), its logical blocks in order, each labelled with
    the physical block it maps to and drawn as ``block_size`` slots, filled ones coloured.
    Right: the pool, ``pool_columns`` blocks per row, free blocks grey, used blocks in their
    request's colour with ``filled/block_size`` written under the id. ``arrows`` (default: when
    at most 24 blocks are used) joins each logical block to its physical block.

    The title gives the live numbers from ``manager.stats()``. Outlines carry gids
    ``"logical:<seq_id>:<j>"`` and ``"pool:<block_id>"`` so tests can find them.
    """
    st = manager.stats()
    bs, nb = manager.block_size, manager.num_blocks
    seqs = manager.seq_ids
    tables = {s: manager.block_table(s) for s in seqs}
    lens = {s: manager.seq_len(s) for s in seqs}
    owner: dict[int, Hashable] = {}
    filled: dict[int, int] = {}
    for s in seqs:
        for j, b in enumerate(tables[s]):
            owner[b] = s
            filled[b] = tokens_in_block(lens[s], j, bs)
    if arrows is None:
        arrows = st.blocks_used <= 24

    max_logical = max([len(t) for t in tables.values()] + [3])
    pool_rows = cdiv(nb, pool_columns)
    rows = max(len(seqs), pool_rows, 1)
    pitch = 1.3  # vertical distance between rows, in data units
    height = max(2.6, 0.62 * rows + 1.6)
    fig = Figure(figsize=(12, height), layout="constrained")
    left_w, right_w = max_logical * 1.2 + 2.0, pool_columns * 1.2
    ax_t, ax_p = fig.subplots(1, 2, width_ratios=[left_w, right_w])

    # Left: block tables, one row per request.
    for row, s in enumerate(seqs):
        y = -row * pitch
        color = seq_color(s)
        ax_t.text(-0.15, y + 0.35, f"req {s}\n{lens[s]} tok", ha="right", va="center",
                  fontsize=9, color=color, fontweight="bold")
        for j, b in enumerate(tables[s]):
            draw_block(ax_t, j * 1.2, y, 1.0, 0.7, filled[b], bs, color,
                       gid=f"logical:{s}:{j}")
            ax_t.text(j * 1.2 + 0.5, y + 0.78, f"→{b}", ha="center", va="bottom", fontsize=8)
        if not tables[s]:
            ax_t.text(0, y + 0.35, "(no blocks yet)", va="center", fontsize=8, color="grey")
    ax_t.set_xlim(-2.0, max_logical * 1.2)
    ax_t.set_ylim(-(rows - 1) * pitch - 0.2, 1.3)
    ax_t.set_title("block tables: logical block j → physical block id", fontsize=10)
    ax_t.axis("off")
    if not seqs:
        ax_t.text(0.5, 0.5, "no requests", transform=ax_t.transAxes, ha="center", color="grey")

    # Right: the physical pool.
    for b in range(nb):
        x, y = (b % pool_columns) * 1.2, -(b // pool_columns) * pitch
        if b in owner:
            color = seq_color(owner[b])
            draw_block(ax_p, x, y, 1.0, 0.7, filled[b], bs, color, gid=f"pool:{b}")
            label = f"{b}: {filled[b]}/{bs}"
        else:
            box = Rectangle((x, y), 1.0, 0.7, facecolor=FREE_COLOR, edgecolor="#aaaaaa")
            box.set_gid(f"pool:{b}")
            ax_p.add_patch(box)
            label = f"{b}: free"
        ax_p.text(x + 0.5, y + 0.78, label, ha="center", va="bottom", fontsize=7.5)
    ax_p.set_xlim(-0.1, pool_columns * 1.2)
    ax_p.set_ylim(-(rows - 1) * pitch - 0.2, 1.3)
    ax_p.set_title(f"physical pool: {nb} blocks × {bs} slots (grey = free)", fontsize=10)
    ax_p.axis("off")

    if arrows:
        for row, s in enumerate(seqs):
            for j, b in enumerate(tables[s]):
                xb, yb = (b % pool_columns) * 1.2, -(b // pool_columns) * pitch
                fig.add_artist(ConnectionPatch(
                    xyA=(j * 1.2 + 1.0, -row * pitch + 0.35), coordsA=ax_t.transData,
                    xyB=(xb, yb + 0.35), coordsB=ax_p.transData,
                    arrowstyle="->", color=seq_color(s), alpha=0.35, linewidth=0.8))

    numbers = (f"{st.blocks_used} of {nb} blocks used, {st.blocks_free} free · "
               f"{st.tokens_stored} tokens in {st.blocks_used * bs} reserved slots "
               f"({100 * st.utilization:.0f}% full) · {st.slots_reserved_empty} slots reserved "
               f"but empty")
    fig.suptitle(f"{title}\n{numbers}" if title else numbers, fontsize=11)
    return fig


def draw_contiguous_vs_paged(seq_lens: Sequence[int], max_len: int, block_size: int, *,
                             title: str | None = None) -> Figure:
    """The same requests stored contiguously (``max_len`` slots each) and in blocks.

    Top: each request reserves ``max_len`` slots; its ``seq_len`` tokens are coloured, the rest
    is reserved but empty (hatched). Bottom: each request holds ``ceil(seq_len / block_size)``
    blocks; only the last block's tail is empty. Each panel's title gives the share of reserved
    slots holding real tokens. Every row carries a text ``"<tokens>/<reserved>"``.
    """
    seq_lens = [int(n) for n in seq_lens]
    if any(n < 0 or n > max_len for n in seq_lens):
        raise ValueError(f"every seq_len must be in [0, max_len={max_len}], got {seq_lens}")
    if block_size < 1:
        raise ValueError(f"block_size must be positive, got {block_size}")
    n = len(seq_lens)
    tokens = sum(seq_lens)
    contiguous = n * max_len
    blocks = [blocks_needed(s, block_size) for s in seq_lens]
    paged = sum(blocks) * block_size

    fig = Figure(figsize=(11, 1.2 + 0.5 * 2 * max(n, 1)), layout="constrained")
    ax_c, ax_p = fig.subplots(2, 1, sharex=True)
    fine = max_len / block_size <= 40  # few enough blocks per row to draw every slot
    for i, s in enumerate(seq_lens):
        color = seq_color(i)
        ax_c.add_patch(Rectangle((0, -i), max_len, 0.7, facecolor=EMPTY_COLOR, edgecolor=color,
                                 hatch="///", linewidth=1.2))
        ax_c.add_patch(Rectangle((0, -i), s, 0.7, facecolor=color, edgecolor=color))
        ax_c.text(max_len * 1.015, -i + 0.35, f"{s}/{max_len}", va="center", fontsize=8)
        for j in range(blocks[i]):
            fill = tokens_in_block(s, j, block_size)
            draw_block(ax_p, j * block_size, -i, block_size * 0.94, 0.7, fill, block_size,
                       color, gid=f"paged:{i}:{j}", edge="black" if fine else "#666666",
                       cells=fine, linewidth=1.6 if fine else 0.3)
        ax_p.text(max_len * 1.015, -i + 0.35, f"{s}/{blocks[i] * block_size}", va="center",
                  fontsize=8)
    for ax in (ax_c, ax_p):
        ax.set_xlim(0, max_len * 1.12)
        ax.set_ylim(-n + 0.6, 1.0)
        ax.set_yticks([-i + 0.35 for i in range(n)], [f"req {i}" for i in range(n)])
        ax.spines[["top", "right", "left"]].set_visible(False)
    ax_p.set_xlabel("token slots")
    ax_c.set_title(f"contiguous: {max_len} slots reserved per request → {tokens} of "
                   f"{contiguous} reserved slots hold tokens ({pct(tokens, contiguous)})",
                   fontsize=10, loc="left")
    ax_p.set_title(f"paged, block_size={block_size}: {sum(blocks)} blocks → {tokens} of "
                   f"{paged} reserved slots hold tokens ({pct(tokens, paged)}); "
                   f"{contiguous - paged} slots stay free for other requests",
                   fontsize=10, loc="left")
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def draw_token_lookup(block_table: Sequence[int], seq_len: int, block_size: int, token: int, *,
                      num_blocks: int | None = None) -> Figure:
    """Where token ``token`` of a sequence lives: logical block, table entry, physical slot.

    Top: the sequence's tokens grouped in logical blocks, ``token`` highlighted. Middle: the
    block table, entry ``token // block_size`` highlighted. Bottom: the physical pool
    (``num_blocks`` blocks, default just enough to show every table entry) with the slot
    ``block_table[token // block_size] * block_size + token % block_size`` highlighted.
    """
    block_table = [int(b) for b in block_table]
    if not 0 <= token < seq_len:
        raise ValueError(f"token must be in [0, seq_len={seq_len}), got {token}")
    used = blocks_needed(seq_len, block_size)
    if used > len(block_table):
        raise ValueError(f"seq_len={seq_len} needs {used} table entries, got {len(block_table)}")
    j, off = divmod(token, block_size)
    phys = block_table[j]
    slot = token_slot(block_table, token, block_size)
    nb = num_blocks if num_blocks is not None else max(block_table[:used]) + 1
    color, hi = seq_color(0), "#d62728"

    fig = Figure(figsize=(max(8, 0.3 * nb * block_size / 2 + 2), 4.2), layout="constrained")
    ax = fig.subplots()
    cell = 1.0
    # Row 1: logical tokens (y = 2), grouped by logical block.
    for t in range(used * block_size):
        x = t * cell + (t // block_size) * 0.4
        face = hi if t == token else (color if t < seq_len else EMPTY_COLOR)
        ax.add_patch(Rectangle((x, 2), cell, 0.6, facecolor=face, edgecolor="white"))
        if t == token:
            ax.text(x + 0.5, 2.7, f"token {t}", ha="center", fontsize=9, color=hi)
    for lb in range(used):
        x0 = lb * (block_size * cell + 0.4)
        ax.add_patch(Rectangle((x0, 2), block_size * cell, 0.6, facecolor="none",
                               edgecolor="black", linewidth=1))
        ax.text(x0 + block_size * cell / 2, 1.85, f"logical {lb}", ha="center", va="top",
                fontsize=8)
    # Row 2: block table entries (y = 0.8).
    for lb in range(used):
        x0 = lb * 1.2
        ax.add_patch(Rectangle((x0, 0.8), 1.0, 0.6, facecolor=hi if lb == j else "#f0f0f0",
                               edgecolor="black"))
        ax.text(x0 + 0.5, 1.1, str(block_table[lb]), ha="center", va="center", fontsize=9,
                color="white" if lb == j else "black")
    ax.text(-0.3, 1.1, "block_table", ha="right", va="center", fontsize=9)
    # Row 3: physical pool (y = -0.6), every slot drawn.
    holds = {b: tokens_in_block(seq_len, k, block_size) for k, b in enumerate(block_table[:used])}
    for b in range(nb):
        x0 = b * (block_size * cell * 0.5 + 0.3)
        for s in range(block_size):
            face = (hi if (b == phys and s == off) else FREE_COLOR if b not in holds
                    else color if s < holds[b] else EMPTY_COLOR)
            ax.add_patch(Rectangle((x0 + s * cell * 0.5, -0.6), cell * 0.5, 0.6, facecolor=face,
                                   edgecolor="#bbbbbb" if face == EMPTY_COLOR else "white",
                                   linewidth=0.5))
        ax.text(x0 + block_size * cell * 0.25, -0.75, str(b), ha="center", va="top", fontsize=7)
    ax.text(-0.3, -0.3, "physical\nblocks", ha="right", va="center", fontsize=9)
    # Arrows: token -> table entry -> slot.
    xt = token * cell + j * 0.4 + 0.5
    ax.add_patch(FancyArrowPatch((xt, 2), (j * 1.2 + 0.5, 1.4), arrowstyle="->", color=hi,
                                 mutation_scale=12))
    xs = phys * (block_size * cell * 0.5 + 0.3) + (off + 0.5) * cell * 0.5
    ax.add_patch(FancyArrowPatch((j * 1.2 + 0.5, 0.8), (xs, 0.0), arrowstyle="->", color=hi,
                                 mutation_scale=12))
    width = max(used * (block_size * cell + 0.4), nb * (block_size * cell * 0.5 + 0.3))
    ax.set_xlim(-2.2, width + 0.2)
    ax.set_ylim(-1.2, 3.1)
    ax.axis("off")
    fig.suptitle(f"token {token} → logical block {token} // {block_size} = {j}, offset "
                 f"{token} % {block_size} = {off} → block_table[{j}] = {phys} → slot "
                 f"{phys}·{block_size} + {off} = {slot}", fontsize=10)
    return fig


def draw_decode_trace(trace, prompt_lens: Sequence[int], block_size: int) -> Figure:
    """Lesson 03's decode loop, step by step (``trace`` from
    :func:`paged_course.decode_loop.run_side_by_side`). Left: the largest difference
    between paged and contiguous decode per step. Right: blocks in use, with a cross where a
    request's new token starts a block (the only steps that take one)."""
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 3.2), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2)
    steps = range(len(trace.max_diff))
    ax1.semilogy(steps, [max(d, 1e-12) for d in trace.max_diff], marker="o")
    ax1.set(xlabel="step (0 = prefill)", ylabel="max |paged − contiguous|",
            title="paged vs contiguous decode (float32)")
    in_use = [trace.num_blocks - f for f in trace.free_blocks]
    ax2.step(steps, in_use, where="post", marker=".")
    for b, n in enumerate(prompt_lens):  # step s writes token n + s - 1 of request b
        starts = [s for s in steps if s > 0
                  and blocks_needed(n + s, block_size) > blocks_needed(n + s - 1, block_size)]
        ax2.plot(starts, [in_use[s] for s in starts], "x", color=seq_color(b),
                 label=f"request {b} takes a block")
    ax2.set(xlabel="step (0 = prefill)", ylabel="blocks in use",
            title="blocks are taken as requests grow")
    ax2.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax2.legend(fontsize=8)
    return fig


def draw_memory_shares(results: dict, paper: dict[str, float] | None = None) -> Figure:
    """Lesson 01: where the KV pool goes under each reservation strategy, stacked to 100 %.

    ``results`` maps a strategy to a :class:`paged_course.simulate.SimResult` (its
    ``share`` of tokens / future / rounding / free); ``paper`` marks the PagedAttention
    paper's token share per strategy with diamonds."""
    labels = list(results)
    parts = [("tokens", "token states", "C2"), ("future", "reserved for future tokens", "C1"),
             ("rounding", "rounding / last-block tail", "C3"), ("free", "free but unusable", "0.8")]
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax = fig.subplots()
    bottom = [0.0] * len(labels)
    for key, name, color in parts:
        vals = [100 * results[s].share[key] for s in labels]
        ax.bar(labels, vals, bottom=bottom, color=color, label=name)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    for i, s in enumerate(labels):
        ax.text(i, 4, f"ours {100 * results[s].token_share:.1f}%", ha="center", va="center",
                color="white", fontweight="bold")
    if paper:
        ax.scatter(labels, [paper[s] for s in labels], marker="D", color="k", zorder=3,
                   label="paper, Fig. 2: token states")
        for i, s in enumerate(labels):
            ax.annotate(f"paper {paper[s]}%", (i, paper[s]), textcoords="offset points",
                        xytext=(22, -4), fontsize=8)
    ax.set(ylabel="% of the KV-cache pool", ylim=(0, 100),
           title="Where the KV memory goes (simulation, averaged over steps while requests wait)")
    ax.legend(loc="upper left", fontsize=8, bbox_to_anchor=(1.01, 1))
    return fig
