"""Write exercises/ from solutions/: every ``# BEGIN SOLUTION`` … ``# END SOLUTION`` block
becomes ``raise NotImplementedError("Exercise N.M: <function>")``.

    python tools/make_exercises.py          # (re)write exercises/, backing up your edits
    python tools/make_exercises.py --check  # exit 1 if exercises/ is out of date

N is the lesson number from the file name (``ex04_…`` → 4), M counts the blocks in the file;
a marker may name its exercise instead (``# BEGIN SOLUTION 4.0a`` for warm-ups before 4.1).
Maintainers edit solutions/, never exercises/ (tests/test_exercise_pipeline.py fails when the
committed exercises/ drift from solutions/).

Learners edit exercises/: before (re)writing a file, this script copies any version of it that
git could not give back (it differs from the new text and from the committed one) to
``backups/exercises-<UTC time>/`` and says so. Your work is never lost.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOLUTIONS = ROOT / "solutions"
EXERCISES = ROOT / "exercises"
BACKUPS = ROOT / "backups"
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


def committed_text(path: Path) -> str | None:
    """The text of ``path`` in git's HEAD, or None (not committed, or no git)."""
    try:
        rel = path.relative_to(ROOT).as_posix()
        done = subprocess.run(["git", "show", f"HEAD:{rel}"], cwd=ROOT, capture_output=True,
                              text=True, check=False)
    except OSError:
        return None
    return done.stdout if done.returncode == 0 else None


def files_to_back_up(expected: dict[Path, str]) -> list[Path]:
    """Files that writing ``expected`` would change and that git cannot give back."""
    return [path for path, text in expected.items()
            if path.exists() and path.read_text() not in (text, committed_text(path))]


def back_up(paths: list[Path]) -> Path:
    """Copy ``paths`` into a new ``backups/exercises-<UTC time>/`` folder; return it."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")
    folder = BACKUPS / f"exercises-{stamp}"
    folder.mkdir(parents=True, exist_ok=False)
    for path in paths:
        shutil.copy2(path, folder / path.name)
    return folder


def main(argv: list[str]) -> int:
    expected = expected_exercises()
    if "--check" in argv:
        stale = [p for p, text in expected.items() if not p.exists() or p.read_text() != text]
        for p in stale:
            print(f"out of date: {p.relative_to(ROOT)}")
        return 1 if stale else 0
    edited = files_to_back_up(expected)
    if edited:
        folder = back_up(edited)
        names = ", ".join(p.name for p in edited)
        print(f"your edits to {names} are saved in {folder.relative_to(ROOT)}/")
    EXERCISES.mkdir(exist_ok=True)
    for path, text in expected.items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
