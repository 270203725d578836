"""Write ``docs/contiguous_vs_paged.png``, the README's picture: lesson 01's comparison of
reserving the maximum length per request with taking blocks on demand.

    python tools/readme_picture.py
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PICTURE = ROOT / "docs" / "contiguous_vs_paged.png"


def main() -> int:
    sys.path.insert(0, str(ROOT))
    import matplotlib

    matplotlib.use("Agg")
    from paged_course import simulate, viz

    lens = simulate.sample_requests(6, seed=7, max_len=2048).total.tolist()   # as lesson 01
    fig = viz.draw_contiguous_vs_paged(lens, max_len=2048, block_size=16)
    fig.savefig(PICTURE, dpi=90)
    print(f"wrote {PICTURE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
