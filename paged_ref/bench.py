"""``python -m paged_ref.bench [--suite NAME] [options]``: the benchmark entry point.

Suites (each a module of :mod:`paged_ref.course`, with its own ``--help``):

* ``decode`` (default): :mod:`paged_ref.course.bench`, decode attention vs copy bandwidth;
* any other ``NAME``: :mod:`paged_ref.course.bench_NAME` (e.g. ``prefill``), when it exists.
"""

from __future__ import annotations

import importlib
import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    suite = "decode"
    if "--suite" in argv:
        i = argv.index("--suite")
        if i + 1 >= len(argv):
            print("--suite needs a name", file=sys.stderr)
            return 2
        suite = argv[i + 1]
        del argv[i : i + 2]
    module = "paged_ref.course.bench" if suite == "decode" else f"paged_ref.course.bench_{suite}"
    try:
        bench = importlib.import_module(module)
    except ModuleNotFoundError:
        bench = None
    if not hasattr(bench, "main"):  # (bench_common is what the suites share, not a suite)
        print(f"unknown suite {suite!r} (no module {module} with a main)", file=sys.stderr)
        return 2
    return bench.main(argv)


if __name__ == "__main__":
    sys.exit(main())
