"""Pictures of shared blocks, copy-on-write and the prefix cache (lesson 07).

    draw_shared_blocks(manager, copies=manager.take_copies())   # tables + pool, ×r holders
    draw_prefix_tree(manager)                                    # the cached blocks as a tree
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch, FancyArrowPatch, Rectangle

from paged_course.viz.style import FREE_COLOR, draw_block, seq_color
from paged_ref.memory.manager import KVCacheManager

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
            draw_block(ax_t, j * 1.2, y, 1.0, 0.7, filled[b], bs, seq_color(s),
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
            draw_block(ax_p, x, y, 1.0, 0.7, filled[b], bs, seq_color(first_holder[b]),
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
