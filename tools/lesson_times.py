"""How long each lesson takes: reading, doing its exercises, running it. One table for the
README's syllabus and the workshop kit, so the two never disagree.

    python tools/lesson_times.py            # rewrite workshop/lesson_times.json and the tables
    python tools/lesson_times.py --check    # exit 1 if they are stale

Per lesson (``notebooks/NN_*.ipynb``, deep dives ``NNa_*`` included):

* **reading**: the words of its Markdown cells (code fences, math and HTML left out) at
  :data:`WORDS_PER_MINUTE`, a common rate for technical text;
* **doing**: per exercise, an *estimate* from its size (the rule of :func:`doing_minutes`: its
  docstring read at the same rate, :data:`MINUTES_PER_LINE` per line of the worked solution,
  :data:`MINUTES_PER_CHECK` to run the check and fix one mistake). It is a planning rule, not a
  measurement of learners: ``workshop/README.md`` says what it rests on;
* **run**: *Run All* on a CPU, from ``notebooks/timings.json`` (``make outputs`` measures it).

The tables go between ``<!-- BEGIN LESSON TIMES -->`` and ``<!-- END LESSON TIMES -->`` in
README.md (the syllabus) and workshop/README.md (the breakdown).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS, EXERCISES, SOLUTIONS = ROOT / "notebooks", ROOT / "exercises", ROOT / "solutions"
TIMINGS = NOTEBOOKS / "timings.json"
OUT = ROOT / "workshop" / "lesson_times.json"
README, WORKSHOP = ROOT / "README.md", ROOT / "workshop" / "README.md"
BEGIN, END = "<!-- BEGIN LESSON TIMES", "<!-- END LESSON TIMES -->"

#: Reading rate for technical prose, words per minute.
WORDS_PER_MINUTE = 150
#: Minutes per line of a worked solution: understanding what to write, writing it.
MINUTES_PER_LINE = 1.5
#: Minutes per exercise to run its check, read a failure and fix it once.
MINUTES_PER_CHECK = 3.0

WORD = re.compile(r"[A-Za-z0-9][\w'’.,%×/+-]*")
EXERCISE = re.compile(r'NotImplementedError\("Exercise (\d+\.\d+[a-z]?): (\w+)"\)')


def prose_words(path: Path) -> int:
    """Words of a notebook's Markdown cells, without code fences, math, HTML tags and link
    targets."""
    cells = json.loads(path.read_text())["cells"]
    words = 0
    for cell in cells:
        if cell["cell_type"] == "markdown":
            text = "".join(cell["source"])
            text = re.sub(r"```.*?```", " ", text, flags=re.S)
            text = re.sub(r"<[^>]+>", " ", text)
            text = re.sub(r"\$\$.*?\$\$|\$[^$\n]+\$", " ", text, flags=re.S)  # math
            text = re.sub(r"\]\([^)]*\)", "]", text)      # a link counts as its words only
            words += len(WORD.findall(text))
    return words


def solution_lines(path: Path, lesson: int) -> dict[str, int]:
    """Non-blank lines of each worked solution block, by exercise number (numbered as
    ``tools/make_exercises.py`` numbers them)."""
    counts, current, count = {}, None, 0
    for line in path.read_text().splitlines():
        marker = line.strip()
        if marker.startswith("# BEGIN SOLUTION"):
            count += 1
            current = marker[len("# BEGIN SOLUTION"):].strip() or f"{lesson}.{count}"
            counts[current] = 0
        elif marker == "# END SOLUTION":
            current = None
        elif current is not None and marker and not marker.startswith("#"):
            counts[current] += 1
    return counts


def stub_docstrings(path: Path) -> dict[str, tuple[str, int]]:
    """Per exercise number in a stub file: (function name, words of its docstring)."""
    found = {}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef):
            text = ast.get_source_segment(path.read_text(), node) or ""
            match = EXERCISE.search(text)
            if match:
                doc = ast.get_docstring(node) or ""
                found[match.group(1)] = (match.group(2), len(WORD.findall(doc)))
    return found


def exercise_order(number: str) -> tuple[int, str]:
    """``"4.0a"`` before ``"4.1"`` before ``"4.10"``."""
    minor = number.split(".")[1]
    digits = re.match(r"\d+", minor).group(0)
    return int(digits), minor[len(digits):]


def doing_minutes(doc_words: int, lines: int) -> float:
    """The planning rule for one exercise: read its docstring, write its lines, check it."""
    return doc_words / WORDS_PER_MINUTE + MINUTES_PER_LINE * lines + MINUTES_PER_CHECK


def exercises(lesson: int) -> list[dict]:
    """Every exercise of a lesson with its size and estimated doing time."""
    rows = []
    for stub in sorted(EXERCISES.glob(f"ex{lesson:02d}_*.py")):
        docs = stub_docstrings(stub)
        lines = solution_lines(SOLUTIONS / stub.name, lesson)
        for number in sorted(docs, key=exercise_order):
            name, words = docs[number]
            n = lines.get(number, 0)
            rows.append({"exercise": number, "name": name, "file": stub.name,
                         "docstring_words": words, "solution_lines": n,
                         "minutes": round(doing_minutes(words, n), 1)})
    return sorted(rows, key=lambda r: exercise_order(r["exercise"]))


def lesson_table() -> list[dict]:
    """One row per notebook: words, reading / doing / run minutes, total, core or extension
    (``paged_course.syllabus.CORE``)."""
    sys.path.insert(0, str(ROOT))
    from paged_course.syllabus import CORE

    timings = json.loads(TIMINGS.read_text())["notebooks"] if TIMINGS.exists() else {}
    rows = []
    for path in sorted(NOTEBOOKS.glob("[0-9][0-9]*_*.ipynb")):
        number = int(path.name[:2])
        deep = not path.name[2] == "_"
        ex = [] if deep else exercises(number)
        words = prose_words(path)
        run_s = timings.get(path.name, {}).get("seconds")
        reading = words / WORDS_PER_MINUTE
        doing = sum(e["minutes"] for e in ex)
        total = reading + doing + (run_s or 0) / 60
        rows.append({"notebook": path.name, "lesson": path.stem.split("_")[0],
                     "path": "deep dive" if deep else ("core" if number in CORE else "extension"),
                     "prose_words": words, "reading_min": round(reading, 1),
                     "exercises": len(ex), "doing_min": round(doing, 1),
                     "run_s": run_s, "total_min": 5 * math.ceil(total / 5),
                     "exercise_detail": ex})
    return rows


def hours(minutes: float) -> str:
    return f"{minutes // 60:.0f} h {minutes % 60:02.0f}" if minutes >= 60 else f"{minutes:.0f} min"


def notebook_title(path: Path) -> str:
    """A notebook's first heading, without its number (``# 10a · Why ...`` -> ``Why ...``)."""
    cells = json.loads(path.read_text())["cells"]
    first = "".join(cells[0]["source"]).splitlines()[0] if cells else path.stem
    return first.lstrip("# ").split("·", 1)[-1].strip()


def syllabus_markdown(rows: list[dict]) -> str:
    """The README's syllabus: lesson, path, what you build (``paged_course.syllabus``; a deep
    dive's title), exercises, time."""
    sys.path.insert(0, str(ROOT))
    from paged_course.syllabus import LESSONS

    builds = {f"{lesson.number:02d}": lesson.builds for lesson in LESSONS}
    lines = ["| lesson | path | what you build | exercises | time |", "|---|---|---|---|---|"]
    for r in rows:
        what = builds.get(r["lesson"], notebook_title(NOTEBOOKS / r["notebook"]))
        if r["path"] == "deep dive":
            what = notebook_title(NOTEBOOKS / r["notebook"])
        lines.append(f"| [{r['notebook'][:-6]}](notebooks/{r['notebook']}) | {r['path']} | "
                     f"{what} | {r['exercises'] or '-'} | {hours(r['total_min'])} |")
    for path in ("core", "extension"):
        total = sum(r["total_min"] for r in rows if r["path"] == path)
        lines.append(f"| **all {path} lessons** | | | | **{hours(total)}** |")
    return "\n".join(lines)


def breakdown_markdown(rows: list[dict]) -> str:
    """The workshop's table: every part of each lesson's time."""
    lines = ["| lesson | prose words | reading | exercises | doing (estimate) | Run All (CPU) "
             "| total |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        run = "-" if r["run_s"] is None else f"{r['run_s']:.0f} s"
        lines.append(f"| {r['notebook'][:-6]} | {r['prose_words']:,} | "
                     f"{r['reading_min']:.0f} min | {r['exercises'] or '-'} | "
                     f"{r['doing_min']:.0f} min | {run} | {hours(r['total_min'])} |")
    lessons = [r for r in rows if r["path"] != "deep dive"]
    for name, pick in (("core path, 00-05", lambda r: r["path"] == "core"),
                       ("00-09", lambda r: int(r["lesson"][:2]) <= 9),
                       ("every lesson, 00-11", lambda r: True)):
        total = sum(r["total_min"] for r in lessons if pick(r))
        lines.append(f"| **{name}** | | | | | | **{hours(total)}** |")
    return "\n".join(lines)


def with_table(text: str, table: str) -> str:
    """``text`` with the block between the markers replaced by ``table``."""
    begin, end = text.find(BEGIN), text.find(END)
    if begin < 0 or end < begin:
        raise ValueError(f"no {BEGIN} ... {END} block")
    head = text[:begin] + text[begin:].split("\n", 1)[0] + "\n"
    return head + "\n" + table + "\n\n" + text[end:]


def outputs(rows: list[dict]) -> dict[Path, str]:
    """Every file this tool writes, with its new text."""
    rule = {"words_per_minute": WORDS_PER_MINUTE, "minutes_per_solution_line": MINUTES_PER_LINE,
            "minutes_per_check": MINUTES_PER_CHECK}
    data = {"what": __doc__.splitlines()[0], "rule": rule, "lessons": rows}
    return {OUT: json.dumps(data, indent=1) + "\n",
            README: with_table(README.read_text(), syllabus_markdown(rows)),
            WORKSHOP: with_table(WORKSHOP.read_text(), breakdown_markdown(rows))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if anything is stale")
    args = parser.parse_args(argv)
    stale = []
    for path, text in outputs(lesson_table()).items():
        if not path.exists() or path.read_text() != text:
            stale.append(path.relative_to(ROOT))
            if not args.check:
                path.write_text(text)
    if args.check and stale:
        print(f"stale: {', '.join(map(str, stale))}: run `python tools/lesson_times.py`",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
