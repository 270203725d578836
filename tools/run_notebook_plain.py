"""Run a notebook's code cells in one namespace with plain Python (no Jupyter needed), e.g. on
a GPU machine that has torch and triton but no Jupyter. Magics (`%...`, `!...`) are skipped.

    python tools/run_notebook_plain.py notebooks/04_triton_paged_decode.ipynb [...]
"""

from __future__ import annotations

import json
import linecache
import os
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")


def run(path: Path) -> None:
    cells = json.loads(path.read_text())["cells"]
    namespace: dict = {"__name__": "__main__"}
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
