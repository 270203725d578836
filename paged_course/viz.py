"""Pictures of block tables and KV memory, and an interactive block-table explorer.

Every picture is drawn by a pure function that returns a :class:`matplotlib.figure.Figure`
(never shown, never registered with pyplot), so a notebook displays it as a cell's value and
the same image appears on GitHub, in nbconvert HTML and in CI:

    draw_block_tables(manager)                          # requests -> blocks, the block pool
    draw_contiguous_vs_paged([7, 3, 12], max_len=16, block_size=4)
    draw_token_lookup([5, 2, 7], seq_len=11, block_size=4, token=9)
    draw_masked_programs(20, 8)                         # lesson 00: a 1-D launch and its mask
    draw_program_walk(inputs, b=1, h=0, tile=8)         # lesson 04: one program's walk
    draw_sm_occupancy(ax, programs=8, num_sms=132, programs_per_sm=4, title="one pass")

:class:`BlockTableExplorer` wraps a :class:`paged_ref.KVCacheManager` in ipywidgets buttons;
its actions are plain methods (``start``, ``add_token``, ``add_tokens``, ``step``, ``finish``,
``reset``) that work without a display.
"""

from __future__ import annotations

import io
import zlib
from collections.abc import Hashable, Sequence

import matplotlib
from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch, FancyArrowPatch, Rectangle

from paged_ref.cache_math import blocks_needed, cdiv, token_slot, tokens_in_block
from paged_ref.memory.allocator import OutOfBlocksError
from paged_ref.memory.manager import KVCacheManager

#: Colours for requests (tab10 without its grey, which marks free blocks).
PALETTE = [c for i, c in enumerate(matplotlib.colormaps["tab10"].colors) if i != 7]
FREE_COLOR = "#d9d9d9"
EMPTY_COLOR = "#ffffff"
#: Width of the explorer's number boxes (label + 5 digits + the spinner arrows).
NUMBER_BOX_WIDTH = "190px"


def seq_color(seq_id: Hashable):
    """The colour of request ``seq_id``: fixed per id, so it stays put as others come and go."""
    if isinstance(seq_id, int) and not isinstance(seq_id, bool):
        index = seq_id
    else:
        index = zlib.crc32(str(seq_id).encode())
    return PALETTE[index % len(PALETTE)]


def _draw_block(ax, x, y, width, height, filled, block_size, color, *, gid, edge=None,
                cells=True, linewidth=1.6):
    """A block as ``block_size`` slot cells, the first ``filled`` of them coloured.

    Returns the outline rectangle (its gid is ``gid``). With ``cells=False``, or block sizes
    over 16, the filled part is one bar instead of separate cells.
    """
    edge = edge or color
    if cells and block_size <= 16:
        cell = width / block_size
        for s in range(block_size):
            ax.add_patch(Rectangle((x + s * cell, y), cell, height, linewidth=0.4,
                                   facecolor=color if s < filled else EMPTY_COLOR,
                                   edgecolor="white" if s < filled else "#bbbbbb"))
    else:
        ax.add_patch(Rectangle((x, y), width * filled / block_size, height, linewidth=0,
                               facecolor=color))
    outline = Rectangle((x, y), width, height, facecolor="none", edgecolor=edge,
                        linewidth=linewidth)
    outline.set_gid(gid)
    ax.add_patch(outline)
    return outline


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
            _draw_block(ax_t, j * 1.2, y, 1.0, 0.7, filled[b], bs, color,
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
            _draw_block(ax_p, x, y, 1.0, 0.7, filled[b], bs, color, gid=f"pool:{b}")
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
            _draw_block(ax_p, j * block_size, -i, block_size * 0.94, 0.7, fill, block_size,
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
                   f"{contiguous} reserved slots hold tokens ({_pct(tokens, contiguous)})",
                   fontsize=10, loc="left")
    ax_p.set_title(f"paged, block_size={block_size}: {sum(blocks)} blocks → {tokens} of "
                   f"{paged} reserved slots hold tokens ({_pct(tokens, paged)}); "
                   f"{contiguous - paged} slots stay free for other requests",
                   fontsize=10, loc="left")
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def _pct(part: int, whole: int) -> str:
    return "n/a" if whole == 0 else f"{100 * part / whole:.0f}%"


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


# ---- kernels: how programs cover the work --------------------------------------------------


def draw_masked_programs(n: int, block: int) -> Figure:
    """A 1-D Triton launch: ``cdiv(n, block)`` programs of ``block`` lanes over ``n`` elements,
    the lanes past ``n`` hatched (masked off). Lesson 00's first kernel."""
    programs = cdiv(n, block)
    fig = Figure(figsize=(10, 1.6), layout="constrained")
    ax = fig.subplots()
    for i in range(programs * block):
        pid, masked = i // block, i >= n
        ax.add_patch(Rectangle((i, 0), 0.95, 1, facecolor="white" if masked else f"C{pid}",
                               edgecolor=f"C{pid}" if masked else "white",
                               hatch="//" if masked else None))
    for pid in range(programs):
        ax.text(pid * block + block / 2, 1.15, f"program {pid}", ha="center")
    ax.set_xlim(-0.5, programs * block + 0.5)
    ax.set_ylim(-0.2, 1.6)
    ax.axis("off")
    ax.set_title(f"n = {n}, BLOCK = {block}: {programs} programs; hatched = masked off "
                 "(past the end)", fontsize=10)
    return fig


def draw_program_walk(inp, b: int, h: int, tile: int) -> Figure:
    """Lesson 04's grid, and program ``(b, h)`` walking sequence ``b`` ``tile`` tokens a step.

    ``inp`` is a :class:`paged_course.testing.PagedInputs` (its shapes, tables and
    lengths are read). Left: the grid ``(batch, num_kv_heads)``, program ``(b, h)`` marked.
    Right, top to bottom: the tokens coloured by the loop step that reads them (hatched past
    the end), the block table row (entries past the used blocks greyed: never followed), and
    the physical blocks, each coloured by the step that reads it, with arrows from the table.
    """
    batch, block_size = inp.q.shape[0], inp.k_cache.shape[1]
    num_kv, num_blocks = inp.k_cache.shape[2], inp.k_cache.shape[0]
    group = inp.q.shape[1] // num_kv
    lens = [int(n) for n in inp.seq_lens.tolist()]
    n, table = lens[b], inp.block_tables[b].tolist()
    colors = ["tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:red"]
    fig = Figure(figsize=(12.5, 4.6), layout="constrained")
    ax1, ax2 = fig.subplots(1, 2, width_ratios=[1, 3.2])

    for bb in range(batch):
        for hh in range(num_kv):
            me = (bb, hh) == (b, h)
            ax1.add_patch(Rectangle((hh, batch - 1 - bb), 0.9, 0.85,
                                    facecolor="#f4a259" if me else "#e8e8e8",
                                    edgecolor="black" if me else "#999999"))
            ax1.text(hh + 0.45, batch - 1 - bb + 0.42, f"b={bb}, h={hh}\n{lens[bb]} tok",
                     ha="center", va="center", fontsize=9)
    for hh in range(num_kv):
        ax1.text(hh + 0.45, batch + 0.05,
                 f"KV head {hh}\nq heads {hh * group}-{hh * group + group - 1}",
                 ha="center", va="bottom", fontsize=8.5)
    ax1.set(xlim=(-0.1, num_kv), ylim=(-0.2, batch + 0.8),
            title=f"grid = (batch {batch}, KV heads {num_kv})")
    ax1.set_axis_off()

    steps = cdiv(n, tile)
    width = steps * tile
    y_tok, y_tab, y_pool = 3.0, 1.7, 0.0
    for t in range(width):
        real = t < n
        ax2.add_patch(Rectangle((t, y_tok), 0.95, 0.6,
                                facecolor=colors[t // tile] if real else "white",
                                edgecolor=colors[t // tile], hatch=None if real else "///",
                                alpha=0.85 if real else 1))
        if t % block_size == 0 or t == width - 1:
            ax2.text(t + 0.47, y_tok + 0.3, str(t), ha="center", va="center", fontsize=7)
    for s in range(steps):
        ax2.text(s * tile + tile / 2, y_tok + 0.75,
                 f"loop step {s}: tokens {s * tile}-{s * tile + tile - 1}",
                 ha="center", fontsize=8.5, color=colors[s])
    used = blocks_needed(n, block_size)
    for j, entry in enumerate(table):
        x = j * block_size
        if x >= width + block_size:
            break
        ok = j < used
        ax2.add_patch(Rectangle((x, y_tab), block_size * 0.97, 0.6,
                                facecolor="#fff6d5" if ok else "#eeeeee",
                                edgecolor="#8a6d00" if ok else "#bbbbbb"))
        label = str(entry) if ok or abs(entry) < 10**4 else "huge"
        ax2.text(x + block_size / 2, y_tab + 0.3, label, ha="center", va="center", fontsize=8,
                 color="black" if ok else "#999999")
    ax2.text(-0.3, y_tab + 0.3, f"block_tables[{b}]", ha="right", va="center", fontsize=9)
    ax2.text(-0.3, y_tok + 0.3, "tokens t", ha="right", va="center", fontsize=9)
    pool_w = width / num_blocks
    step_of = {table[j]: (j * block_size) // tile for j in range(used)}  # block -> loop step
    for p in range(num_blocks):
        step = step_of.get(p)
        ax2.add_patch(Rectangle((p * pool_w, y_pool), pool_w * 0.94, 0.6,
                                facecolor="#e8e8e8" if step is None else colors[step],
                                edgecolor="#999999" if step is None else "black", alpha=0.85))
        ax2.text(p * pool_w + pool_w * 0.47, y_pool - 0.25, str(p), ha="center", va="top",
                 fontsize=7)
    ax2.text(-0.3, y_pool + 0.3, "k_cache blocks", ha="right", va="center", fontsize=9)
    for j in range(used):
        start = (j * block_size + block_size / 2, y_tab)
        end = (table[j] * pool_w + pool_w / 2, y_pool + 0.6)
        ax2.add_artist(ConnectionPatch(start, end, "data", "data", arrowstyle="->",
                                       color=colors[step_of[table[j]]], lw=1.3))
    ax2.set(xlim=(-0.5, width + 0.5), ylim=(-0.8, y_tok + 1.2),
            title=f"program (b={b}, h={h}): {n} tokens, blocks of {block_size}, tiles of {tile}")
    ax2.set_axis_off()
    return fig


def draw_sm_occupancy(ax, programs: int, num_sms: int, programs_per_sm: int, title: str,
                      cols: int = 12) -> None:
    """One square per SM on ``ax``, shaded by how many of ``programs`` it runs at once
    (round-robin placement, at most ``programs_per_sm`` each); lesson 05's picture."""
    per_sm = [0] * num_sms
    for p in range(min(programs, num_sms * programs_per_sm)):
        per_sm[p % num_sms] += 1
    rows = cdiv(num_sms, cols)
    for i, n in enumerate(per_sm):
        r, c = divmod(i, cols)
        color = ((1.0, 1.0, 1.0) if n == 0
                 else (0.15, 0.45, 0.8, 0.25 + 0.75 * n / programs_per_sm))
        ax.add_patch(Rectangle((c, rows - 1 - r), 0.9, 0.9, facecolor=color, edgecolor="0.6"))
    busy = sum(n > 0 for n in per_sm)
    ax.set(xlim=(-0.2, cols), ylim=(-0.2, rows), aspect="equal", xticks=[], yticks=[])
    ax.set_title(f"{title}\n{programs} programs: {busy} of {num_sms} SMs busy", fontsize=10)


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


class BlockTableExplorer:
    """Grow, finish and start requests in a small KV cache and watch the block tables.

        explorer = BlockTableExplorer(num_blocks=32, block_size=4)
        explorer            # in a notebook: the buttons and the live picture
        explorer.add_token(0); explorer.figure()   # the same without widgets

    Actions return ``True`` when they changed the cache and ``False`` otherwise (out of
    blocks, unknown request, bad count); :attr:`message` says what happened. Out of blocks
    never changes anything. Request ids are 0, 1, 2, ... in the order started.
    """

    def __init__(self, num_blocks: int = 32, block_size: int = 4,
                 prompts: Sequence[int] = (6, 3, 9), *, pool_columns: int = 8) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prompts = tuple(prompts)
        self.pool_columns = pool_columns
        self._widget = None
        self.reset()

    # ---- actions (no display needed) ----------------------------------------------------------

    def reset(self) -> None:
        """Empty the cache and start the initial requests again."""
        self.manager = KVCacheManager(self.num_blocks, self.block_size)
        self._next_id = 0
        for p in self.prompts:
            self.start(p)
        self.message = f"reset: {len(self.manager)} requests, prompts {list(self.prompts)}"
        self._refresh()

    def start(self, prompt_len: int) -> int | None:
        """Start a new request with a prompt of ``prompt_len`` tokens; return its id or None."""
        seq_id = self._next_id
        try:
            self.manager.add_sequence(seq_id, prompt_len)
        except (OutOfBlocksError, ValueError, TypeError) as err:
            self.message = f"cannot start a request of {prompt_len} tokens: {err}"
            self._refresh()
            return None
        self._next_id += 1
        table = self.manager.block_table(seq_id)
        self.message = f"started req {seq_id}: {prompt_len} prompt tokens in blocks {table}"
        self._refresh()
        return seq_id

    def add_token(self, seq_id: Hashable) -> bool:
        """Append one token to request ``seq_id`` (a decode step for that request)."""
        return self.add_tokens(seq_id, 1)

    def add_tokens(self, seq_id: Hashable, n: int) -> bool:
        """Append ``n`` tokens to request ``seq_id``, all or nothing."""
        if seq_id not in self.manager:
            self.message = f"no request {seq_id!r}"
        elif n < 1:
            self.message = f"add at least one token (got {n})"
        else:
            length = self.manager.seq_len(seq_id)
            have = len(self.manager.block_table(seq_id))
            need = blocks_needed(length + n, self.block_size) - have
            if need > self.manager.num_free_blocks:
                self.message = (f"OUT OF BLOCKS: req {seq_id} needs {need} new block(s) for "
                                f"{n} more token(s) but only {self.manager.num_free_blocks} "
                                f"are free. Nothing changed; finish a request to free blocks.")
            else:
                slots = [self.manager.append_slot(seq_id) for _ in range(n)]
                shown = slots if n <= 4 else [*slots[:2], "...", slots[-1]]
                self.message = (f"req {seq_id}: +{n} token(s) → length {length + n}, slots "
                                f"{shown}, new blocks: {need}")
                self._refresh()
                return True
        self._refresh()
        return False

    def step(self) -> bool:
        """One decode step: one token for every request at once (all or nothing)."""
        seqs = self.manager.seq_ids
        if not seqs:
            self.message = "no requests to step"
            self._refresh()
            return False
        try:
            slots = self.manager.append_slots(seqs)
        except OutOfBlocksError as err:
            self.message = f"OUT OF BLOCKS: {err}. Nothing changed; finish a request."
            self._refresh()
            return False
        self.message = f"decode step: slot mapping {slots}"
        self._refresh()
        return True

    def finish(self, seq_id: Hashable) -> bool:
        """Finish request ``seq_id``: all its blocks go back to the pool."""
        if seq_id not in self.manager:
            self.message = f"no request {seq_id!r}"
            self._refresh()
            return False
        table = self.manager.block_table(seq_id)
        self.manager.free_sequence(seq_id)
        self.message = self._finished(seq_id, table)
        self._refresh()
        return True

    def _finished(self, seq_id: Hashable, table: list[int]) -> str:
        """The message after ``seq_id`` (which held ``table``) is freed."""
        return f"finished req {seq_id}: blocks {table} are free again"

    def figure(self) -> Figure:
        """The current picture (:func:`draw_block_tables`)."""
        return draw_block_tables(self.manager, pool_columns=self.pool_columns)

    # ---- widgets ------------------------------------------------------------------------------

    @property
    def widget(self):
        """The ipywidgets app (built on first use)."""
        if self._widget is None:
            self._build_widget()
            self._refresh()
        return self._widget

    def _ipython_display_(self):
        """The live widget, plus the current picture as a PNG for viewers without a kernel.

        JupyterLab shows the widget; GitHub, nbconvert and a notebook whose widget state was
        not saved show the PNG (tools/execute_notebooks.py keeps only that part).
        """
        from IPython.display import display

        bundle = self.widget._repr_mimebundle_()
        bundle["image/png"] = self._png()
        bundle["text/plain"] = f"{type(self).__name__}: {self.message}"
        display(bundle, raw=True)

    def _png(self) -> bytes:
        png = io.BytesIO()  # a PNG shows whatever matplotlib backend the kernel has
        self.figure().savefig(png, format="png", dpi=80)
        return png.getvalue()

    def _build_widget(self) -> None:
        import ipywidgets as w

        self._request = w.Dropdown(description="request", layout=w.Layout(width="160px"))
        # The label gets its own width ("initial": as wide as its text), so the number box
        # keeps room for 5 digits (with the default label width, "200" showed as "2").
        label = {"description_width": "initial"}
        self._count = w.BoundedIntText(value=4, min=1, max=10_000, description="N",
                                       style=label, layout=w.Layout(width=NUMBER_BOX_WIDTH))
        self._prompt = w.BoundedIntText(value=5, min=0, max=10_000, description="prompt",
                                        style=label, layout=w.Layout(width=NUMBER_BOX_WIDTH))
        buttons = {
            "+1 token": lambda _: self.add_token(self._request.value),
            "+N tokens": lambda _: self.add_tokens(self._request.value, self._count.value),
            "finish": lambda _: self.finish(self._request.value),
            "decode step (all)": lambda _: self.step(),
            "start new request": lambda _: self.start(self._prompt.value),
            "reset": lambda _: self.reset(),
        }
        made = {}
        for label, action in buttons.items():
            b = w.Button(description=label, layout=w.Layout(width="auto"))
            b.on_click(action)
            made[label] = b
        self._status = w.HTML()
        self._out = w.Output()
        self._widget = w.VBox([
            w.HBox([self._request, made["+1 token"], self._count, made["+N tokens"],
                    made["finish"]]),
            w.HBox([made["decode step (all)"], self._prompt, made["start new request"],
                    made["reset"]]),
            self._status,
            self._out,
        ])

    def _refresh(self) -> None:
        if self._widget is None:
            return
        from IPython.display import Image, display

        seqs = self.manager.seq_ids
        current = self._request.value
        self._request.options = [(f"req {s}", s) for s in seqs]
        if seqs:  # keep the chosen request while it lives, else the oldest one
            self._request.value = current if current in seqs else seqs[0]
        colour = "#b00020" if self.message.startswith(("OUT", "cannot")) else "#333333"
        self._status.value = f"<b style='color:{colour}'>{self.message}</b>"
        with self._out:
            self._out.clear_output(wait=True)
            display(Image(data=self._png()))


# ---- Which addresses a kernel read (lesson 04's warm-ups) ------------------------------------


def reads_from_probe(loaded, numel: int) -> list[bool]:
    """Which elements of an *address probe* a kernel read, from the values it loaded.

    An address probe is a tensor of ``numel`` elements whose element at flat index ``a`` holds
    ``a + 1`` (``torch.arange(1, numel + 1, dtype=torch.float32)``, reshaped or viewed as the
    kernel expects). Every value a kernel loads from it names the address it came from; masked
    lanes load ``other`` (0 here), which names none. ``loaded`` is anything with ``.tolist()``
    or a nested sequence of numbers. Returns ``touched[a]`` for ``a`` in ``range(numel)``.
    """
    values = loaded.tolist() if hasattr(loaded, "tolist") else loaded
    flat: list[float] = []
    stack = [values]
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
        else:
            flat.append(item)
    touched = [False] * numel
    for v in flat:
        if v == v and v == int(v) and 1 <= v <= numel:  # v == v: not NaN
            touched[int(v) - 1] = True
    return touched


def draw_memory_reads(touched: Sequence[bool], expected: Sequence[bool], cols: int, *,
                      title: str = "", labels: Sequence[str] | None = None) -> Figure:
    """A buffer's elements as a grid of ``cols`` per row, coloured by what a kernel read.

    ``touched[a]``: the kernel read element ``a`` (e.g. from :func:`reads_from_probe`);
    ``expected[a]``: the spec says it must read it. Green: read, as it should; red: read but
    outside the data (a missed mask); white with a red edge: data it should have read but did
    not; grey: neither. ``labels`` names the rows (e.g. ``["row 0", ...]``).
    """
    if len(touched) != len(expected):
        raise ValueError(f"touched has {len(touched)} elements but expected has {len(expected)}")
    if cols < 1:
        raise ValueError(f"cols must be >= 1, got {cols}")
    rows = -(-len(touched) // cols)
    fig = Figure(figsize=(min(0.32 * cols + 1.6, 12), 0.32 * rows + 0.9), layout="constrained")
    ax = fig.subplots()
    colours = {(True, True): "#4caf50", (True, False): "#e53935", (False, True): EMPTY_COLOR,
               (False, False): FREE_COLOR}
    counts = {key: 0 for key in colours}
    for a, (t, e) in enumerate(zip(touched, expected, strict=True)):
        r, c = divmod(a, cols)
        key = (bool(t), bool(e))
        counts[key] += 1
        edge = "#e53935" if key == (False, True) else "white"
        ax.add_patch(Rectangle((c, rows - 1 - r), 1, 1, facecolor=colours[key], edgecolor=edge,
                               linewidth=1.2))
    ax.set(xlim=(0, cols), ylim=(0, rows), aspect="equal", xticks=[])
    ax.set_yticks([rows - 0.5 - r for r in range(rows)],
                  labels or [f"{r * cols}" for r in range(rows)], fontsize=8)
    ax.tick_params(length=0)
    for side in ax.spines.values():
        side.set_visible(False)
    ax.set_title(f"{title}\nread as specified {counts[(True, True)]}, read outside the data "
                 f"{counts[(True, False)]}, missed {counts[(False, True)]}", fontsize=10)
    return fig


def draw_running_max(values: Sequence[float], block: int, steps: Sequence[float], *,
                     title: str = "") -> Figure:
    """One row walked ``block`` values per loop step: the values (dots, coloured by step) and
    the running max stored after each step (a step line), as in lesson 04's warm-up 4.0c."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    values, steps = list(values), list(steps)
    fig = Figure(figsize=(9, 3), layout="constrained")
    ax = fig.subplots()
    for s in range(-(-len(values) // block)):
        lo, hi = s * block, min((s + 1) * block, len(values))
        colour = PALETTE[s % len(PALETTE)]
        ax.axvspan(lo - 0.5, hi - 0.5, color=colour, alpha=0.08)
        ax.plot(range(lo, hi), values[lo:hi], "o", ms=4, color=colour)
        if s < len(steps) and steps[s] == steps[s]:
            ax.hlines(steps[s], lo - 0.5, hi - 0.5, color="black", lw=2,
                      label="running max stored after the step" if s == 0 else None)
            ax.annotate(f"{steps[s]:.2f}", ((lo + hi - 1) / 2, steps[s]), ha="center",
                        textcoords="offset points", xytext=(0, 4), fontsize=8)
    ax.set(xlabel="position in the row (background: one loop step each)", ylabel="value",
           title=title or f"running max, {block} values per loop step")
    if steps:
        ax.legend(loc="lower right", fontsize=8)
    return fig


# ---- lesson 07: shared blocks, copy-on-write, the prefix cache --------------------------------

SHARED_EDGE = "#111111"
CACHED_COLOR = "#f2f2f2"
COPY_COLOR = "#d62728"


def draw_shared_blocks(manager: KVCacheManager, *, copies: Sequence[tuple[int, int]] = (),
                       title: str | None = None, pool_columns: int = 8, fig=None) -> Figure:
    """Block tables that share blocks: several tables point at one physical block.

    Left: each request's table; a logical block whose physical block has more than one holder
    has a thick black outline and ``→b ×r`` (``r`` = reference count). Right: the pool; a held
    block takes its first holder's colour and shows ``×r`` when shared; a cached block that
    nobody holds is hatched, labelled ``cached`` with its eviction rank (``evict 1st`` goes
    first); plain free blocks are grey. ``copies`` (from ``take_copies()``) are drawn as red
    arrows ``src → dst`` in the pool: the copy-on-write that just happened.

    ``fig``: a Figure or SubFigure to draw into (default: a new Figure). Gids:
    ``"logical:<seq>:<j>"``, ``"pool:<block>"``, ``"copy:<src>:<dst>"``.
    """
    st = manager.stats()
    alloc, bs, nb = manager.allocator, manager.block_size, manager.num_blocks
    seqs = manager.seq_ids
    tables = {s: manager.block_table(s) for s in seqs}
    first_holder: dict[int, Hashable] = {}
    filled: dict[int, int] = {}
    for s in seqs:
        for j, b in enumerate(tables[s]):
            first_holder.setdefault(b, s)
            filled[b] = min(bs, max(0, manager.seq_len(s) - j * bs))
    evict_rank = {b: k + 1 for k, b in enumerate(alloc.evictable_blocks())}
    max_logical = max([len(t) for t in tables.values()] + [3])
    rows = max(len(seqs), -(-nb // pool_columns), 1)
    pitch = 1.3
    if fig is None:
        fig = Figure(figsize=(12, max(2.8, 0.62 * rows + 1.6)), layout="constrained")
    ax_t, ax_p = fig.subplots(1, 2, width_ratios=[max_logical * 1.2 + 2.0, pool_columns * 1.2])
    for row, s in enumerate(seqs):
        y = -row * pitch
        ax_t.text(-0.15, y + 0.35, f"req {s}\n{manager.seq_len(s)} tok", ha="right",
                  va="center", fontsize=9, color=seq_color(s), fontweight="bold")
        for j, b in enumerate(tables[s]):
            refs = alloc.ref_count(b)
            _draw_block(ax_t, j * 1.2, y, 1.0, 0.7, filled[b], bs, seq_color(s),
                        gid=f"logical:{s}:{j}", edge=SHARED_EDGE if refs > 1 else None,
                        linewidth=3.0 if refs > 1 else 1.6)
            ax_t.text(j * 1.2 + 0.5, y + 0.78, f"→{b}" + (f" ×{refs}" if refs > 1 else ""),
                      ha="center", va="bottom", fontsize=8,
                      fontweight="bold" if refs > 1 else "normal")
    ax_t.set_xlim(-2.0, max_logical * 1.2)
    ax_t.set_title("block tables (thick: shared block)", fontsize=10)
    for b in range(nb):
        x, y = (b % pool_columns) * 1.2, -(b // pool_columns) * pitch
        refs = alloc.ref_count(b)
        if refs:
            _draw_block(ax_p, x, y, 1.0, 0.7, filled[b], bs, seq_color(first_holder[b]),
                        gid=f"pool:{b}", edge=SHARED_EDGE if refs > 1 else None,
                        linewidth=3.0 if refs > 1 else 1.6)
            label = f"{b}: {filled[b]}/{bs}" + (f" ×{refs}" if refs > 1 else "")
        else:
            cached = b in evict_rank
            box = Rectangle((x, y), 1.0, 0.7, facecolor=CACHED_COLOR if cached else FREE_COLOR,
                            edgecolor="#777777" if cached else "#aaaaaa",
                            hatch="//" if cached else None, linestyle="--" if cached else "-")
            box.set_gid(f"pool:{b}")
            ax_p.add_patch(box)
            label = f"{b}: cached, evict {_ordinal(evict_rank[b])}" if cached else f"{b}: free"
        ax_p.text(x + 0.5, y + 0.78, label, ha="center", va="bottom", fontsize=7)
    for src, dst in copies:
        (xs, ys), (xd, yd) = [((b % pool_columns) * 1.2 + 0.5, -(b // pool_columns) * pitch)
                              for b in (src, dst)]
        arrow = FancyArrowPatch((xs, ys + 0.35), (xd, yd + 0.35), arrowstyle="-|>",
                                color=COPY_COLOR, linewidth=2, mutation_scale=14,
                                connectionstyle="arc3,rad=0.35")
        arrow.set_gid(f"copy:{src}:{dst}")
        ax_p.add_patch(arrow)
    ax_p.set_xlim(-0.1, pool_columns * 1.2)
    ax_p.set_title("pool (×r: r holders · hatched: cached, unheld · red: copy-on-write)",
                   fontsize=10)
    for ax in (ax_t, ax_p):
        ax.set_ylim(-(rows - 1) * pitch - 0.2, 1.3)
        ax.axis("off")
    for row, s in enumerate(seqs):
        for j, b in enumerate(tables[s]):
            xb, yb = (b % pool_columns) * 1.2, -(b // pool_columns) * pitch
            fig.add_artist(ConnectionPatch(
                xyA=(j * 1.2 + 1.0, -row * pitch + 0.35), coordsA=ax_t.transData,
                xyB=(xb, yb + 0.35), coordsB=ax_p.transData, arrowstyle="->",
                color=seq_color(s), alpha=0.35, linewidth=0.8))
    numbers = (f"{st.blocks_used} of {nb} blocks held ({st.blocks_shared} shared) · "
               f"{st.blocks_evictable} cached & evictable · "
               f"{st.blocks_free - st.blocks_evictable} plain free · "
               f"{st.tokens_stored} tokens in {st.blocks_used * bs} slots")
    if manager.enable_prefix_caching:
        numbers += f" · prefix hit rate {100 * st.prefix_hit_rate:.0f}%"
    fig.suptitle(f"{title}\n{numbers}" if title else numbers, fontsize=11)
    return fig


def _ordinal(k: int) -> str:
    return f"{k}{'st' if k == 1 else 'nd' if k == 2 else 'rd' if k == 3 else 'th'}"


def draw_prefix_tree(manager: KVCacheManager, *, title: str | None = None,
                     max_tokens_shown: int = 4, fig=None) -> Figure:
    """The prefix cache as a tree: one node per cached full block, an edge from the block
    before it in the prompt (its parent hash) to it.

    A node shows the physical block, the hash's first hex digits and the first tokens; held
    nodes are blue with their reference count, evictable ones (nobody holds them) hatched
    grey with their eviction rank. Prompts that share a prefix share a path from the root, so
    a hit is a walk down the tree. Node gids: ``"node:<block>"``.
    """
    entries = manager.cached_blocks()
    by_hash = {e.block_hash: e for e in entries}
    children: dict[bytes | None, list] = {}
    for e in entries:
        parent = e.parent_hash if e.parent_hash in by_hash else None
        children.setdefault(parent, []).append(e)
    evict_rank = {b: k + 1 for k, b in enumerate(manager.allocator.evictable_blocks())}
    placed: list[tuple] = []  # (entry, depth, row)

    def place(e, depth: int, row: list[int]) -> float:
        kids = children.get(e.block_hash, [])
        if not kids:
            y = row[0]
            row[0] += 1
        else:
            y = sum(place(k, depth + 1, row) for k in kids) / len(kids)
        placed.append((e, depth, y))
        return y

    row = [0]
    for root in children.get(None, []):
        place(root, 0, row)
    depth = max([d for _, d, _ in placed] + [0]) + 1
    if fig is None:
        fig = Figure(figsize=(min(14, 2.2 * depth + 2), max(2.2, 0.75 * row[0] + 1.2)),
                     layout="constrained")
    ax = fig.subplots()
    pos = {e.block_hash: (d * 2.2, -y) for e, d, y in placed}
    for e, _, _ in placed:
        x, yy = pos[e.block_hash]
        if e.parent_hash in pos:
            px, py = pos[e.parent_hash]
            ax.add_patch(FancyArrowPatch((px + 1.6, py + 0.3), (x, yy + 0.3), arrowstyle="->",
                                         color="#555555", mutation_scale=10))
        held = e.ref_count > 0
        box = Rectangle((x, yy), 1.6, 0.6, facecolor="#cfe0f3" if held else CACHED_COLOR,
                        edgecolor="#4c72b0" if held else "#777777",
                        hatch=None if held else "//", linestyle="-" if held else "--")
        box.set_gid(f"node:{e.block_id}")
        ax.add_patch(box)
        toks = " ".join(map(str, e.token_ids[:max_tokens_shown]))
        toks += " …" if len(e.token_ids) > max_tokens_shown else ""
        state = f"×{e.ref_count}" if held else f"evict {_ordinal(evict_rank[e.block_id])}"
        ax.text(x + 0.8, yy + 0.3, f"block {e.block_id} · #{e.block_hash.hex()[:4]}\n[{toks}]"
                f"\n{state}", ha="center", va="center", fontsize=7)
    ax.set_xlim(-0.2, depth * 2.2)
    ax.set_ylim(-max(row[0], 1) + 0.2, 1.0)
    ax.axis("off")
    if not entries:
        ax.text(0.5, 0.5, "prefix cache empty" + ("" if manager.enable_prefix_caching
                                                  else " (prefix caching is off)"),
                transform=ax.transAxes, ha="center", color="grey")
    held = sum(e.ref_count > 0 for e in entries)
    numbers = (f"prefix cache: {len(entries)} blocks ({held} held, {len(entries) - held} "
               f"evictable) · hash = sha256(parent hash, token ids)")
    fig.suptitle(f"{title}\n{numbers}" if title else numbers, fontsize=10)
    return fig


class SharingExplorer(BlockTableExplorer):
    """:class:`BlockTableExplorer` with sharing: fork a request, start requests that share a
    system prompt (prefix cache), and watch copy-on-write and the prefix tree.

        ex = SharingExplorer(num_blocks=24, block_size=4, system_prompt_len=8)
        ex.ask(3)        # a request: the system prompt + 3 new tokens (prefix-cache lookup)
        ex.fork(0)       # request 0 forks (parallel sampling): every block shared
        ex.add_token(1)  # the fork writes into the shared last block: copy-on-write
        ex.figure()      # tables + pool (shared blocks, the copy) and the prefix tree

    Token ids are made up: the system prompt is ``1 .. system_prompt_len``; every other token
    is a fresh id, so only the system prompt (and forks) are shared.
    """

    def __init__(self, num_blocks: int = 24, block_size: int = 4, prompts: Sequence[int] = (),
                 *, system_prompt_len: int = 8, enable_prefix_caching: bool = True,
                 pool_columns: int = 8) -> None:
        self.system_prompt = list(range(1, system_prompt_len + 1))
        self.enable_prefix_caching = enable_prefix_caching
        self.copies: list[tuple[int, int]] = []
        self._next_token = 1000
        super().__init__(num_blocks, block_size, prompts, pool_columns=pool_columns)

    def _fresh_tokens(self, n: int) -> list[int]:
        self._next_token += n
        return list(range(self._next_token - n, self._next_token))

    def reset(self) -> None:
        """Empty the cache (and the prefix cache) and start the initial requests again."""
        self.manager = KVCacheManager(self.num_blocks, self.block_size,
                                      enable_prefix_caching=self.enable_prefix_caching)
        self._next_id, self.copies = 0, []
        for p in self.prompts:
            self.start(p)
        self.message = f"reset: {len(self.manager)} requests"
        self._refresh()

    def start(self, prompt_len: int) -> int | None:
        """Start a request of ``prompt_len`` fresh tokens (shares nothing)."""
        return self.start_tokens(self._fresh_tokens(prompt_len)) if prompt_len else None

    def ask(self, question_len: int) -> int | None:
        """Start a request: the system prompt + ``question_len`` fresh tokens."""
        return self.start_tokens(self.system_prompt + self._fresh_tokens(question_len))

    def start_tokens(self, token_ids: Sequence[int]) -> int | None:
        """Start a request with these token ids; with prefix caching, reuse cached blocks."""
        seq_id = self._next_id
        try:
            cached = self.manager.add_sequence(seq_id, token_ids=list(token_ids))
        except (OutOfBlocksError, ValueError, TypeError) as err:
            self.message = f"cannot start a request of {len(token_ids)} tokens: {err}"
            self._refresh()
            return None
        self._next_id += 1
        self.copies = []
        self.message = (f"started req {seq_id}: {len(token_ids)} prompt tokens, {cached} "
                        f"found in the prefix cache (blocks shared, not computed), blocks "
                        f"{self.manager.block_table(seq_id)}")
        self._refresh()
        return seq_id

    def fork(self, seq_id: Hashable) -> int | None:
        """Fork request ``seq_id`` (one more sample of it): the child shares every block."""
        if seq_id not in self.manager:
            self.message = f"no request {seq_id!r}"
            self._refresh()
            return None
        child = self._next_id
        self.manager.fork(seq_id, child)
        self._next_id += 1
        self.copies = []
        table = self.manager.block_table(child)
        self.message = (f"forked req {seq_id} → req {child}: blocks {table} shared, no K/V "
                        f"copied; holders now {[self.manager.ref_count(b) for b in table]}")
        self._refresh()
        return child

    def add_tokens(self, seq_id: Hashable, n: int) -> bool:
        """Append ``n`` tokens to ``seq_id``, all or nothing; a write into a shared last block
        is a copy-on-write (shown in red)."""
        if seq_id not in self.manager or n < 1:
            self.message = f"no request {seq_id!r}" if n >= 1 else f"add at least one token ({n})"
            self._refresh()
            return False
        m, length = self.manager, self.manager.seq_len(seq_id)
        table = m.block_table(seq_id)
        need = blocks_needed(length + n, self.block_size) - len(table)
        need += length % self.block_size != 0 and m.ref_count(table[-1]) > 1
        if need > m.num_free_blocks:
            self.message = (f"OUT OF BLOCKS: req {seq_id} needs {need} new block(s) but only "
                            f"{m.num_free_blocks} are free. Nothing changed.")
            self._refresh()
            return False
        for token in self._fresh_tokens(n):
            m.append_slot(seq_id, token)
        self.copies = m.take_copies()
        done = f"copy-on-write {self.copies}" if self.copies else "no copy"
        self.message = f"req {seq_id}: +{n} token(s) → length {length + n}, {done}"
        self._refresh()
        return True

    def step(self) -> bool:
        """One decode step for every request (all or nothing); copy-on-writes shown in red."""
        seqs = self.manager.seq_ids
        try:
            self.manager.append_slots(seqs, self._fresh_tokens(len(seqs)))
        except OutOfBlocksError as err:
            self.message = f"OUT OF BLOCKS: {err}. Nothing changed; finish a request."
            self._refresh()
            return False
        self.copies = self.manager.take_copies()
        self.message = f"decode step for {len(seqs)} requests, copy-on-writes {self.copies}"
        self._refresh()
        return bool(seqs)

    def finish(self, seq_id: Hashable) -> bool:
        """Finish ``seq_id``: each block loses a holder; cached ones stay, evictable."""
        self.copies = []
        return super().finish(seq_id)

    def _finished(self, seq_id: Hashable, table: list[int]) -> str:
        holders = [self.manager.ref_count(b) for b in table]
        return (f"finished req {seq_id}: blocks {table} lost a holder (now {holders}); "
                f"full blocks nobody holds stay cached until the pool needs them")

    def figure(self) -> Figure:
        """Tables + pool (shared blocks, the last copy-on-write) above the prefix tree."""
        fig = Figure(figsize=(12, 4.2 + 0.62 * max(len(self.manager), -(-self.num_blocks
                                                                        // self.pool_columns))),
                     layout="constrained")
        top, bottom = fig.subfigures(2, 1, height_ratios=[1.6, 1])
        draw_shared_blocks(self.manager, copies=self.copies, pool_columns=self.pool_columns,
                           fig=top)
        draw_prefix_tree(self.manager, fig=bottom)
        return fig

    def _build_widget(self) -> None:
        import ipywidgets as w

        super()._build_widget()
        fork = w.Button(description="fork (one more sample)", layout=w.Layout(width="auto"))
        fork.on_click(lambda _: self.fork(self._request.value))
        ask = w.Button(description="ask: system prompt + N tokens",
                       layout=w.Layout(width="auto"))
        ask.on_click(lambda _: self.ask(self._count.value))
        rows = list(self._widget.children)
        self._widget.children = (*rows[:2], w.HBox([fork, ask]), *rows[2:])
