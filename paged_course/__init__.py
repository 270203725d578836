"""Helpers for the lesson notebooks: your exercise files, their checks, and running your code
without stopping the notebook.

    import paged_course as course
    course.set_threads()                          # setup cell: a sane torch thread count
    ex = course.load("ex02_block_allocator")      # your exercises/ file, always as saved last
    course.check("ex02_block_allocator", keyword="2_4")   # one line: "ex02 2.4: 6 passed"
    course.passed("ex02_block_allocator", "2.4")  # did that check pass (file unchanged since)?
    out = course.yours(ex.append_slot, table, 6, 4, alloc)   # result, or None and why
    course.compare(out_tensor, reference, name="yours")      # one line, never stops the notebook
    with course.guard():                          # several steps of your code, same promise
        ...

By default notebooks use your ``exercises/`` files; set ``PAGED_REF_IMPL=solutions`` (CI and
``make test`` do) to run them against the worked solutions instead: then a failed check, a
difference found by ``compare`` and an error inside ``guard``/``yours`` raise, so a broken
solution fails the notebook run.
"""

from __future__ import annotations

from paged_course.exercise_check import CheckResult, check, passed
from paged_course.exercise_files import (
    IMPLS,
    ROOT,
    ExerciseModule,
    current_impl,
    load,
    place_in_exercise,
    refuse_other_checkout,
)
from paged_course.learner import compare, guard, yours
from paged_course.threads import default_threads, set_threads

_refuse_other_checkout = refuse_other_checkout  # the name older tests and notes use

__all__ = [
    "IMPLS", "ROOT", "CheckResult", "ExerciseModule", "check", "compare", "current_impl",
    "default_threads", "guard", "load", "passed", "place_in_exercise", "refuse_other_checkout",
    "set_threads", "yours",
]
