"""Print a Markdown table of a committed benchmark JSON (best row per case and backend).

    python tools/results_table.py results/h200/decode.json
"""

from __future__ import annotations

import sys

from paged_course.results import load_results, markdown_table

if __name__ == "__main__":
    print(markdown_table(load_results(sys.argv[1] if len(sys.argv) > 1 else "decode")))
