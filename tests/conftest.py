"""Shared pytest set-up: ``--impl`` picks solutions/ (default) or the learner's exercises/."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

import paged_ref  # noqa: F401  (sets TRITON_INTERPRET=1 before anything imports triton)
from paged_course.exercise_files import EXERCISE, unsolved_exercise  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]


def pytest_addoption(parser):
    parser.addoption(
        "--impl",
        choices=("solutions", "exercises"),
        default="solutions",
        help="which implementation the exercise tests check (default: solutions)",
    )


def load_exercise(config, name: str):
    """Import ``solutions.<name>`` or ``exercises.<name>`` according to ``--impl``."""
    return importlib.import_module(f"{config.getoption('--impl')}.{name}")


def reference_exercise(name: str):
    """The worked solution ``solutions/<name>.py``, imported from its file as a module of its
    own (``_reference_<name>``): what an exercise's tests use for the *other* exercises'
    functions, so each exercise is checked alone. Always the real solution, whatever
    ``--impl`` says and whatever tests/mutations planted into ``solutions.<name>``."""
    path = ROOT / "solutions" / f"{name}.py"
    module_name = f"_reference_{name}"
    known = sys.modules.get(module_name)
    if known is not None and getattr(known, "_stamp", None) == path.stat().st_mtime_ns:
        return known
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module  # dataclasses and Triton look their module up
    spec.loader.exec_module(module)
    module._stamp = path.stat().st_mtime_ns
    return module


def run_kernel(fn, *args, **kwargs):
    """Call ``fn`` (an exercise's kernel launch); a stub's NotImplementedError, which Triton
    wraps in its own error (an InterpreterError on a CPU, a compilation error on a GPU), comes
    back out unwrapped."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise
    except Exception as e:
        todo = unsolved_exercise(e)
        if todo:
            raise NotImplementedError(todo) from None
        raise


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """With ``--impl exercises``, an unsolved exercise is reported as skipped, not failed."""
    outcome = yield
    report = outcome.get_result()
    todo = call.excinfo and unsolved_exercise(call.excinfo.value)
    if todo and item.config.getoption("--impl") == "exercises":
        message = todo
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0, f"not implemented yet: {message}")
