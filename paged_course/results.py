"""Committed benchmark results (``results/<gpu kind>/<suite>.json``): read them, tabulate, plot.

Every GPU number a lesson shows on a CPU comes from these files, through these functions, so
the text and the tables cannot drift apart. A file is what ``python -m paged_bench`` wrote::

    {"gpu": ..., "torch": ..., "triton": ..., "date": ..., "copy_bw_gbps": ...,
     "results": [{"case": "B64_L4096", "backend": "triton_split", "label": ..., "ms": ...,
                  "gbps": ..., "pct_copy_bw": ..., "rel_err": ..., "best": ..., ...}, ...]}

    bench = load_results("decode")                 # results/h200/decode.json
    stamp(bench)                                   # "NVIDIA H200, 2026-11-29 (torch ...)"
    best(bench, "B4_L2048", "flashinfer")          # its faster row (tensor cores on or off)
    print_backend_table(bench, ["triton", "triton_split", "flashinfer"])

And the writing side, shared by the benchmark suites and the tools that measure:
:func:`environment` (GPU, versions, date: the stamp every result file starts with) and
:func:`write_result`.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import subprocess
from pathlib import Path

from paged_course import ROOT

#: The committed results: one folder per GPU kind (``h200``, ``h200x2``: two of them; ``cpu``).
RESULTS = ROOT / "results"
#: The results of the reference GPU, which the lessons read.
RESULTS_DIR = RESULTS / "h200"
#: Backend order in tables and plots.
ORDER = ("torch", "triton", "triton_split", "auto", "auto_planned", "auto_graph", "sdpa_contiguous",
         "flashinfer")


def result_path(name: str) -> Path:
    """Where a committed result lives: ``"decode"`` is ``results/h200/decode.json`` (the
    reference GPU's), ``"cpu/sharing"`` is ``results/cpu/sharing.json``."""
    kind, _, suite = name.rpartition("/")
    return RESULTS / (kind or RESULTS_DIR.name) / f"{suite}.json"


def load_results(name: str | Path) -> dict:
    """A committed result by name (see :func:`result_path`), or the JSON file at a path."""
    path = Path(name)
    if path.suffix != ".json":
        path = result_path(str(name))
    with open(path) as f:
        return json.load(f)


def reference_gpu() -> dict:
    """The reference GPU's measured ceilings, from one place (the committed runs), for every
    lesson that quotes them: ``copy_bw_gbps`` (device-to-device copy, ``decode.json``),
    ``matmul_tflops`` (dense bf16 matmul, ``prefill.json``), ``ridge_flop_per_byte`` (their
    ratio: the roofline's corner), each with the ``gpu`` and ``date`` of its run."""
    decode, prefill = load_results("decode"), load_results("prefill")
    copy_bw, matmul = decode["copy_bw_gbps"], prefill["matmul_tflops"]
    return {"gpu": decode["gpu"], "copy_bw_gbps": copy_bw, "copy_bw_date": decode["date"],
            "matmul_tflops": matmul, "matmul_date": prefill["date"],
            "ridge_flop_per_byte": matmul * 1e12 / (copy_bw * 1e9)}


def gpu_kind() -> str:
    """The folder of ``results/`` a run on this machine belongs in: ``"h200"`` for one NVIDIA
    H200, ``"h200x2"`` for two of them, ``"cpu"`` with no GPU."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    words = torch.cuda.get_device_name().lower().replace("nvidia", "").split()
    kind = (words[0] if words else "gpu").replace("-", "")
    count = torch.cuda.device_count()
    return kind if count == 1 else f"{kind}x{count}"


def commit() -> str:
    """The checkout's commit (short hash, ``+dirty`` when tracked files changed) for a result's
    stamp; ``PAGED_REF_COMMIT`` when set (a copy of the tree without ``.git``, as on a remote
    GPU machine), else ``"unknown"``."""
    if os.environ.get("PAGED_REF_COMMIT"):
        return os.environ["PAGED_REF_COMMIT"]
    try:
        run = dict(cwd=ROOT, capture_output=True, text=True, timeout=10, check=True)
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], **run).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "-uno"], **run).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


def environment() -> dict:
    """Where and when a measurement runs: ``gpu`` (the device name, or the CPU's machine type),
    ``torch``, ``triton``, ``cuda``, ``flashinfer`` (None where not installed), ``python``,
    ``date``, ``commit``: the keys :func:`stamp` reads back."""
    import torch
    import triton

    try:
        import flashinfer

        fi = flashinfer.__version__
    except ImportError:
        fi = None
    gpu = (torch.cuda.get_device_name() if torch.cuda.is_available()
           else f"CPU ({platform.machine()})")
    return {"gpu": gpu, "torch": torch.__version__, "triton": triton.__version__,
            "cuda": torch.version.cuda, "flashinfer": fi, "python": platform.python_version(),
            "date": dt.date.today().isoformat(), "commit": commit()}


def write_result(result: dict, path: str | Path) -> Path:
    """Write ``result`` as indented JSON to ``path`` (its folder made if missing). A suite
    calls it after every case, so a run cut short keeps what it measured."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def stamp(result: dict) -> str:
    """Where and when a result was measured: GPU, date, torch and triton versions."""
    return f"{result['gpu']}, {result['date']} (torch {result['torch']}, triton {result['triton']})"


def row(result: dict, case: str, label: str) -> dict:
    """The row of ``case`` with this exact ``label`` (e.g. ``"flashinfer[tc=True]"``)."""
    found = [r for r in result["results"] if r["case"] == case and r["label"] == label]
    if not found:
        raise KeyError(f"no row with case={case!r} and label={label!r}")
    return found[0]


def best(result: dict, case: str, backend: str) -> dict | None:
    """The fastest row of ``backend`` on ``case`` (FlashInfer: the better of tensor cores on
    and off; a config sweep: the best config), leaving out forced chunk counts; ``None`` if
    absent. The benchmark flags the same rows ``"best"``."""
    rows = [r for r in result["results"] if r["case"] == case and r["backend"] == backend
            and not r.get("sweep")]
    return min(rows, key=lambda r: r["ms"]) if rows else None


def cases(result: dict) -> list[str]:
    """Case names in the order they were measured."""
    return list(dict.fromkeys(r["case"] for r in result["results"]))


def backend_table(result: dict, backends) -> dict[str, dict[str, dict]]:
    """``{case: {backend: best row}}`` for the cases where every backend has a row."""
    table = {}
    for case in cases(result):
        rows = {b: best(result, case, b) for b in backends}
        if all(r is not None for r in rows.values()):
            table[case] = rows
    return table


def print_backend_table(result: dict, backends, *, ours=("triton", "triton_split"),
                        peer: str = "flashinfer") -> dict[str, dict[str, dict]]:
    """Print ms and % of copy bandwidth per case and backend, and ``peer``'s time over the
    faster of ``ours`` (> 1: ours is faster). Returns :func:`backend_table`."""
    table = backend_table(result, backends)
    compare = peer in backends and any(b in backends for b in ours)
    print(f"{stamp(result)}; copy bandwidth {result['copy_bw_gbps']:.0f} GB/s"
          + (f"; FlashInfer {result['flashinfer']}" if result.get("flashinfer") else ""))
    print(f"{'case':12s}" + "".join(f"{b:>22s}" for b in backends)
          + (f"{peer + ' / ours':>18s}" if compare else ""))
    for case, rows in table.items():
        cells = "".join(f"{rows[b]['ms']:11.4f} ms {rows[b]['pct_copy_bw']:5.1f} %"
                        for b in backends)
        if compare:
            mine = min((rows[b] for b in ours if b in rows), key=lambda r: r["ms"])
            cells += f"{rows[peer]['ms'] / mine['ms']:17.2f}x"
        print(f"{case:12s}{cells}")
    return table


def markdown_table(result: dict) -> str:
    """The best row per case and backend as a Markdown table (``tools/results_table.py``)."""
    lines = [f"{stamp(result)}, copy bandwidth {result['copy_bw_gbps']:.0f} GB/s, "
             f"FlashInfer {result.get('flashinfer')}.\n",
             "| case | backend | ms | GB/s | % copy bw | rel err | ms (graph) | vs FlashInfer |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for case in cases(result):
        fi = best(result, case, "flashinfer")
        for backend in ORDER:
            r = best(result, case, backend)
            if r is None:
                continue
            label = r["label"] if backend == "flashinfer" else backend
            if backend == "auto":
                label += f" (→ {r.get('picked')}, checks included)"
            ratio = f"{fi['ms'] / r['ms']:.2f}x" if fi else "-"
            graph = "-" if r.get("ms_graph") is None else f"{r['ms_graph']:.4f}"
            lines.append(f"| {case} | {label} | {r['ms']:.4f} | {r['gbps']:.0f} | "
                         f"{r['pct_copy_bw']:.1f} | {r['rel_err']:.1e} | {graph} | {ratio} |")
    return "\n".join(lines)


def config_name(config: dict) -> str:
    """``{"tile": 64, "num_warps": 4, "num_stages": 3}`` -> ``"t64/w4/s3"``."""
    return f"t{config['tile']}/w{config['num_warps']}/s{config['num_stages']}"


def tuning_rows(tune: dict, default: dict, backends=("triton", "triton_split")) -> list[dict]:
    """Per (case, backend) of a config sweep: the ``default`` config's row and the fastest,
    as ``{"case", "backend", "default": row, "top": row, "gain_pct": ...}``."""
    out = []
    for case in cases(tune):
        for backend in backends:
            rows = [r for r in tune["results"] if r["case"] == case and r["backend"] == backend
                    and "config" in r]
            base = next((r for r in rows if r["config"] == default), None)
            if base is None:
                continue
            top = min(rows, key=lambda r: r["ms"])
            out.append({"case": case, "backend": backend, "default": base, "top": top,
                        "gain_pct": (base["ms"] / top["ms"] - 1) * 100})
    return out


def print_tuning_table(tune: dict, default: dict) -> list[dict]:
    """Print :func:`tuning_rows` (default config vs the best one) and return them."""
    rows = tuning_rows(tune, default)
    print(f"{stamp(tune)}; default config {config_name(default)}")
    print(f"{'case':12s} {'kernel':13s} {'chunks':>6s} {'default':>16s} {'best config':>13s} "
          f"{'best':>16s} {'gain':>6s}")
    for t in rows:
        base, top = t["default"], t["top"]
        print(f"{t['case']:12s} {t['backend']:13s} {base.get('num_chunks', '-'):>6} "
              f"{base['ms']:7.4f} ({base['pct_copy_bw']:4.1f}%) {config_name(top['config']):>13s} "
              f"{top['ms']:7.4f} ({top['pct_copy_bw']:4.1f}%) {t['gain_pct']:5.1f}%")
    return rows


def runs_differ(earlier: dict, later: dict, default: dict, backend: str = "triton_split",
                tolerance: float = 0.10) -> list[str]:
    """Where a config sweep (``earlier``) and the results run (``later``) disagree for the
    ``default`` config: another chunk count, or a time more than ``tolerance`` apart. One
    line per case, naming both files' numbers, so a lesson can say so instead of leaving two
    tables that contradict each other without a word."""
    lines = []
    for t in tuning_rows(earlier, default, backends=(backend,)):
        then, now = t["default"], best(later, t["case"], backend)
        if now is None:
            continue
        chunks_then, chunks_now = then.get("num_chunks"), now.get("num_chunks")
        if chunks_then != chunks_now or abs(then["ms"] / now["ms"] - 1) > tolerance:
            lines.append(f"{t['case']}: {then['ms']:.4f} ms with {chunks_then} chunk(s) in the "
                         f"sweep, {now['ms']:.4f} ms with {chunks_now} chunk(s) in the results")
    return lines


def draw_pct_copy_bw(result: dict, backends, *, title: str | None = None, labels=None):
    """Grouped bars: % of copy bandwidth per case, one bar per backend (its best row).

    ``labels`` renames backends in the legend. Returns a matplotlib Figure."""
    from matplotlib.figure import Figure

    names = cases(result)
    width = 0.8 / max(len(backends), 1)
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax = fig.subplots()
    for i, b in enumerate(backends):
        bars = [(j, best(result, n, b)) for j, n in enumerate(names)]
        bars = [(j + (i - (len(backends) - 1) / 2) * width, r["pct_copy_bw"])
                for j, r in bars if r is not None]
        ax.bar([x for x, _ in bars], [y for _, y in bars], width, label=(labels or {}).get(b, b))
    ax.axhline(100, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(names)), names)
    ax.set(ylabel="% of measured copy bandwidth", ylim=(0, 122))
    ax.set_title(title or f"paged decode, % of copy bandwidth — {stamp(result)}", fontsize=10)
    ax.legend(ncols=min(len(backends), 6), fontsize=8, loc="upper center")
    return fig
