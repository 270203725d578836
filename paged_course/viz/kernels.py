"""Pictures of how a kernel's programs cover the work and what they read (lessons 00, 04, 05).

    draw_masked_programs(20, 8)                         # lesson 00: a 1-D launch and its mask
    draw_program_walk(inputs, b=1, h=0, tile=8)         # lesson 04: one program's walk
    draw_sm_occupancy(ax, programs=8, num_sms=132, programs_per_sm=4, title="one pass")
    draw_memory_reads(reads_from_probe(out, n), expected, cols=12)   # lesson 04's warm-ups
    draw_running_max(values, 8, steps)                  # warm-up 4.0c
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.figure import Figure
from matplotlib.patches import ConnectionPatch, Rectangle

from paged_course.viz.style import EMPTY_COLOR, FREE_COLOR, PALETTE
from paged_ref.cache_math import blocks_needed, cdiv


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
