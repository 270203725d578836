"""Shared pytest set-up: ``--impl`` picks solutions/ (default) or the learner's exercises/;
where the kernels run (:data:`KERNEL_DEVICE`, the ``kernel_device`` fixture); the ``gpu``
marker; :func:`need` for packages a bare GPU machine may lack."""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

import pytest
import torch

import paged_ref  # noqa: F401  (sets TRITON_INTERPRET=1 before anything imports triton)
from paged_course.exercise_files import EXERCISE, unsolved_exercise  # noqa: F401
from paged_ref import _device

ROOT = Path(__file__).resolve().parents[1]

#: The device every test that launches a Triton kernel puts its tensors on: "cpu" in Triton's
#: interpreter (a machine without a GPU), "cuda" where the kernels are compiled.
KERNEL_DEVICE: str = _device.triton_device()
#: True where the Triton kernels are compiled for a GPU (False: the interpreter).
COMPILED: bool = _device.compiled_triton_on(KERNEL_DEVICE)
#: Set by ``make test`` (CI, a learner's machine after ``make install``): every package of the
#: lab and dev extras is installed there, so a missing one is a failure, not a skip.
FULL_ENV = os.environ.get("PAGED_REF_FULL_ENV") == "1"


@pytest.fixture
def kernel_device() -> str:
    """:data:`KERNEL_DEVICE`: where a test's tensors go when a Triton kernel reads them."""
    return KERNEL_DEVICE


def need(module: str, why: str = ""):
    """Import ``module`` for a test, or skip it where the package is not installed (a bare GPU
    machine runs the suite without Jupyter, IPython or ipywidgets). Under ``make test``
    (:data:`FULL_ENV`) a missing package fails instead: those installs carry everything."""
    if FULL_ENV:
        return importlib.import_module(module)
    return pytest.importorskip(module, reason=f"needs {module}{': ' + why if why else ''} "
                               "(not installed here)")


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "gpu: needs a CUDA GPU with the kernels compiled (skipped elsewhere; "
        "`pytest -m gpu` runs only these)")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``gpu`` are skipped, with the reason, on a machine without CUDA (or with
    TRITON_INTERPRET=1 set on a GPU machine: the kernels are not compiled there)."""
    if torch.cuda.is_available() and not _device.INTERPRET:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU" if not torch.cuda.is_available() else
                            "needs the kernels compiled (TRITON_INTERPRET=1 is set)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


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


#: pytest sessions running in this process (a test that plants a mistake runs the tests it
#: breaks in a nested ``pytest.main``: 2 inside it), and whether the outer one is xdist's
#: controller (which gets a copy of every worker's reports).
_SESSIONS = {"depth": 0, "controller": False}


def pytest_sessionstart(session):
    _SESSIONS["depth"] += 1
    if _SESSIONS["depth"] == 1:
        _SESSIONS["controller"] = session.config.pluginmanager.has_plugin("dsession")


def pytest_sessionfinish(session):
    _SESSIONS["depth"] -= 1


def pytest_runtest_logreport(report):
    """Logs as tests finish, for a GPU run that its time limit may cut off before pytest's own
    summary: with ``PAGED_REF_FAILURE_LOG=<file>`` each failure's traceback, with
    ``PAGED_REF_DURATIONS_LOG=<file>`` each phase's seconds. Only the outer run's own tests:
    not a nested run's (its failures are planted mistakes, caught) -- in this process, or in
    a copy of the course that a test runs pytest in (``PAGED_REF_LOG_ROOT``, the repository
    whose tests log, where set) -- and not the controller's copy."""
    root = os.environ.get("PAGED_REF_LOG_ROOT")
    if _SESSIONS["depth"] != 1 or _SESSIONS["controller"] or (
            root and Path(root).resolve() != Path(__file__).resolve().parents[1]):
        return
    path = os.environ.get("PAGED_REF_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"\n===== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")
    path = os.environ.get("PAGED_REF_DURATIONS_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"{report.duration:.3f} {report.when} {report.outcome} {report.nodeid}\n")
