"""The exercise files a notebook works with: which ones, importing them as last saved, and
where in them an error happened.

    ex = load("ex02_block_allocator")    # exercises/ex02_block_allocator.py, always as saved last
    ex.blocks_needed(5, 4)               # re-imported first if the file changed since

``PAGED_REF_IMPL=solutions`` (CI and ``make test`` set it) switches every notebook to the worked
solutions in ``solutions/``.
"""

from __future__ import annotations

import importlib
import importlib.util
import linecache
import os
import re
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, TracebackType

ROOT = Path(__file__).resolve().parents[1]
IMPLS = ("exercises", "solutions")


def current_impl() -> str:
    """``"exercises"`` (the default) or ``"solutions"``, from ``PAGED_REF_IMPL``.

    Raises:
        ValueError: ``PAGED_REF_IMPL`` holds anything else.
    """
    impl = os.environ.get("PAGED_REF_IMPL", "exercises")
    if impl not in IMPLS:
        raise ValueError(f"PAGED_REF_IMPL must be one of {IMPLS}, got {impl!r}")
    return impl


def pick_impl(impl: str | None) -> str:
    """``impl``, or :func:`current_impl` when None. Raises ValueError for another name."""
    impl = impl or current_impl()
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def ensure_root_on_path() -> None:
    """Make ``exercises`` and ``solutions`` importable (they sit at the checkout's root)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


def exercise_path(name: str, impl: str) -> Path:
    """``<checkout>/<impl>/<name>.py``. Raises ValueError when there is no such file."""
    path = ROOT / impl / f"{name}.py"
    if not path.is_file():
        known = sorted(p.stem for p in (ROOT / impl).glob("ex*_*.py"))
        raise ValueError(f"no exercise file {name!r} in {impl}/; known: {known}")
    return path


def file_stamp(path: Path) -> tuple[int, int]:
    """(modification time in ns, size in bytes) of ``path``: changes when it is saved."""
    st = path.stat()
    return st.st_mtime_ns, st.st_size


def forget_module(fullname: str, path: Path) -> None:
    """Drop ``fullname`` from ``sys.modules`` and its cached bytecode, so the next import reads
    the file as it is now.

    NOTE: Python trusts a ``.pyc`` whose recorded source mtime (whole seconds) and size match;
    two saves within one second that keep the size (``<`` to ``>``) would import the old code.
    """
    sys.modules.pop(fullname, None)
    try:
        Path(importlib.util.cache_from_source(str(path))).unlink(missing_ok=True)
    except (NotImplementedError, OSError):
        pass  # no bytecode cache here, or a read-only checkout: nothing stale to remove
    linecache.checkcache(str(path))
    importlib.invalidate_caches()


def import_fresh(name: str, impl: str) -> ModuleType:
    """Import ``<impl>.<name>`` from its file as saved now (never a cached copy)."""
    ensure_root_on_path()
    fullname = f"{impl}.{name}"
    forget_module(fullname, exercise_path(name, impl))
    return importlib.import_module(fullname)


_PASSED_ON = ("__file__", "__doc__", "__name__")


class ExerciseModule:
    """Your exercise module, always as you saved it last: every attribute read first checks
    the file and re-imports it when it changed, so pictures and checks see the same code.

    ``module`` is the module object of the current import.
    """

    def __init__(self, name: str, impl: str) -> None:
        self._name, self._impl = name, impl
        self._path = exercise_path(name, impl)
        self._stamp: tuple[int, int] | None = None
        self._module: ModuleType | None = None

    @property
    def module(self) -> ModuleType:
        """The module as the file is now (imported again if it was saved since)."""
        stamp = file_stamp(self._path)
        if self._module is None or stamp != self._stamp:
            self._module = import_fresh(self._name, self._impl)
            self._stamp = stamp
        return self._module

    def __getattr__(self, attr: str):
        if attr.startswith("__") and attr.endswith("__") and attr not in _PASSED_ON:
            raise AttributeError(attr)  # copy, pickle and IPython probe these: not the module's
        return getattr(self.module, attr)

    def __dir__(self) -> list[str]:
        return dir(self.module)

    def __repr__(self) -> str:
        return f"<your {self._impl}/{self._name}.py, re-imported whenever you save it>"


def load(name: str, impl: str | None = None) -> ExerciseModule:
    """Your exercise file ``exercises/<name>.py`` (or ``solutions/`` with ``impl`` or
    ``PAGED_REF_IMPL=solutions``), always as saved last.

    In a notebook it also shows a link that opens the file in JupyterLab's editor.

    Raises:
        ValueError: unknown ``impl`` or exercise ``name``.
        RuntimeError: the notebook sits in another checkout than this kernel's course.
        Exception: whatever importing the file raises (a ``SyntaxError`` names file and line).
    """
    impl = pick_impl(impl)
    refuse_other_checkout()
    module = ExerciseModule(name, impl)
    show_link(module._path)
    module.module  # noqa: B018  (import now: a file that does not import says so here)
    return module


def show_link(path: Path) -> None:
    """A Markdown link to ``path``, relative to the notebook, when running in a notebook."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
        return
    from IPython.display import Markdown, display

    relative = Path(os.path.relpath(path, Path.cwd())).as_posix()
    display(Markdown(f"Your file: [{path.parent.name}/{path.name}]({relative}) "
                     "(click to open it next to this notebook)"))


def checkout_of(path: Path) -> Path | None:
    """The enclosing checkout of this course (a folder with paged_ref/ and exercises/)."""
    for folder in (path, *path.parents):
        if (folder / "paged_ref").is_dir() and (folder / "exercises").is_dir():
            return folder
    return None


def refuse_other_checkout() -> None:
    """Stop if the notebook sits in another checkout than the ``paged_ref`` this kernel runs.

    A kernel registered by another checkout would check that checkout's exercises, not the
    ones you are editing. The notebook's folder is the kernel's working directory.

    Raises:
        RuntimeError: the working directory is inside another checkout.
    """
    here = checkout_of(Path.cwd().resolve())
    if here is not None and here != ROOT.resolve():
        raise RuntimeError(
            f"this kernel runs paged_ref from {ROOT} but the notebook is in {here}: your "
            f"checks would test the wrong exercises/. Open the notebook with `make lab` in "
            f"{here} (or pick that checkout's kernel, see `make kernel`), then restart.")


# ---- where in your file an error happened --------------------------------------------------

EXERCISE = re.compile(r"Exercise \d+\.\d+[a-z]?: \w+")  # 4.2, or a warm-up such as 4.0a


@dataclass(frozen=True)
class Place:
    """A line of an exercise file: ``exercises/ex02_block_allocator.py:131, in append_slot``."""

    path: Path
    line: int
    function: str
    source: str

    def __str__(self) -> str:
        try:
            shown = self.path.relative_to(ROOT).as_posix()
        except ValueError:
            shown = str(self.path)
        text = f"at {shown}:{self.line}, in {self.function}"
        return f"{text}\n    {self.source}" if self.source else text


def _chain(exc: BaseException):
    """``exc`` and the exceptions it was raised from or during, outermost first."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)


def _last_place(tb: TracebackType | None, folders: tuple[Path, ...]) -> Place | None:
    found = None
    for frame, line in traceback.walk_tb(tb):
        path = Path(frame.f_code.co_filename)
        if path.parent in folders:
            source = linecache.getline(str(path), line).strip()
            found = Place(path, line, frame.f_code.co_name, source)
    return found


def place_in_exercise(exc: BaseException, impl: str | None = None) -> Place | None:
    """The last line of an exercise file that ``exc`` passed through, or None.

    Follows the chain of causes (a Triton kernel's error comes wrapped in the interpreter's),
    and keeps the innermost exception that went through ``exercises/`` (or ``solutions/``):
    that is the line that failed, not the kernel launch that led to it.
    """
    folders = tuple(ROOT / i for i in ((impl,) if impl else IMPLS))
    found = None
    for link in _chain(exc):
        found = _last_place(link.__traceback__, folders) or found
    return found


def unsolved_exercise(exc: BaseException) -> str | None:
    """``"Exercise N.M: name"`` if ``exc`` comes from an unsolved stub, else None.

    A stub raises ``NotImplementedError("Exercise N.M: ...")``. Inside a Triton kernel the
    interpreter (CPU) or the compiler (GPU) wraps it in its own error, and a compile error in a
    helper called by the kernel is re-raised from the call site; so look along the whole chain
    of causes, at types and at messages.
    """
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        text = str(exc)
        found = EXERCISE.search(text)
        if found and (isinstance(exc, NotImplementedError) or "NotImplementedError" in text):
            return found.group(0)
        exc = exc.__cause__ or exc.__context__
    return None
