"""The pictures of lesson 10's deep dives (10a, 10b, 10c), drawn from the readers of
:mod:`paged_course.quant_deep`, from :mod:`paged_course.banks` or as labelled schematics. Each
returns a matplotlib ``Figure`` (a notebook shows it; nothing is drawn on a global figure)."""

from __future__ import annotations

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, Rectangle

from paged_course import banks


def _bars(ax, labels, values, colours=None, fmt="{:.0f}", horizontal=False):
    """Bars with their values written at their ends."""
    at = range(len(values))
    bars = (ax.barh if horizontal else ax.bar)(at, values, color=colours)
    for bar, v in zip(bars, values, strict=True):
        if horizontal:
            ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, " " + fmt.format(v),
                    va="center", fontsize=7)
        else:
            ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), fmt.format(v),
                    ha="center", va="bottom", fontsize=7)
    (ax.set_yticks if horizontal else ax.set_xticks)(list(at), labels, fontsize=7)


# ---- 10a -------------------------------------------------------------------------------------

def plot_two_products():
    """Schematic: a tile of K or V as stored (a token's channels contiguous), and the axis each
    product sums over. S = q K^T sums along a row (as stored); O = p V sums down a column, so
    V's operand must be transposed on its way to the tensor cores."""
    fig = Figure(figsize=(11, 3.6))
    for ax, title, along_row in zip(fig.subplots(1, 2), (
            "S = q · K^T sums over channels: along each stored row",
            "O = p · V sums over tokens: down each column"), (True, False), strict=True):
        rows, cols = 8, 16
        for r in range(rows):
            for c in range(cols):
                ax.add_patch(Rectangle((c, rows - 1 - r), 1, 1, fc="#dde7f3", ec="w", lw=1))
        ax.add_patch(FancyArrowPatch((0, rows + 0.4), (cols, rows + 0.4), arrowstyle="->",
                                     mutation_scale=12, color="0.3"))
        ax.text(cols / 2, rows + 0.7, "bytes contiguous in memory (one token's channels)",
                ha="center", fontsize=8, color="0.3")
        if along_row:
            ax.add_patch(Rectangle((0, rows - 3), cols, 1, fc="none", ec="#d62728", lw=2))
            ax.text(cols + 0.3, rows - 2.5, "one dot:\na row as loaded", fontsize=8,
                    color="#d62728", va="center")
        else:
            ax.add_patch(Rectangle((5, 0), 1, rows, fc="none", ec="#d62728", lw=2))
            ax.text(cols + 0.3, rows / 2, "one dot: a column,\nelements a row apart:\n"
                    "the operand is\ntransposed on the way\n(ldmatrix.trans: 16-bit\n"
                    "elements only)", fontsize=8, color="#d62728", va="center")
        ax.set(xlim=(-0.5, cols + 6), ylim=(-0.8, rows + 1.2), title=title)
        ax.set_xlabel("channels (head_dim)", fontsize=8)
        ax.set_ylabel("tokens of the tile", fontsize=8)
        ax.set_xticks([])
        ax.set_yticks([])
        ax.set_aspect("equal")
    fig.tight_layout()
    return fig


def plot_reads_and_halves(reads: dict, halves: dict):
    """Left: reading only, % of copy bandwidth per format with one KV head a row and all heads
    of a token in one row. Right: the stripped attention kernel per K / V format mix."""
    fig = Figure(figsize=(11, 3.6))
    left, right = fig.subplots(1, 2)
    fmts = list(reads)
    for i, key in enumerate(("per_head", "all_heads")):
        xs = [j + (i - 0.5) * 0.38 for j in range(len(fmts))]
        bars = left.bar(xs, [reads[f][key] for f in fmts], 0.38,
                        label="one KV head a row" if i == 0 else "all heads of a token a row")
        for bar in bars:
            left.text(bar.get_x() + 0.19, bar.get_height(), f"{bar.get_height():.0f}",
                      ha="center", va="bottom", fontsize=7)
    left.set_xticks(range(len(fmts)), [f"{f}\n({reads[f]['row_bytes']} B rows)" for f in fmts])
    left.set(ylabel="% of copy bandwidth", ylim=(0, 110), title="reading only, nothing computed")
    left.legend(fontsize=7, loc="lower left")
    labels = list(halves)
    _bars(right, labels, [halves[k]["pct_copy_bw"] for k in labels],
          ["#1f77b4" if "fp8 V" not in k else "#d62728" for k in labels])
    right.set(ylabel="% of copy bandwidth", ylim=(0, 110),
              title="stripped attention kernel: which half is slow? (red: FP8 V)")
    fig.tight_layout()
    return fig


def plot_sass_mix(mix: dict, opcodes=("LDS", "LDSM", "F2FP", "HMMA")):
    """Machine instructions of each compiled Triton decode kernel (sm_90), a group per kernel."""
    fig = Figure(figsize=(11, 3.6))
    ax = fig.subplots()
    rows = mix["rows"]
    width = 0.8 / len(opcodes)
    for i, op in enumerate(opcodes):
        xs = [j + (i - (len(opcodes) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, [r[op] for r in rows], width, label=op)
    ax.set_xticks(range(len(rows)), [_wrap(r["label"], 24) for r in rows], fontsize=7)
    ax.set(ylabel="instructions in the kernel", title=f"SASS for sm_90 (Triton {mix['triton']},"
           " compiled on a CPU): LDS = a shared load, LDSM = ldmatrix, F2FP = a conversion")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_pv_paths(paths: list[dict]):
    """% of copy bandwidth of each way to compute p @ V (best launch config), fastest on top."""
    fig = Figure(figsize=(9, 3.8))
    ax = fig.subplots()
    rows = list(reversed(paths))
    _bars(ax, [f"{r['path']}; V {r['v_layout']}" for r in rows], [r["pct"] for r in rows],
          ["#2ca02c" if r["v_layout"] == "transposed" else "#1f77b4" for r in rows],
          horizontal=True)
    ax.axvline(100, color="k", lw=0.8, ls="--")
    ax.set(xlabel="% of copy bandwidth (FP8 K and V, B64_L4096)", xlim=(0, 110),
           title="p @ V in Triton: green = V stored transposed per block")
    fig.tight_layout()
    return fig


# ---- 10b -------------------------------------------------------------------------------------

def plot_fragment_owners(kind: str = "fp8", head_dim: int = 128):
    """Which lane of a warp reads each 16-byte piece of a 16-token K tile and V tile (one tile
    step of the CUDA kernels, from :func:`paged_course.banks.fragment_reads`)."""
    row_bytes, reads = banks.fragment_reads(kind, head_dim)
    k_bytes = head_dim // 4 if kind == "fp8" else head_dim // 8  # a thread's bytes of a K row
    k_reads = 2 * -(-k_bytes // 16)  # (the K loads come first: 2 rows, 16 bytes a load)
    fig = Figure(figsize=(12, 4.4))
    for ax, name, part in zip(fig.subplots(1, 2), ("K", "V"), (reads[:k_reads],
                                                              reads[k_reads:]), strict=True):
        owner = [[-1] * (row_bytes // 16) for _ in range(16)]
        for size, lanes in part:
            for lane, (row, byte) in enumerate(lanes):
                for b in range(byte, byte + size, 16):
                    owner[row][b // 16] = lane
        ax.imshow(owner, cmap="tab20b", aspect="auto", vmin=0, vmax=31)
        for r, line in enumerate(owner):
            for c, lane in enumerate(line):
                ax.text(c, r, str(lane), ha="center", va="center", fontsize=6, color="w")
        ax.set(title=f"{name} tile ({kind}, head_dim {head_dim}): lane reading each 16 B",
               xlabel=f"16-byte piece of the {row_bytes}-byte token row", ylabel="token")
    fig.tight_layout()
    return fig


def plot_bank_layouts(row_bytes: int = 128, rows: int = 8):
    """Where the 16-byte chunks of a tile's first ``rows`` rows land in shared memory in each
    layout: the colour is the 16-byte bank group, the number the 128-byte shared line (two
    numbers in one row: the cache line was split, two L2 requests)."""
    fig = Figure(figsize=(12, 3.4))
    for ax, layout in zip(fig.subplots(1, 3), banks.LAYOUTS, strict=True):
        groups = [[banks.place(layout, r, c * 16, row_bytes) % 128 // 16
                   for c in range(row_bytes // 16)] for r in range(rows)]
        ax.imshow(groups, cmap="tab10", vmin=0, vmax=9, aspect="auto")
        for r in range(rows):
            for c in range(row_bytes // 16):
                line = banks.place(layout, r, c * 16, row_bytes) // 128
                ax.text(c, r, str(line), ha="center", va="center", fontsize=7, color="w")
        whole = banks.lines_stay_whole(layout, row_bytes)
        ax.set(title=f"{layout}: lines {'whole' if whole else 'split'}",
               xlabel="16-byte chunk of the row", ylabel="tile row (token)")
    fig.suptitle(f"{row_bytes}-byte rows in shared memory (colour: bank group; number: shared "
                 "128-byte line)", fontsize=9)
    fig.tight_layout()
    return fig


def plot_tile_instructions(kernels: dict[str, dict]):
    """Instructions a 16-token tile of one KV head, stacked by pipe, one bar per kernel."""
    fig = Figure(figsize=(8, 3.6))
    ax = fig.subplots()
    names = list(kernels)
    pipes = list(next(iter(kernels.values()))["pipes"])
    bottom = [0.0] * len(names)
    for pipe in pipes:
        values = [kernels[n]["pipes"][pipe]["per_tile"] for n in names]
        ax.bar(names, values, bottom=bottom, label=pipe)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, total in enumerate(bottom):
        ax.text(i, total, f"{total:.0f}", ha="center", va="bottom", fontsize=8)
    ax.set(ylabel="warp instructions a tile", title="where a tile's instructions go (ncu)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    return fig


def plot_launch_sweep(sweeps: dict[str, list[dict]], case: str):
    """Every launch shape of the CUDA kernels on ``case``, fastest first, per format."""
    fig = Figure(figsize=(11, 3.4))
    for ax, (fmt, rows) in zip(fig.subplots(1, len(sweeps), squeeze=False)[0], sweeps.items(),
                               strict=True):
        ax.plot([r["pct_copy_bw"] for r in rows], "o-", ms=3)
        ax.set(title=f"{fmt}, {case}: {len(rows)} launch shapes", xlabel="rank (fastest first)",
               ylabel="% of copy bandwidth")
        for i in (0, len(rows) - 1):
            ax.annotate(rows[i]["label"].removeprefix("cuda"), (i, rows[i]["pct_copy_bw"]),
                        fontsize=6, ha="left" if i == 0 else "right")
    fig.tight_layout()
    return fig


def plot_design_steps(steps: list[dict]):
    """% of copy bandwidth of the CUDA kernels at each design step, FP8 and INT4."""
    fig = Figure(figsize=(11, 3.8))
    ax = fig.subplots()
    for i, fmt in enumerate(("fp8", "int4")):
        xs = [j + (i - 0.5) * 0.38 for j in range(len(steps))]
        pcts = [s[f"{fmt} pct"] or 0 for s in steps]
        bars = ax.bar(xs, pcts, 0.38, label=fmt)
        for bar, s in zip(bars, steps, strict=True):
            if s[f"{fmt} ms"]:
                ax.text(bar.get_x() + 0.19, bar.get_height(), f"{1000 * s[f'{fmt} ms']:.0f}"
                        " µs", ha="center", va="bottom", fontsize=6)
    ax.set_xticks(range(len(steps)), [_wrap(s["label"], 22) for s in steps], fontsize=6)
    ax.set(ylabel="% of copy bandwidth, B64_L4096", ylim=(0, 100),
           title="what each design step bought (one quant-suite run each)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def _wrap(text: str, width: int) -> str:
    lines, line = [], ""
    for word in text.split():
        if line and len(line) + len(word) > width:
            lines.append(line)
            line = word
        else:
            line = f"{line} {word}".strip()
    return "\n".join([*lines, line])


# ---- 10c -------------------------------------------------------------------------------------

def plot_fixed_cost(rows: list[dict], fits: dict[str, dict], copy_bw_gbps: float):
    """Time of one sequence against its bytes, per format, with the fitted line continued to
    zero bytes (where it meets the axis: the fixed cost a call) and the copy-bandwidth line."""
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    top = 1.05 * max(r["bytes"] for r in rows) / 1e6
    ax.plot([0, top], [0, 1000 * top / copy_bw_gbps], "k--", lw=0.8,
            label="copy bandwidth, no fixed cost")
    for fmt, fit in fits.items():
        mine = [r for r in rows if r["kv_format"] == fmt]
        ax.plot([r["bytes"] / 1e6 for r in mine], [1000 * r["ms"] for r in mine], "o",
                label=f"{fmt} (one sequence, 16k-256k tokens)")
        slope = 1000 / (copy_bw_gbps * fit["streaming_pct_copy_bw"] / 100)  # µs per MB
        ax.plot([0, top], [fit["fixed_us"], fit["fixed_us"] + slope * top], lw=0.8,
                label=f"{fmt}: {fit['fixed_us']:.1f} µs + bytes at "
                      f"{fit['streaming_pct_copy_bw']:.0f} %")
    ax.set(xlabel="MB read", ylabel="µs a call", xlim=(0, top), ylim=(0, None),
           title="a short call pays a fixed cost that a long one hides")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_flush_bias(rows: list[dict]):
    """µs that do_bench's zeroing flush billed each kernel (its time minus the clean-L2 time),
    per case, next to what it billed a plain copy of the same bytes (mean over the kernels'
    byte counts)."""
    fig = Figure(figsize=(11, 3.6))
    ax = fig.subplots()
    kernels = list(dict.fromkeys(r["kernel"] for r in rows))
    cases = list(dict.fromkeys(r["case"] for r in rows))
    width = 0.8 / (len(kernels) + 1)

    def offset(i):
        return (i - len(kernels) / 2) * width

    for i, name in enumerate(kernels):
        got = {r["case"]: r["billed_us"] for r in rows if r["kernel"] == name}
        ax.bar([j + offset(i) for j, c in enumerate(cases) if c in got],
               [got[c] for c in cases if c in got], width, label=name)
    copies = [[r["copy_billed_us"] for r in rows if r["case"] == c] for c in cases]
    ax.bar([j + offset(len(kernels)) for j in range(len(cases))],
           [sum(c) / len(c) for c in copies], width, hatch="//", fc="w", ec="k",
           label="a copy of the same bytes")
    ax.set_xticks(range(len(cases)), cases, fontsize=8)
    ax.set(ylabel="µs billed by the zeroing flush",
           title="do_bench's flush leaves dirty lines: a reading kernel pays their write-back")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    return fig


def plot_ceilings(rows: list[dict], bar_pct: float = 85.0):
    """% of copy bandwidth against MB: a plain copy of each case's bytes and the CUDA kernel
    on them (same GPU call), per format, with the 85 % line."""
    fig = Figure(figsize=(8, 4))
    ax = fig.subplots()
    for fmt, mark in (("fp8", "o"), ("int4", "s")):
        mine = sorted((r for r in rows if r["kv_format"] == fmt), key=lambda r: r["mb"])
        mb = [r["mb"] for r in mine]
        ax.plot(mb, [r["copy_pct"] for r in mine], mark + "-", label=f"copy of {fmt}'s bytes")
        ax.plot(mb, [r["copy_pct"] * r["kernel_vs_copy_pct"] / 100 for r in mine], mark + ":",
                label=f"{fmt} kernel")
    ax.axhline(bar_pct, color="k", lw=0.8, ls="--", label=f"{bar_pct:.0f} %")
    ax.set(xlabel="MB a call moves", ylabel="% of copy bandwidth (a 2 GB copy's)",
           title="the ceiling depends on the size: compare with a copy of the same bytes")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


def plot_host_in_timer(before: dict, after: dict):
    """Bench time and CUDA-graph time of each call, before and after the host-time fix, with
    the host's µs a call written over each pair."""
    fig = Figure(figsize=(11, 3.6))
    for ax, (title, part) in zip(fig.subplots(1, 2), (("before", before), ("after", after)),
                                 strict=True):
        rows = part["rows"]
        labels = [f"{r['case']}\n{r['kv_format']}" for r in rows]
        at = range(len(rows))
        ax.bar([x - 0.2 for x in at], [1000 * r["bench_ms"] for r in rows], 0.4, label="bench")
        ax.bar([x + 0.2 for x in at], [1000 * r["graph_ms"] for r in rows], 0.4,
               label="CUDA graph")
        for x, r in zip(at, rows, strict=True):
            ax.text(x, 1000 * max(r["bench_ms"], r["graph_ms"]) + 3,
                    f"host {r['host_us']:.0f} µs", ha="center", fontsize=7)
        ax.set_xticks(list(at), labels, fontsize=7)
        ax.set(ylabel="µs a call", title=f"{title}: bench vs graph", ylim=(0, 170))
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return fig
