"""The learner's loop in a notebook: a check prints one line and names the line of your file
that raised; a wrong answer never stops Restart & Run All (but a wrong *solution* fails CI);
pictures follow your latest save; "yours ==" waits for a passed check; each exercise is
checkable in the lesson's order.

Each test works on a copy of the course (tests/course/course_copy.py) with a learner's
exercise file written into it, so nothing touches the checkout.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.conftest import need
from tests.course.course_copy import make_copy, run_python, write_exercise

EX02 = "ex02_block_allocator"
EX07 = "ex07_sharing"
RIGHT_2_4 = "    return block_table[seq_len // block_size] * block_size + seq_len % block_size\n"
WRONG_2_4 = RIGHT_2_4.replace("[seq_len // block_size]", "[seq_len // block_size + 1]")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_copy(tmp_path_factory.mktemp("course"))


def run(root, code: str, impl: str = "exercises"):
    done = run_python(root, textwrap.dedent(code), impl)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_check_prints_one_line_and_shows_no_dict(root):
    need("IPython", "a notebook's display formatter")
    write_exercise(root, EX02, solved={"2.1", "2.2", "2.3", "2.4", "2.5"})
    out = run(root, """
        from IPython.core.interactiveshell import InteractiveShell
        import paged_course as course
        result = course.check("ex02_block_allocator", keyword="2_4")
        shown, _ = InteractiveShell.instance().display_formatter.format(result)
        print("shown:", shown, result["passed"], result.ok)
    """)
    report, shown = out.splitlines()[:-1], out.splitlines()[-1]
    assert report == ["ex02 2.4: 6 passed"], out
    assert shown == "shown: {} 6 True", "a cell ending in a check must not print a dict too"


def test_a_plain_exception_names_your_file_and_line(root):
    path = write_exercise(root, EX02, solved={"2.1", "2.2", "2.3", "2.4", "2.5"},
                          edits=[(RIGHT_2_4, WRONG_2_4)])
    line = path.read_text().splitlines().index(WRONG_2_4.rstrip("\n")) + 1
    out = run(root, """
        import paged_course as course
        course.check("ex02_block_allocator", keyword="2_4")
        print("went on")
    """)
    first = out.splitlines()[0]
    assert first.startswith("ex02 2.4: 5 FAILED, 1 passed — test_2_4_") and "IndexError" in first
    assert f"at exercises/ex02_block_allocator.py:{line}, in append_slot" in out, out
    assert WRONG_2_4.strip() in out, "the report shows the line's source"
    assert out.splitlines()[-1] == "went on"


def test_a_wrong_answer_never_stops_the_notebook_but_fails_under_solutions(root):
    write_exercise(root, EX02, solved={"2.1", "2.2", "2.3", "2.4", "2.5"},
                   edits=[(RIGHT_2_4, WRONG_2_4)])
    out = run(root, """
        import torch
        import paged_course as course
        ex = course.load("ex02_block_allocator")
        alloc = ex.SimpleBlockAllocator(4)
        print("yours:", course.yours(ex.append_slot, [alloc.allocate()], 4, 4, alloc))
        with course.guard():
            ex.append_slot([0], 3, 4, alloc)
        x = torch.randn(3, 4, dtype=torch.float64)
        print("compare:", course.compare(x + 1, x, name="your output"))
        print("went on")
    """)
    assert "your append_slot: your code raised IndexError" in out, out
    assert "at exercises/ex02_block_allocator.py:" in out
    assert "yours: None" in out and "compare: None" in out
    assert "NOT the same yet: your output: relative error" in out
    assert out.splitlines()[-1] == "went on"


@pytest.mark.parametrize("snippet, error", [
    ("course.yours(ex.append_slot, [0], 8, 4, ex.SimpleBlockAllocator(4))", "IndexError"),
    ("with course.guard():\n    ex.append_slot([0], 8, 4, ex.SimpleBlockAllocator(4))",
     "IndexError"),
    ("x = torch.randn(3)\ncourse.compare(x + 1, x.double(), name='yours')",
     "AssertionError: yours: relative error"),
], ids=["yours", "guard", "compare"])
def test_under_solutions_an_error_fails_the_run(root, snippet, error):
    """With PAGED_REF_IMPL=solutions (CI) nothing is caught: a broken solution fails."""
    code = "import torch\nimport paged_course as course\n"
    code += 'ex = course.load("ex02_block_allocator")\n' + snippet + "\nprint('went on')\n"
    done = run_python(root, code, "solutions")
    assert done.returncode == 1 and "went on" not in done.stdout, done.stdout
    assert error in done.stderr, done.stderr[-2000:]


def test_pictures_follow_the_latest_save(root):
    """The module ``course.load`` gave re-imports itself when the file is saved again, even
    twice within one second with the same size (Python's bytecode cache, which records whole
    seconds, would hand back the first version)."""
    path = write_exercise(root, EX02, solved={"2.3"})
    out = run(root, f"""
        import os
        from pathlib import Path
        import paged_course as course
        path = Path({str(path)!r})
        right = "    return (num_tokens + block_size - 1) // block_size\\n"
        text = path.read_text()
        assert right in text
        second = (os.stat(path).st_mtime_ns // 10**9 + 5) * 10**9   # a whole second, later

        def save(text, at_ns):
            path.write_text(text)
            os.utime(path, ns=(at_ns, at_ns))

        save(text, second + 100_000_000)
        ex = course.load("ex02_block_allocator")
        print(ex.blocks_needed(4, 4))
        save(text.replace(right, right.replace("- 1", "+ 1")), second + 600_000_000)  # same size
        print(ex.blocks_needed(4, 4))
    """)
    assert out.split() == ["1", "2"], f"the second call must see the edited file:\n{out}"


def test_yours_lines_wait_for_a_passed_check(root):
    write_exercise(root, EX02, solved={"2.1", "2.2", "2.3", "2.4", "2.5"},
                   edits=[(RIGHT_2_4, WRONG_2_4)])
    out = run(root, f"""
        from pathlib import Path
        import paged_course as course
        print(course.passed("ex02_block_allocator", "2.4"))
        course.check("ex02_block_allocator", keyword="2_4")
        print(course.passed("ex02_block_allocator", "2.4"))
        path = Path("exercises/ex02_block_allocator.py")
        path.write_text(path.read_text().replace({WRONG_2_4!r}, {RIGHT_2_4!r}))
        print(course.passed("ex02_block_allocator", "2.4", say=False))
        course.check("ex02_block_allocator", keyword="2_4")
        print(course.passed("ex02_block_allocator", "2.4"))
    """)
    lines = out.splitlines()
    answers = [x for x in lines if x in ("True", "False")]
    assert answers == ["False", "False", "False", "True"], out
    assert "2.4 (not checked yet: run its check cell)" in out
    assert "2.4 (failed in its last check)" in out


def test_waiting_exercises_are_named_once_per_reason(root):
    """However many exercises a comparison waits for, one line: those waiting for the same
    reason are listed together, in the words a learner reads (not the verdict's "todo")."""
    write_exercise(root, EX02, solved={"2.1", "2.2"})
    out = run(root, """
        import paged_course as course
        course.check("ex02_block_allocator", keyword="2_1")
        course.check("ex02_block_allocator", keyword="2_3 or 2_4")
        print(course.passed("ex02_block_allocator", "2.1", "2.3", "2.4", "2.5"))
    """)
    assert out.splitlines()[-2:] == [
        "ex02: not compared with paged_ref yet; waiting for 2.3, 2.4 (not implemented yet in "
        "their last checks); 2.5 (not checked yet: run its check cell)", "False"], out


@pytest.mark.parametrize("solved, keyword, passed", [
    ({"7.1", "7.2", "7.3"}, "7_1 or 7_2 or 7_3", 7),
    ({"7.1", "7.2", "7.3", "7.4"}, "7_4", 8),
    ({"7.1", "7.2", "7.3", "7.4", "7.5", "7.6"}, "7_5 or 7_6", 7),
], ids=["7.1-7.3", "7.4", "7.5-7.6"])
def test_each_exercise_is_checkable_in_the_lessons_order(root, solved, keyword, passed):
    """7.1 calls 7.8's share, 7.4 calls 7.7's allocate: their checks pass before the learner
    reaches 7.7 and 7.8 (the tests use the worked solution for the other exercises)."""
    write_exercise(root, EX07, solved=solved)
    out = run(root, f"""
        import paged_course as course
        course.check("ex07_sharing", keyword={keyword!r})
    """)
    label = ", ".join(sorted(n for n in solved if n.replace(".", "_") in keyword))
    assert out.splitlines() == [f"ex07 {label}: {passed} passed"], out
