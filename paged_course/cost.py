"""Lesson 06 support: the cost around a kernel, measured, and the lesson's pictures.

* :func:`forbid_host_reads`: a context in which reading a tensor value back to Python raises
  (the CPU stand-in for ``torch.cuda.set_sync_debug_mode("error")``, which it also sets on a GPU);
* :func:`call_steps_us`: host microseconds of each step of one ``paged_attention`` call;
* :func:`plot_call_steps`, :func:`decode_table`, :func:`plot_page_size`, :func:`plot_roofline`:
  the pictures and tables, from live numbers or from the committed GPU JSON.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

import numpy as np
import torch

#: Tensor methods that copy values to the host (and so wait for the GPU).
HOST_READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


class HostReadError(RuntimeError):
    """A tensor value was read back to the host where none may be."""


@contextlib.contextmanager
def forbid_host_reads() -> Iterator[None]:
    """Inside the block, ``t.item()``, ``t.tolist()``, ``t.cpu()``, ``t.numpy()``, ``int(t)``,
    ``float(t)``, ``bool(t)`` raise :class:`HostReadError` naming the method; on a GPU
    ``torch.cuda.set_sync_debug_mode("error")`` also makes any synchronising CUDA call raise.
    (Triton's interpreter copies tensors itself: use it with the torch backend on a CPU.)"""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def forbidden(name):
        def method(*args, **kwargs):
            raise HostReadError(f"Tensor.{name}() reads a value back to the host (a sync)")
        return method

    cuda = torch.cuda.is_available()
    try:
        for name in HOST_READS:
            setattr(torch.Tensor, name, forbidden(name))
        if cuda:
            torch.cuda.set_sync_debug_mode("error")
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)
        if cuda:
            torch.cuda.set_sync_debug_mode("default")


def host_us(fn: Callable[[], object], calls: int = 50) -> float:
    """Host microseconds per call of ``fn``: the median of ``calls`` calls, each started with
    the GPU idle (synchronised before, not after: its kernels are not awaited)."""
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    fn()
    times = []
    for _ in range(calls):
        sync()
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    sync()
    return float(np.median(times) * 1e6)


#: The steps of one public call, in order, as :func:`call_steps_us` names them.
STEPS = ("check_shapes", "check_values", "dispatch_and_scratch", "allocate_out", "launch")


def call_steps_us(inp, calls: int = 50) -> dict[str, float]:
    """Host microseconds of each step of ``paged_attention(*inp.args())`` on ``inp``'s device,
    and of the whole call with and without a plan.

    Steps (:data:`STEPS`): ``check_shapes`` (types, shapes, devices: no values read);
    ``check_values`` (lengths and used table entries: one copy to the host, so a sync on a GPU);
    ``dispatch_and_scratch`` (pick backend and split, allocate the split's buffers);
    ``allocate_out``; ``launch`` (the backend itself: on a GPU, the kernel launches; on a CPU,
    the whole computation). Then ``unplanned_call`` and ``planned_call`` (with ``plan=`` and
    ``out=``). Each call starts with the GPU idle, so a sync costs only its round trip here
    (behind queued kernels it would also wait for them).
    """
    from paged_ref.attention import checks_on_device, paged_attention, run_plan
    from paged_ref.plan import make_plan, plan_decode
    from paged_ref.validation import check_shapes, check_values

    def check_lengths(block_tables, seq_lens, shapes):  # as paged_attention does, unplanned
        stats = None
        if checks_on_device(seq_lens):
            from paged_ref.kernels.triton.checks import length_stats

            stats = length_stats(block_tables, seq_lens, shapes.block_size, shapes.num_blocks)
        return check_values(block_tables, seq_lens, shapes, stats)

    args = inp.args()
    shapes = check_shapes(*args)
    lengths = check_lengths(inp.block_tables, inp.seq_lens, shapes)
    plan = plan_decode(inp.seq_lens.tolist(), num_q_heads=shapes.num_q_heads,
                       num_kv_heads=shapes.num_kv_heads, head_dim=shapes.head_dim,
                       block_size=shapes.block_size, dtype=inp.q.dtype, device=inp.q.device)
    out = torch.empty_like(inp.q)
    steps = {
        "check_shapes": lambda: check_shapes(*args),
        "check_values": lambda: check_lengths(inp.block_tables, inp.seq_lens, shapes),
        "dispatch_and_scratch": lambda: make_plan(
            "auto", shapes, inp.q.dtype, inp.q.device, max_len=lengths.max_len,
            total_tokens=lengths.total_tokens, max_seq_len=lengths.max_len, scale=None),
        "allocate_out": lambda: torch.empty_like(inp.q),
        "launch": lambda: run_plan(plan, *args, out),
        "unplanned_call": lambda: paged_attention(*args),
        "planned_call": lambda: paged_attention(*args, plan=plan, out=out),
    }
    return {name: host_us(fn, calls) for name, fn in steps.items()} | {"picked": plan.backend}


def plot_call_steps(rows: list[dict], *, title: str = "", gpu_ms: dict | None = None, ax=None):
    """Stacked horizontal bars: host µs of each step of one call, per row (``rows`` from
    :func:`call_steps_us` or the committed ``host_us``, each with a ``"label"`` or ``"case"``),
    plus the planned call's host µs, and the GPU time per label when ``gpu_ms`` gives it."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(9, 0.9 + 0.9 * len(rows)))
    colors = plt.get_cmap("tab10").colors
    for i, row in enumerate(rows):
        left = 0.0
        for j, step in enumerate(STEPS):
            width = row.get(step, 0.0)
            ax.barh(i + 0.18, width, 0.32, left=left, color=colors[j],
                    label=step if i == 0 else None)
            left += width
        ax.barh(i - 0.18, row["planned_call"], 0.32, color="0.55",
                label="planned call (plan=, out=)" if i == 0 else None)
        label = row.get("label", row.get("case"))
        if gpu_ms and label in gpu_ms:
            ax.axvline(gpu_ms[label] * 1e3, ymin=(i + 0.05) / len(rows),
                       ymax=(i + 0.95) / len(rows), color="k", ls="--",
                       label="kernel GPU time" if i == 0 else None)
    ax.set_yticks(range(len(rows)), [r.get("label", r.get("case")) for r in rows])
    ax.set_xlabel("host microseconds per call")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return ax


#: Columns of :func:`decode_table`: the kernel alone, the public call three ways, the peers.
TABLE_COLUMNS = ("kernel", "auto", "auto_planned", "auto_graph", "flashinfer",
                 "sdpa_contiguous")


def decode_table(bench: dict) -> tuple[list[str], list[list]]:
    """Headers and rows (ms and % of copy bandwidth per case) from a bench JSON: the kernel
    that ``auto`` picks called directly, then no plan / plan / graph, FlashInfer, SDPA."""
    best = {(r["case"], r["backend"]): r for r in bench["results"] if r.get("best")}
    cases = list(dict.fromkeys(r["case"] for r in bench["results"]))
    rows = []
    for case in cases:
        picked = best.get((case, "auto_planned"), best.get((case, "auto"), {})).get("picked")
        cells = [case]
        for column in TABLE_COLUMNS:
            row = best.get((case, picked if column == "kernel" else column))
            cells.append("-" if row is None else f"{row['ms']:.4f} ({row['pct_copy_bw']:.0f}%)")
        rows.append(cells)
    headers = ["case"] + [f"{c} ms (% copy bw)" for c in TABLE_COLUMNS]
    return headers, rows


def half_block_waste(block_sizes, requests, capacity_slots: int) -> dict[int, float]:
    """Share of the KV pool lost to half-empty last blocks (the simulation's ``rounding``),
    per block size, from lesson 01's serving simulation."""
    from paged_course.simulate import simulate

    return {b: simulate("paged", requests, capacity_slots, block_size=b).share["rounding"]
            for b in block_sizes}


def plot_page_size(page: dict, waste: dict[int, float], ax=None):
    """Kernel time (committed GPU sweep) and memory lost to half-empty last blocks, per block
    size, on one figure with two y axes."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(8, 3.8))
    for backend, marker in (("auto_planned", "o"), ("flashinfer", "s")):
        rows = sorted((r for r in page["results"] if r["backend"] == backend),
                      key=lambda r: r["block_size"])
        if rows:
            ax.plot([r["block_size"] for r in rows], [r["pct_copy_bw"] for r in rows],
                    marker=marker, label=f"{backend}: % of copy bandwidth")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens per page)")
    ax.set_ylabel("% of copy bandwidth (GPU)")
    ax.set_ylim(0, 110)
    twin = ax.twinx()
    sizes = sorted(waste)
    twin.plot(sizes, [100 * waste[b] for b in sizes], "r--^", label="KV memory in half-empty "
              "last blocks (simulation)")
    twin.set_ylabel("% of KV pool wasted", color="r")
    lines = ax.get_legend_handles_labels()
    more = twin.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize=7, loc="lower center")
    ax.set_title(f"Page size: {page['results'][0]['case']} on {page['gpu']} ({page['date']}) vs "
                 "lesson 01's simulation", fontsize=9)
    return ax


def decode_intensity(num_q_heads: int, num_kv_heads: int) -> float:
    """FLOPs per byte of decode attention: per token and head_dim element, ``4 * Hq`` FLOPs
    (q.k and p.v, 2 each) over ``2 * Hkv * 2`` bytes of K and V in bf16: ``Hq / Hkv``."""
    return num_q_heads / num_kv_heads


def plot_roofline(bench: dict, points: list[tuple[str, float, float]], ax=None):
    """The roofline of the GPU in ``bench`` (measured copy bandwidth and dense bf16 matmul rate)
    with ``points``: (label, FLOPs per byte, achieved TFLOP/s, or nan for a placeholder)."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 4.2))
    bw = bench["copy_bw_gbps"] / 1e3  # TB/s
    peak = bench["matmul_bf16_tflops"]
    ridge = peak / bw
    x = np.logspace(-1, 4, 200)
    ax.loglog(x, np.minimum(x * bw, peak), "k-", lw=1.5)
    ax.axvline(ridge, color="0.6", ls=":", lw=1)
    ax.text(ridge * 1.1, peak * 0.03, f"ridge {ridge:.0f} FLOP/byte", fontsize=8)
    ax.text(0.12, 0.12 * bw * 1.4, f"copy {bw:.2f} TB/s", fontsize=8, rotation=28)
    ax.text(300, peak * 1.1, f"bf16 matmul {peak:.0f} TFLOP/s", fontsize=8)
    for label, intensity, tflops in points:
        if np.isnan(tflops):
            ax.axvline(intensity, color="tab:green", ls="--", lw=1)
            ax.text(intensity * 1.1, peak * 0.3, label, fontsize=8, color="tab:green")
        else:
            ax.plot(intensity, tflops, "o", ms=7, label=f"{label}: {tflops:.1f} TFLOP/s")
    ax.set_xlabel("arithmetic intensity (FLOPs per byte of memory traffic)")
    ax.set_ylabel("TFLOP/s")
    ax.set_ylim(0.1, peak * 2)
    ax.set_title(f"Roofline of {bench['gpu']} ({bench['date']}, measured)", fontsize=9)
    ax.legend(fontsize=7, loc="lower right")
    return ax
