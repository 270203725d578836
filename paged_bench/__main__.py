"""``python -m paged_bench SUITE [options]``: run one benchmark suite (see :mod:`paged_bench`)."""

from __future__ import annotations

import importlib
import sys

from paged_bench import SUITES

USAGE = f"usage: python -m paged_bench {{{','.join(SUITES)}}} [options]   (SUITE --help for each)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n" + USAGE)
        return 0 if argv else 2
    suite, rest = argv[0], argv[1:]
    if suite not in SUITES:
        print(f"unknown suite {suite!r}; choose one of {', '.join(SUITES)}\n{USAGE}",
              file=sys.stderr)
        return 2
    return importlib.import_module(f"paged_bench.{suite}").main(rest)


if __name__ == "__main__":
    sys.exit(main())
