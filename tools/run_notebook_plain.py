"""Run a notebook's code cells in one namespace with plain Python (no Jupyter needed), e.g. on
a GPU machine that has torch and triton but no Jupyter. Magics (`%...`, `!...`) are skipped.
What only Jupyter provides gets a stand-in that prints text: the ``display`` builtin, and
``IPython.display`` (``Markdown``, ``HTML``, ``display``) where IPython is not installed.

    python tools/run_notebook_plain.py notebooks/04_triton_paged_decode.ipynb [...]
"""

from __future__ import annotations

import json
import linecache
import os
import sys
import time
import types
from pathlib import Path

import matplotlib

matplotlib.use("Agg")


def display(*objs, **_) -> None:
    """Jupyter's ``display``, as text: a figure is drawn by nobody (Agg), anything else printed."""
    for obj in objs:
        if not hasattr(obj, "savefig"):
            print(getattr(obj, "data", obj))


class _Rich:
    """``IPython.display.Markdown`` / ``HTML`` without IPython: keeps the text."""

    def __init__(self, data="", **_):
        self.data = data

    def __repr__(self) -> str:
        return str(self.data)


def _stand_in_ipython() -> None:
    try:
        import IPython  # noqa: F401
    except ImportError:
        ipython, rich = types.ModuleType("IPython"), types.ModuleType("IPython.display")
        rich.Markdown = rich.HTML = _Rich
        rich.display = display
        ipython.display = rich
        # Libraries that look for IPython (matplotlib, tqdm) find no shell and leave it alone.
        ipython.version_info = (8, 24, 0, "stand-in")
        ipython.get_ipython = lambda: None
        sys.modules.update({"IPython": ipython, "IPython.display": rich})


def run(path: Path) -> None:
    cells = json.loads(path.read_text())["cells"]
    _stand_in_ipython()
    namespace: dict = {"__name__": "__main__", "display": display}
    start = time.perf_counter()
    os.chdir(path.parent)
    for i, cell in enumerate(cells):
        if cell["cell_type"] != "code":
            continue
        source = "".join(cell["source"])
        code = "\n".join(line for line in source.splitlines()
                         if not line.lstrip().startswith(("%", "!")))
        filename = f"<{path.name} cell {i}>"
        # Triton reads kernel source with inspect: register the cell as IPython does.
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        try:
            exec(compile(code, filename, "exec"), namespace)
        except Exception:
            print(f"{path.name}: cell {i} failed:\n{source}", file=sys.stderr)
            raise
    print(f"{path.name}: all code cells ran ({time.perf_counter() - start:.1f} s)")


if __name__ == "__main__":
    root = Path.cwd()
    for arg in sys.argv[1:]:
        run((root / arg).resolve())
        os.chdir(root)
