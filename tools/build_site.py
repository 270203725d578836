"""Build a static site of the course from the committed, executed notebooks (no execution).

    python tools/build_site.py            # writes site/index.html, site/notebooks/*.html
    python tools/build_site.py --out DIR
    make site

Each lesson becomes one HTML page (nbconvert's lab template) with its outputs as committed:
pictures, tables and printed numbers from a CPU run (`make outputs`), and the GPU numbers the
notebooks read from results/ (copied next to the pages with exercises/ and solutions/, so
links into them work). Links
between notebooks point to the HTML pages. Open ``site/index.html`` in a browser, or publish
the folder as it is (GitHub Pages, any static host).
"""

from __future__ import annotations

import argparse
import html
import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
from execute_notebooks import count_images, lesson_notebooks  # noqa: E402

LINK = re.compile(r'href="([^":#]+)\.ipynb(#[^"]*)?"')
DEEP_DIVE = re.compile(r"\d\d[a-z]_")  # 10a_..., beside lesson 10


def title_of(nb) -> str:
    """The first Markdown heading of the notebook."""
    for cell in nb.cells:
        if cell.cell_type == "markdown":
            for line in cell.source.splitlines():
                if line.startswith("#"):
                    return line.lstrip("#").strip()
    return "untitled"


def build(out: Path) -> list[tuple[str, str, int]]:
    """Write the site into ``out``; return (page, title, pictures) per lesson."""
    import nbformat
    from nbconvert import HTMLExporter

    exporter = HTMLExporter(template_name="lab")
    (out / "notebooks").mkdir(parents=True, exist_ok=True)
    pages = []
    for path in lesson_notebooks():
        nb = nbformat.read(path, as_version=4)
        body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": path.stem}})
        body = LINK.sub(lambda m: f'href="{m.group(1)}.html{m.group(2) or ""}"', body)
        page = f"notebooks/{path.stem}.html"
        (out / page).write_text(body)
        pages.append((page, title_of(nb), count_images(nb)))
    for folder in ("results", "docs", "exercises", "solutions"):  # what the pages link to
        if (ROOT / folder).is_dir():
            shutil.copytree(ROOT / folder, out / folder, dirs_exist_ok=True,
                            ignore=shutil.ignore_patterns("__pycache__"))
    rows = "\n".join(
        f'<li><a href="{page}">{html.escape(title)}</a> ({n} pictures)'
        f'{" (optional deep dive)" if DEEP_DIVE.match(Path(page).name) else ""}</li>'
        for page, title, n in pages)
    (out / "index.html").write_text(
        "<!doctype html><meta charset='utf-8'><title>Paged attention &amp; KV-cache kernels"
        "</title><body style='font-family:sans-serif;max-width:48em;margin:2em auto'>"
        "<h1>Paged attention &amp; KV-cache kernels</h1><p>The lessons, executed on a CPU "
        "against the worked solutions; GPU numbers come from the committed results "
        "(<a href='results/README.md'>results/</a>). To run them yourself: clone the "
        f"repository and <code>make lab</code>.</p><ol>{rows}</ol></body>\n")
    return pages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "site")
    args = parser.parse_args(argv)
    pages = build(args.out)
    for page, title, n in pages:
        print(f"{page}: {title} ({n} pictures)")
    print(f"site: {args.out / 'index.html'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
