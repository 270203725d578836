"""tools/lesson_times.py: each lesson's time, from its prose, its exercises and its run time; the
README's syllabus and the workshop's breakdown are what the tool computes from the committed
files."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import lesson_times as tool  # noqa: E402


def notebook(tmp_path: Path, *markdown: str) -> Path:
    cells = [{"cell_type": "markdown", "metadata": {}, "source": [m]} for m in markdown]
    cells.append({"cell_type": "code", "metadata": {}, "source": ["x = 1 + 2  # not prose\n"],
                  "outputs": [], "execution_count": None})
    path = tmp_path / "01_x.ipynb"
    path.write_text(json.dumps({"cells": cells}))
    return path


def test_prose_leaves_out_code_math_html_and_link_targets(tmp_path):
    rng = random.Random(0)
    words = [rng.choice(["cache", "block", "table", "kernel", "slot"]) for _ in range(37)]
    prose = " ".join(words)
    noise = ("\n```python\nfor i in range(3): print(i)\n```\n $$e^{s_t - m}$$ and $\\alpha$ "
             "<a id=\"x\"></a> [link](../docs/glossary.md#cta)")
    assert tool.prose_words(notebook(tmp_path, prose, noise)) == 37 + 2   # "and", "link"


def test_every_exercise_has_a_sized_solution():
    for lesson in range(12):
        rows = tool.exercises(lesson)
        for row in rows:
            assert row["solution_lines"] > 0, f"{row['exercise']}: no worked solution found"
            assert row["docstring_words"] > 10, f"{row['exercise']}: no docstring"
        numbers = [r["exercise"] for r in rows]
        assert numbers == sorted(numbers, key=tool.exercise_order)


def test_numbers_match_the_exercise_generator():
    """solution_lines numbers blocks as tools/make_exercises.py does, so each stub's exercise
    finds its own solution block (a wrong count would silently size the wrong exercise)."""
    for stub in sorted((ROOT / "exercises").glob("ex*_*.py")):
        lesson = int(stub.name[2:4])
        docs = tool.stub_docstrings(stub)
        lines = tool.solution_lines(ROOT / "solutions" / stub.name, lesson)
        assert set(docs) == set(lines), f"{stub.name}: {sorted(docs)} vs {sorted(lines)}"


def test_the_rule():
    assert tool.doing_minutes(150, 2) == pytest.approx(1 + 2 * tool.MINUTES_PER_LINE
                                                       + tool.MINUTES_PER_CHECK)
    assert tool.exercise_order("4.0a") < tool.exercise_order("4.1") < tool.exercise_order("4.10")


def test_tables_need_their_markers():
    with pytest.raises(ValueError, match="BEGIN LESSON TIMES"):
        tool.with_table("no markers here", "| a |")
    text = f"head\n{tool.BEGIN} (x) -->\nold\n{tool.END}\ntail\n"
    expected = f"head\n{tool.BEGIN} (x) -->\n\n| new |\n\n{tool.END}\ntail\n"
    assert tool.with_table(text, "| new |") == expected


def test_committed_tables_are_current():
    assert tool.main(["--check"]) == 0, "run `python tools/lesson_times.py` and commit"


@pytest.mark.parametrize("old, new, test", [
    ('or f"{lesson}.{count}"', 'or f"{lesson}.{count + 1}"',
     test_numbers_match_the_exercise_generator),
    ('text = re.sub(r"\\]\\([^)]*\\)", "]", text)', "pass",
     test_prose_leaves_out_code_math_html_and_link_targets),
    ("return sorted(rows, key=lambda r: exercise_order(r[\"exercise\"]))", "return rows",
     test_every_exercise_has_a_sized_solution),
], ids=["exercise numbering", "link targets counted", "warm-ups out of order"])
def test_planted_mistakes_are_caught(old, new, test, tmp_path, monkeypatch):
    from tests.mutations.mutate import mutant_of

    mutant = mutant_of(tool, [(old, new)], tmp_path, monkeypatch)
    for name in ("ROOT", "NOTEBOOKS", "EXERCISES", "SOLUTIONS", "TIMINGS"):  # the real tree
        setattr(mutant, name, getattr(tool, name))
    monkeypatch.setattr(sys.modules[__name__], "tool", mutant)
    args = [tmp_path] if "tmp_path" in test.__code__.co_varnames else []
    with pytest.raises(AssertionError):
        test(*args)
