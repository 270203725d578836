"""The committed notebooks read without running: executed, fresh, with their pictures.

`make outputs` (tools/execute_notebooks.py) writes them; these tests fail when a notebook's
code changed since (stale outputs), when a picture went missing, or when widget state or
run-to-run noise slipped in. The fix is always the same: `make outputs NB=<notebook>`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import execute_notebooks as tool  # noqa: E402

NOTEBOOKS = tool.lesson_notebooks()
FIX = "run `make outputs NB={}` and commit the notebook"
MAX_PNG_BYTES = 300_000


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code" and "".join(c["source"]).strip()]


def picture_sections(nb: dict) -> list[list[dict]]:
    """The code cells under each '## Picture' heading (up to the next '## ' heading)."""
    sections, current = [], None
    for cell in nb["cells"]:
        text = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and text.startswith("## "):
            current = [] if text.startswith("## Picture") else None
            if current is not None:
                sections.append(current)
        elif cell["cell_type"] == "code" and current is not None:
            current.append(cell)
    return sections


def has_image(cell: dict) -> bool:
    return any(m.startswith("image/") for o in cell.get("outputs", []) for m in o.get("data", {}))


def test_there_are_lessons():
    assert len(NOTEBOOKS) >= 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_outputs_are_committed_and_fresh(path):
    nb = load(path)
    fix = FIX.format(path.relative_to(ROOT))
    meta = nb["metadata"].get("paged_ref", {})
    assert "source_hash" in meta, f"{path.name} has no committed outputs: {fix}"
    assert meta["source_hash"] == tool.source_hash(nb), f"{path.name}: outputs are stale: {fix}"
    not_run = [i for i, c in enumerate(nb["cells"])
               if c in code_cells(nb) and c.get("execution_count") is None]
    assert not not_run, f"{path.name}: code cells {not_run} have no outputs: {fix}"
    errors = [o.get("ename") for c in code_cells(nb) for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: committed outputs hold errors {errors}: {fix}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_pictures_are_there(path):
    nb = load(path)
    fix = FIX.format(path.relative_to(ROOT))
    images = tool.count_images(nb)
    recorded = nb["metadata"].get("paged_ref", {}).get("images")
    assert recorded is not None, f"{path.name} has no committed outputs: {fix}"
    assert images >= recorded, f"{path.name}: {images} pictures, the run made {recorded}: {fix}"
    for i, section in enumerate(picture_sections(nb)):
        assert any(map(has_image, section)), f"{path.name}: Picture section {i} has no picture"
    if picture_sections(nb):
        assert images >= 1


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_no_widget_state_or_noise(path):
    nb = load(path)
    assert "widgets" not in nb["metadata"], f"{path.name}: widget state is committed"
    assert nb["metadata"].get("kernelspec", {}).get("name") == "python3", (
        f"{path.name}: the kernel must be the standard python3 (each checkout's `make lab` "
        "runs it with its own .venv), never a named kernel of one checkout")
    for cell in nb["cells"]:
        assert "execution" not in cell.get("metadata", {}), f"{path.name}: timing metadata"
        for out in cell.get("outputs", []):
            data = out.get("data", {})
            assert tool.WIDGET_VIEW not in data, f"{path.name}: a live widget output is committed"
            png = data.get("image/png", "")
            assert len(png) * 3 // 4 <= MAX_PNG_BYTES, f"{path.name}: a PNG over 300 kB"


def test_timings_cover_every_notebook():
    timings = json.loads((ROOT / "notebooks" / "timings.json").read_text())["notebooks"]
    missing = [p.name for p in NOTEBOOKS if p.name not in timings]
    assert not missing, f"notebooks/timings.json lacks {missing}: run `make outputs`"


def test_deep_dives_are_found_and_follow_their_lesson():
    """Deep dives (``NNx_*.ipynb``) are run, checked and published like lessons, each right
    after its lesson."""
    names = [p.name for p in NOTEBOOKS]
    dives = [n for n in names if n[2].isalpha()]
    assert {"10a_why_fp8_is_not_2x.ipynb", "10b_hand_written_cuda.ipynb",
            "10c_measuring_short_calls.ipynb"} <= set(dives)
    for dive in dives:
        lesson = next(n for n in names if n.startswith(dive[:2] + "_"))
        assert names.index(lesson) < names.index(dive) < names.index(lesson) + 1 + len(
            [d for d in dives if d[:2] == dive[:2]])


DIARY = ("this round", "earlier run", "previous run", "session", "that run's machine",
         "still to be measured")


def prose(nb: dict) -> str:
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_notebook_keeps_the_lesson_shape(path):
    """The editorial bar for every lesson: at most 2,500 words of prose (a deep dive 3,500), at
    least two pictures, no diary language."""
    nb = load(path)
    text = prose(nb)
    most = 3500 if path.name[2].isalpha() else 2500
    assert len(text.split()) <= most, f"{path.name}: {len(text.split())} words of prose"
    assert tool.count_images(nb) >= 2, f"{path.name}: {tool.count_images(nb)} pictures"
    found = [d for d in DIARY if d in text.lower()]
    assert not found, f"{path.name}: diary language {found}"


@pytest.mark.parametrize("name, most_words", [
    ("10_quantised_kv.ipynb", 2500), ("10a_why_fp8_is_not_2x.ipynb", 3500),
    ("10b_hand_written_cuda.ipynb", 3500), ("10c_measuring_short_calls.ipynb", 3500)])
def test_lesson_10_and_its_deep_dives_keep_the_shape(name, most_words):
    """The issue's bar for lesson 10 and its deep dives: prose within its words, at least two
    pictures, no diary language, the lesson's "Going further" box links every deep dive and each
    deep dive links back."""
    nb = load(ROOT / "notebooks" / name)
    text = prose(nb)
    assert len(text.split()) <= most_words, f"{name}: {len(text.split())} words of prose"
    assert tool.count_images(nb) >= 2, name
    found = [d for d in DIARY if d in text.lower()]
    assert not found, f"{name}: diary language {found}"
    assert "## What to notice" in text, name
    if name.startswith("10_"):
        box = text[text.index("**Going further**"):]
        for dive in ("10a_why_fp8_is_not_2x", "10b_hand_written_cuda",
                     "10c_measuring_short_calls"):
            assert f"({dive}.ipynb)" in box, dive
    else:
        assert "(10_quantised_kv.ipynb)" in text, name


def test_clean_strips_widgets_and_paths(tmp_path):
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.v4.new_notebook(metadata={"widgets": {"state": {}}})
    cell = nbformat.v4.new_code_cell("explorer", execution_count=1, outputs=[
        nbformat.v4.new_output("display_data", data={
            tool.WIDGET_VIEW: {"model_id": "x"}, "text/plain": "VBox(...)",
            "image/png": "iVBORw0KGgo="}),
        nbformat.v4.new_output("stream", name="stdout", text=f"read {tmp_path}/exercises/x.py"),
    ])
    cell.metadata["execution"] = {"iopub.status.busy": "2026-01-01"}
    nb.cells.append(cell)
    tool.clean(nb, root=tmp_path)
    assert "widgets" not in nb.metadata and "execution" not in cell.metadata
    assert tool.WIDGET_VIEW not in cell.outputs[0].data and "image/png" in cell.outputs[0].data
    assert cell.outputs[1].text == "read ./exercises/x.py"
    assert tool.count_images(nb) == 1


def test_site_shows_every_picture(tmp_path):
    """`make site` renders each lesson with all its pictures (no execution needed)."""
    pytest.importorskip("nbconvert")
    import build_site

    pages = build_site.build(tmp_path)
    assert [Path(page).stem for page, _, _ in pages] == [p.stem for p in NOTEBOOKS]
    for page, title, images in pages:
        assert title != "untitled", page
        html = (tmp_path / page).read_text()
        shown = html.count("<img ")
        assert shown >= images, f"{page}: {shown} <img> for {images} pictures"
        assert build_site.LINK.search(html) is None, f"{page} links to a notebook, not a page"
    assert (tmp_path / "index.html").exists()


def test_workshop_table_matches_timings(tmp_path):
    """workshop/README.md's run-time table is the one notebooks/timings.json gives."""
    readme = ROOT / "workshop" / "README.md"
    copy = tmp_path / "README.md"
    copy.write_text(readme.read_text())
    tool.write_workshop_table(json.loads(tool.TIMINGS.read_text()), copy)
    assert copy.read_text() == readme.read_text(), "run `make outputs` (it rewrites the table)"
