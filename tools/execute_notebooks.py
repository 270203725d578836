"""Execute the lesson notebooks on this CPU and keep their outputs, ready to commit.

    python tools/execute_notebooks.py                     # every lesson and deep dive
    python tools/execute_notebooks.py notebooks/02_*.ipynb
    python tools/execute_notebooks.py --jobs 2            # two notebooks at a time
    make outputs                                          # the same, all notebooks

So that the course reads without running (on GitHub, in `make site`), the committed notebooks
carry their outputs. Each notebook runs in a fresh kernel, against the worked solutions
(``PAGED_REF_IMPL=solutions``), on the CPU (``CUDA_VISIBLE_DEVICES=""``: GPU cells show the
committed results from results/). Then the tool

- runs without progress bars (``QUIET``) and drops what changes from run to run or is useless
  without a live kernel: widget state, the live-widget part of an output (its picture stays,
  see ``viz.explorers.LiveWidget``), execution times, the interpreter version, absolute paths
  of this checkout;
- stores in the notebook's metadata (``paged_ref``) a hash of its code cells and the number of
  pictures it produced (tests/repo/test_published_notebooks.py checks both: the outputs are not
  stale, and no picture went missing);
- records each notebook's run time in ``notebooks/timings.json`` (the workshop schedule is
  built from it).

A notebook that fails is not written; the tool goes on with the others and exits 1.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
TIMINGS = NOTEBOOKS / "timings.json"
WORKSHOP = ROOT / "workshop" / "README.md"
TABLE_BEGIN, TABLE_END = "<!-- BEGIN TIMINGS", "<!-- END TIMINGS -->"
KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_NOTE = "(an interactive widget: run the notebook in JupyterLab to use it)"
VOLATILE_CELL_METADATA = ("execution", "ExecuteTime", "collapsed", "scrolled")
#: The environment of every notebook run (and the processes it starts): no progress bars
#: (tqdm's, transformers' "Loading weights"), which would land in the committed stderr, or as
#: a widget placeholder, and differ from run to run.
QUIET = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


def lesson_notebooks() -> list[Path]:
    """notebooks/NN_*.ipynb and the deep dives beside them (NNx_*.ipynb: 10a_..., 10b_...), in
    course order (a lesson, then its deep dives)."""
    found = [*NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"), *NOTEBOOKS.glob("[0-9][0-9][a-z]_*.ipynb")]
    return sorted(found)


def source_hash(nb: dict) -> str:
    """sha256 of the code cells' sources, in order: changes when any code changes."""
    digest = hashlib.sha256()
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            source = cell["source"]
            digest.update(("".join(source) if isinstance(source, list) else source).encode())
            digest.update(b"\0")
    return digest.hexdigest()


def count_images(nb: dict) -> int:
    """PNG / SVG / JPEG pictures in the outputs."""
    return sum(
        1
        for cell in nb["cells"] if cell["cell_type"] == "code"
        for out in cell.get("outputs", [])
        for mime in out.get("data", {})
        if mime in ("image/png", "image/svg+xml", "image/jpeg")
    )


def clean(nb, root: Path = ROOT) -> None:
    """Strip widget state and volatile metadata; hide this checkout's absolute path."""
    nb.metadata.pop("widgets", None)
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    nb.metadata["language_info"] = {"name": "python"}
    here = str(root)
    for cell in nb.cells:
        for key in VOLATILE_CELL_METADATA:
            cell.metadata.pop(key, None)
        if cell.cell_type != "code":
            continue
        for out in cell.outputs:
            out.get("metadata", {}).pop("execution", None)
            data = out.get("data")
            if data is not None and WIDGET_VIEW in data:
                del data[WIDGET_VIEW]
                if not any(m.startswith("image/") for m in data):
                    data["text/plain"] = WIDGET_NOTE
            if out.get("output_type") == "stream":
                out["text"] = out["text"].replace(here, ".")
            elif data is not None and isinstance(data.get("text/plain"), str):
                data["text/plain"] = data["text/plain"].replace(here, ".")
            elif out.get("output_type") == "error":
                out["traceback"] = [line.replace(here, ".") for line in out["traceback"]]


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): timings on a busy machine lie."""
    try:
        return round(os.getloadavg()[0], 1)
    except (AttributeError, OSError):
        return None


def execute(path: Path, timeout: int = 900) -> tuple[str, float, str | None, float | None]:
    """Run one notebook in a fresh kernel and write it back.

    Returns (name, seconds, error or None, load average when it started).
    """
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    os.environ["PAGED_REF_IMPL"] = "solutions"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ.update(QUIET)
    os.environ.setdefault("PYTHONHASHSEED", "0")
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}},
                            record_timing=False)  # widget state: dropped by clean()
    load = load_average()
    start = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as err:
        return path.name, time.perf_counter() - start, str(err)[-3000:], load
    except Exception as err:  # noqa: BLE001 (a dead kernel, a timeout: report, go on)
        return path.name, time.perf_counter() - start, f"{type(err).__name__}: {err}", load
    seconds = time.perf_counter() - start
    clean(nb)
    nb.metadata["paged_ref"] = {
        "source_hash": source_hash(nb),
        "images": count_images(nb),
        "executed_with": "PAGED_REF_IMPL=solutions, CPU (tools/execute_notebooks.py)",
    }
    nbformat.write(nb, path)
    return path.name, seconds, None, load


def machine() -> dict:
    """What the timings were measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
            "date": datetime.now(timezone.utc).strftime("%Y-%m-%d")}


def record_timings(seconds: dict[str, tuple[float, float | None]], jobs: int) -> None:
    """Merge this run's times into notebooks/timings.json (other notebooks keep theirs)."""
    data = json.loads(TIMINGS.read_text()) if TIMINGS.exists() else {}
    notebooks = data.get("notebooks", {})
    stamp = machine()
    for name, (s, load) in seconds.items():
        notebooks[name] = {"seconds": round(s, 1), "date": stamp["date"], "jobs": jobs,
                           "load_average": load}
    data = {
        "what": "wall time of each notebook executed top to bottom in a fresh kernel on a CPU "
                "(tools/execute_notebooks.py); 'jobs' notebooks ran at once; 'load_average' is the "
                "machine's 1-minute load when the notebook started (on a busy machine, times "
                "grow with it)",
        "machine": {k: v for k, v in stamp.items() if k != "date"},
        "notebooks": dict(sorted(notebooks.items())),
    }
    TIMINGS.write_text(json.dumps(data, indent=1) + "\n")
    write_workshop_table(data)


def write_workshop_table(data: dict, path: Path = WORKSHOP) -> None:
    """Rewrite the run-time table between the TIMINGS markers of workshop/README.md."""
    if not path.exists():
        return
    text = path.read_text()
    begin, end = text.find(TABLE_BEGIN), text.find(TABLE_END)
    if begin < 0 or end < begin:
        return
    m = data["machine"]
    rows = ["", f"Measured on {m['cpu']}, {m['cores']} cores, Python {m['python']}.", "",
            "| lesson | Run All on the CPU | measured | load average then |", "|---|---|---|---|"]
    for name, t in data["notebooks"].items():
        rows.append(f"| {Path(name).stem} | {t['seconds']:.0f} s | {t['date']} | "
                    f"{t.get('load_average', '?')} |")
    head = text[:begin] + text[begin:].split("\n", 1)[0] + "\n"
    path.write_text(head + "\n".join(rows) + "\n\n" + text[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path,
                        help="notebooks to run (default: every notebooks/NN_*.ipynb and "
                             "NNx_*.ipynb)")
    parser.add_argument("--jobs", type=int, default=1, help="notebooks executed at once")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = parser.parse_args(argv)
    paths = [p.resolve() for p in args.notebooks] or lesson_notebooks()
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        parser.error(f"no such notebook: {missing}")
    if args.jobs < 1:
        parser.error("--jobs must be at least 1")
    timeouts = [args.timeout] * len(paths)
    if args.jobs == 1:
        results = map(execute, paths, timeouts)
    else:
        pool = ProcessPoolExecutor(max_workers=args.jobs)
        results = pool.map(execute, paths, timeouts)
    seconds, failed = {}, []
    for name, s, error, load in results:
        if error is None:
            seconds[name] = (s, load)
            print(f"{name}: ran in {s:.1f} s, outputs written", flush=True)
        else:
            failed.append(name)
            print(f"{name}: FAILED after {s:.1f} s, not written\n{error}", file=sys.stderr)
    if seconds:
        record_timings(seconds, args.jobs)
    if failed:
        print(f"failed: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
