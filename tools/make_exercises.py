"""Write exercises/ from solutions/: every ``# BEGIN SOLUTION`` … ``# END SOLUTION`` block
becomes ``raise NotImplementedError("Exercise N.M: <function>")``.

    python tools/make_exercises.py          # (re)write exercises/
    python tools/make_exercises.py --check  # exit 1 if exercises/ is out of date

N is the lesson number from the file name (``ex04_…`` → 4), M counts the blocks in the file;
a marker may name its exercise instead (``# BEGIN SOLUTION 4.0a`` for warm-ups before 4.1).
Edit solutions/, never exercises/ (tests/test_exercise_pipeline.py fails when they drift).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"
BEGIN, END = "# BEGIN SOLUTION", "# END SOLUTION"
HEADER = (
    "# Your exercises for lesson {lesson}: replace each `raise NotImplementedError(...)`.\n"
    "# The lesson notebook's check cells (or `make test-exercises EX={stem}`) test this file.\n"
    "# Generated from solutions/{name} by tools/make_exercises.py.\n"
)


def lesson_number(path: Path) -> int:
    match = re.match(r"ex(\d+)_", path.name)
    if not match:
        raise ValueError(f"{path.name}: solution files are named exNN_topic.py")
    return int(match.group(1))


def make_stub(source: str, lesson: int, filename: str = "<solution>") -> str:
    """The exercise text for one solution file's text."""
    out: list[str] = []
    inside = False
    count = 0
    for lineno, line in enumerate(source.splitlines(keepends=True), 1):
        marker = line.strip()
        if marker == BEGIN or marker.startswith(BEGIN + " "):
            if inside:
                raise ValueError(f"{filename}:{lineno}: nested {BEGIN}")
            inside, count = True, count + 1
            label = marker[len(BEGIN):].strip()
            if label and not re.fullmatch(rf"{lesson}\.\d+[a-z]?", label):
                raise ValueError(f"{filename}:{lineno}: exercise label {label!r} is not "
                                 f"{lesson}.M or {lesson}.Mx")
            indent = line[: len(line) - len(line.lstrip())]
            name = _enclosing_function(out, len(indent))
            number = label or f"{lesson}.{count}"
            out.append(f'{indent}raise NotImplementedError("Exercise {number}: {name}")\n')
        elif marker == END:
            if not inside:
                raise ValueError(f"{filename}:{lineno}: {END} without {BEGIN}")
            inside = False
        elif not inside:
            out.append(line)
    if inside:
        raise ValueError(f"{filename}: {BEGIN} is never closed")
    if count == 0:
        raise ValueError(f"{filename}: no {BEGIN} blocks")
    return "".join(out)


def _enclosing_function(lines: list[str], indent: int) -> str:
    for line in reversed(lines):
        stripped = line.lstrip()
        if stripped.startswith(("def ", "class ")) and len(line) - len(stripped) < indent:
            return re.match(r"(?:def|class) (\w+)", stripped).group(1)
    raise ValueError(f"{BEGIN} outside any function")


def expected_exercises() -> dict[Path, str]:
    """exercise path -> the text it should hold."""
    result = {EXERCISES / "__init__.py": '"""Learner stubs, generated from solutions/."""\n'}
    for path in sorted(SOLUTIONS.glob("ex*_*.py")):
        lesson = lesson_number(path)
        header = HEADER.format(lesson=lesson, stem=path.stem.split("_")[0], name=path.name)
        result[EXERCISES / path.name] = header + make_stub(path.read_text(), lesson, path.name)
    return result


def main(argv: list[str]) -> int:
    expected = expected_exercises()
    if "--check" in argv:
        stale = [p for p, text in expected.items() if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"out of date: {p.relative_to(ROOT)}")
        return 1 if stale else 0
    EXERCISES.mkdir(exist_ok=True)
    for path, text in expected.items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
