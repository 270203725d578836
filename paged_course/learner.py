"""Run your code inside a lesson without stopping the notebook.

A lesson's cells call your exercise functions to draw them or to compare them with
``paged_ref``. When your code is not written yet, raises, or gives a wrong answer, these
print one line (and the line of your file where an error came from) and the notebook goes
on, so Restart & Run All reaches the end. With ``PAGED_REF_IMPL=solutions`` (CI) they raise
instead: a broken worked solution fails the run.

    out = course.yours(ex.paged_decode, *batch.args())     # the result, or None (and why)
    course.compare(out, batch.reference(), name="your paged_decode")   # one line
    with course.guard():                                    # several steps of your code
        table, slots = grow_with_exercises(6, 7)
        assert_equal(table, ref.block_table("s"), name="block table")
"""

from __future__ import annotations

from types import TracebackType

from paged_course.checks import assert_close, assert_equal, tolerance
from paged_course.exercise_files import current_impl, place_in_exercise, unsolved_exercise

GOES_ON = "the notebook goes on with paged_ref's own version"


def describe_error(exc: BaseException, what: str | None = None) -> str:
    """One line for an error of the learner's code (plus detail lines for a wrong answer and
    the place in the exercise file where it was raised)."""
    prefix = f"{what}: " if what else ""
    todo = unsolved_exercise(exc)
    if todo:
        return f"{prefix}not implemented yet ({todo}); {GOES_ON}"
    if isinstance(exc, AssertionError):
        lines = str(exc).splitlines() or ["an assertion failed"]
        text = [f"{prefix}NOT the same yet: {lines[0]}", *("    " + x for x in lines[1:12])]
    else:
        text = [f"{prefix}your code raised {type(exc).__name__}: {exc}"]
    place = place_in_exercise(exc)
    if place is not None:
        text.extend(f"    {line}" for line in str(place).splitlines())
    return "\n".join(text)


class guard:  # noqa: N801  (used as ``with course.guard():``, like contextlib's helpers)
    """``with course.guard(): ...``: an exception in the block (your code raised, is not
    implemented yet, or an ``assert_close``/``assert_equal`` found a difference) prints one
    line saying so, where in your file it happened, and the cell goes on after the block.

    ``what`` names the code in that line. ``error`` is the exception caught (or None).
    Under ``PAGED_REF_IMPL=solutions`` nothing is caught. ``KeyboardInterrupt`` always
    passes through.
    """

    def __init__(self, what: str | None = None) -> None:
        self.what = what
        self.error: Exception | None = None

    def __enter__(self) -> guard:
        return self

    def __exit__(self, typ: type | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if not isinstance(exc, Exception) or current_impl() == "solutions":
            return False
        self.error = exc
        print(describe_error(exc, self.what))
        return True


def yours(fn, /, *args, **kwargs):
    """``fn(*args, **kwargs)`` for one of your exercise functions: its result, or None after
    one line saying why (not implemented yet, or the error and where in your file).

    Under ``PAGED_REF_IMPL=solutions`` an error is raised, not printed.
    """
    name = getattr(fn, "__name__", None) or getattr(getattr(fn, "fn", None), "__name__", None)
    with guard(f"your {name}" if name else None):
        return fn(*args, **kwargs)
    return None


def compare(got, expected, *, name: str = "yours", rel_tol: float | None = None,
            exact: bool = False, show: bool = True) -> float | None:
    """Compare your result with the reference and print one line; never stops the notebook.

    Args:
        got:      your result (a tensor, or a list/int with ``exact``); None (what
                  :func:`yours` returns for code that did not run) is skipped silently.
        expected: the reference, usually float64 (``inputs.reference()``).
        name:     what the line calls ``got``.
        rel_tol:  accepted ``‖got − expected‖ / ‖expected‖`` (default: per dtype, as
                  :func:`paged_course.checks.assert_close`).
        exact:    compare exactly (:func:`paged_course.checks.assert_equal`).
        show:     print the line on success too (``name: relative error 1.1e-04 (tolerance
                  1e-02)``); a difference is always printed.
    Returns:
        the relative error (0.0 when ``exact`` and equal), or None when they differ or
        ``got`` is None.
    Raises:
        AssertionError: they differ and ``PAGED_REF_IMPL=solutions``.
    """
    if got is None:
        return None
    try:
        if exact:
            assert_equal(got, expected, name=name)
            err = 0.0
        else:
            err = assert_close(got, expected, rel_tol=rel_tol, name=name)
    except AssertionError as e:
        if current_impl() == "solutions":
            raise
        print(describe_error(e))
        return None
    if show:
        print(f"{name}: equal" if exact else
              f"{name}: relative error {err:.1e} (tolerance {tolerance(got.dtype, rel_tol):.0e})")
    return err
