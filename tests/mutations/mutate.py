"""Mutation testing for the exercises: plant a likely mistake, check the tests catch it.

Each lesson warns about a few mistakes (a missed mask, a missed int64 cast, a free list out of
step, ...). For each, a :class:`Mutation` says how to plant it into the worked solution: a text
substitution on ``solutions/<name>.py`` that must apply exactly once. :func:`assert_caught` writes
the mutated file to a temporary folder, imports it in place of ``solutions.<name>`` (so the
exercise tests' ``ex`` fixture gets it), runs the selected exercise tests in this process
(``pytest -x -k <keyword>``) and fails unless at least one of them fails.

    from tests.mutations.mutate import Mutation, assert_caught

    MUTATIONS = [Mutation("allocate forgets the free set", "self._free_set.remove(block_id)",
                          "pass", keyword="2_1")]

    @pytest.mark.parametrize("mutation", MUTATIONS, ids=str)
    def test_mutation_is_caught(mutation, tmp_path):
        assert_caught("ex02_block_allocator", mutation, tmp_path)

Keep ``keyword`` narrow (the tests of the exercise that holds the mistake): Triton kernels run
in the interpreter on a CPU, and every selected test runs until the first failure.

Exercise tests that call a mutant's functions themselves (lessons 08 and 10) get it from
:func:`load_mutant`.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import subprocess
import sys
import types
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Mutation:
    """One planted mistake.

    description: what a learner got wrong, in words (shown as the test id).
    old, new:    replace ``old`` by ``new`` in the solution's source; ``old`` must occur exactly
                 once. For a mistake that needs several edits, give tuples of equal length.
    keyword:     ``pytest -k`` expression picking the tests that should catch it.
    isolate:     run the tests in a subprocess: for mistakes that make a kernel read far out of
                 bounds, which kills the process (a crash counts as caught).
    """

    description: str
    old: str | tuple[str, ...]
    new: str | tuple[str, ...]
    keyword: str
    isolate: bool = False

    def edits(self) -> list[tuple[str, str]]:
        olds = (self.old,) if isinstance(self.old, str) else self.old
        news = (self.new,) if isinstance(self.new, str) else self.new
        if len(olds) != len(news):
            raise ValueError(f"{self.description}: {len(olds)} old texts but {len(news)} new")
        return list(zip(olds, news, strict=True))

    def __str__(self) -> str:
        return self.description


def solution_path(name: str) -> Path:
    return ROOT / "solutions" / f"{name}.py"


def mutated_source(name: str, mutation: Mutation) -> str:
    """``solutions/<name>.py`` with ``mutation`` applied; each ``old`` must occur exactly once."""
    source = solution_path(name).read_text()
    for old, new in mutation.edits():
        count = source.count(old)
        if count != 1:
            raise AssertionError(
                f"mutation {mutation.description!r}: {old!r} occurs {count} times in "
                f"solutions/{name}.py, expected exactly once (did the solution change?)"
            )
        source = source.replace(old, new)
    return source


def load_mutant(name: str, old: str, new: str, folder: Path) -> types.ModuleType:
    """``solutions/<name>.py`` with ``old`` replaced by ``new`` (``old`` must occur exactly
    once), imported from a file in ``folder`` (Triton reads a kernel's source from its file) as
    a module of its own; ``solutions.<name>`` is left as it is."""
    mutation = Mutation(f"{old!r} -> {new!r}", old, new, keyword="")
    path = Path(folder) / f"{name}_mutant_{Path(folder).name}.py"
    path.write_text(mutated_source(name, mutation))
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    return module


def mutant_of(module: types.ModuleType, edits, folder, monkeypatch) -> types.ModuleType:
    """A library module with planted mistakes: ``edits`` ``[(old, new), ...]`` (each ``old``
    exactly once) applied to its source, loaded from a file in ``folder`` (Triton reads a
    kernel's source from its file) as ``mutant_<name>``, registered in ``sys.modules`` for the
    test (dataclasses look their module up); the real module is left as it is."""
    path = Path(module.__file__)
    source = path.read_text()
    for old, new in edits:
        count = source.count(old)
        assert count == 1, f"{old!r} occurs {count} times in {path.name}, expected once"
        source = source.replace(old, new)
    file = Path(folder) / f"mutant_{path.name}"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(file.stem, file)
    mutant = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, mutant)
    spec.loader.exec_module(mutant)
    return mutant


def cuda_mutant(source: Path, edits, folder) -> Path:
    """CUDA sources with planted mistakes: every ``.cu`` / ``.cuh`` file beside ``source`` (a
    translation unit that includes them) copied into ``folder``, ``edits`` ``[(old, new), ...]``
    applied (each ``old`` exactly once across the files); returns the copy of ``source``."""
    source, folder = Path(source), Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    texts = {p.name: p.read_text() for p in sorted(source.parent.iterdir())
             if p.suffix in (".cu", ".cuh")}
    for old, new in edits:
        holders = {name: text.count(old) for name, text in texts.items() if old in text}
        assert sum(holders.values()) == 1, (
            f"{old!r} occurs {sum(holders.values())} times in {source.parent.name}/ "
            f"({holders}), expected once")
        (name,) = holders
        texts[name] = texts[name].replace(old, new)
    for name, text in texts.items():
        (folder / name).write_text(text)
    return folder / source.name


@contextlib.contextmanager
def installed_mutant(name: str, mutation: Mutation, folder: Path):
    """Import the mutated solution as ``solutions.<name>`` for the duration of the block.

    It is written to a real file (``folder/<name>.py``): Triton reads a kernel's source from its
    file. The original module comes back afterwards.
    """
    path = Path(folder) / f"{name}.py"
    path.write_text(mutated_source(name, mutation))
    with installed_file(name, path) as module:
        yield module


@contextlib.contextmanager
def installed_file(name: str, path: Path):
    """Import ``path`` as ``solutions.<name>`` for the duration of the block."""
    module_name = f"solutions.{name}"
    importlib.import_module(module_name)  # so the package and the original are loaded
    original = sys.modules[module_name]
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules[module_name] = original


def run_exercise_tests(name: str, keyword: str) -> tuple[int, str]:
    """Run ``tests/exercises/test_<name>.py -k keyword -x`` in this process on the solutions.

    Returns pytest's exit code and its output.
    """
    test_file = ROOT / "tests" / "exercises" / f"test_{name}.py"
    args = [str(test_file), "-k", keyword, "-x", "-q", "--no-header", "--tb=line",
            "--impl", "solutions", "-o", "addopts=", "-p", "no:cacheprovider",
            "-p", "no:xdist", "-p", "no:randomly", "--capture=no", "-W", "ignore"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = pytest.main(args)
    return int(code), out.getvalue()


def run_isolated(name: str, mutation: Mutation, folder: Path) -> tuple[int, str]:
    """:func:`run_exercise_tests` on the mutant in a fresh Python (``python -m
    tests.mutations.mutate NAME FILE KEYWORD``); a process killed by a signal counts as
    failed tests."""
    path = Path(folder) / f"{name}.py"
    path.write_text(mutated_source(name, mutation))
    proc = subprocess.run([sys.executable, "-m", "tests.mutations.mutate", name, str(path),
                           mutation.keyword], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    code = proc.returncode
    if code < 0:  # killed by a signal (SIGSEGV: a read far out of bounds)
        code = pytest.ExitCode.TESTS_FAILED
    return int(code), proc.stdout + proc.stderr


def assert_caught(name: str, mutation: Mutation, folder: Path) -> None:
    """Fail unless the tests of ``solutions/<name>.py`` selected by ``mutation.keyword`` fail
    on the mutated solution."""
    if mutation.isolate:
        code, output = run_isolated(name, mutation, folder)
    else:
        with installed_mutant(name, mutation, folder):
            code, output = run_exercise_tests(name, mutation.keyword)
    tail = "\n".join(output.strip().splitlines()[-8:])
    if code == pytest.ExitCode.OK and " passed" not in output and " skipped" in output:
        pytest.skip(f"every test selected by -k {mutation.keyword!r} is skipped here")
    if code == pytest.ExitCode.OK:
        raise AssertionError(
            f"mutation survived: {mutation.description!r} planted in solutions/{name}.py, yet "
            f"every test selected by -k {mutation.keyword!r} passed. Strengthen "
            f"tests/exercises/test_{name}.py.\n{tail}"
        )
    if code != pytest.ExitCode.TESTS_FAILED:
        raise AssertionError(
            f"mutation {mutation.description!r}: the exercise tests did not run properly "
            f"(pytest exit code {code}; -k {mutation.keyword!r} selects no test?)\n{tail}"
        )


if __name__ == "__main__":  # python -m tests.mutations.mutate NAME MUTANT_FILE KEYWORD
    import paged_ref  # noqa: F401  (TRITON_INTERPRET on a CPU, before triton is imported)

    _name, _path, _keyword = sys.argv[1:4]
    with installed_file(_name, Path(_path)):
        _code, _output = run_exercise_tests(_name, _keyword)
    print(_output)
    sys.exit(_code)
