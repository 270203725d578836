"""exercises/ is generated from solutions/, and both expose the same API."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import make_exercises  # noqa: E402

SOLUTION_FILES = sorted(p.stem for p in (ROOT / "solutions").glob("ex*_*.py"))


def test_exercises_are_generated_from_solutions():
    """The committed exercises/ (or the files on disk) are what the generator writes.

    A learner's edits to exercises/ do not fail this test: it passes when either the working
    copy or git's HEAD holds the generated text, so only a maintainer who edited solutions/
    without regenerating sees it fail.
    """
    stale = [
        str(path.relative_to(ROOT))
        for path, text in make_exercises.expected_exercises().items()
        if text not in (path.read_text() if path.exists() else None,
                        make_exercises.committed_text(path))
    ]
    assert not stale, (
        f"exercises/ is out of date with solutions/: {stale}. Run `make exercises` and commit "
        "both (it first copies any edited exercise file to backups/, so nothing is lost)."
    )


def test_generated_stubs_pass_ruff(tmp_path):
    """The stubs the generator writes lint clean (make test lints solutions/, not exercises/)."""
    ruff = shutil.which("ruff") or shutil.which("ruff", path=str(Path(sys.executable).parent))
    if ruff is None:
        pytest.skip("ruff is not installed")
    for path, text in make_exercises.expected_exercises().items():
        (tmp_path / path.name).write_text(text)
    done = subprocess.run([ruff, "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
                           str(tmp_path)], capture_output=True, text=True)
    assert done.returncode == 0, f"generated exercises fail ruff:\n{done.stdout}{done.stderr}"


def test_make_exercises_backs_up_edits(tmp_path, monkeypatch):
    """Regenerating never destroys a learner's edits: they are copied to backups/ first."""
    exercises, solutions = tmp_path / "exercises", tmp_path / "solutions"
    solutions.mkdir()
    (solutions / "ex09_demo.py").write_text(
        "def f(x):\n    # BEGIN SOLUTION\n    return x\n    # END SOLUTION\n")
    monkeypatch.setattr(make_exercises, "ROOT", tmp_path)
    monkeypatch.setattr(make_exercises, "SOLUTIONS", solutions)
    monkeypatch.setattr(make_exercises, "EXERCISES", exercises)
    monkeypatch.setattr(make_exercises, "BACKUPS", tmp_path / "backups")
    assert make_exercises.main([]) == 0
    assert not (tmp_path / "backups").exists(), "nothing edited, nothing to back up"
    mine = "def f(x):\n    return x  # my answer, with a line far longer than ruff allows" * 2
    (exercises / "ex09_demo.py").write_text(mine)
    assert make_exercises.main([]) == 0
    [backup] = (tmp_path / "backups").iterdir()
    assert (backup / "ex09_demo.py").read_text() == mine
    assert "NotImplementedError" in (exercises / "ex09_demo.py").read_text()


def test_every_solution_has_tests():
    tests = ROOT / "tests" / "exercises"
    missing = [s for s in SOLUTION_FILES if not (tests / f"test_{s}.py").exists()]
    assert not missing, f"solutions without tests/exercises/test_<name>.py: {missing}"


def _public(module):
    return {
        name: obj
        for name, obj in vars(module).items()
        if not name.startswith("_")
        and (inspect.isfunction(obj) or inspect.isclass(obj) or hasattr(obj, "fn"))
        and getattr(getattr(obj, "fn", obj), "__module__", module.__name__) == module.__name__
    }


def _signature(obj):
    fn = getattr(obj, "fn", obj)  # a @triton.jit function keeps the Python one in .fn
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return None


def generated_module(name: str, folder: Path):
    """The stub module the generator writes for ``name``, imported from ``folder``.

    Not exercises/ itself: a learner's helpers or edits there must not fail `make test`.
    """
    # Every stub goes into one package, so a stub's relative import of another lesson's stub
    # (ex05 uses lesson 04's ``load_kv_tile``) resolves as it does in exercises/.
    package = f"generated_{folder.name}".replace("-", "_")
    (folder / package).mkdir()
    (folder / package / "__init__.py").write_text("")
    for path, text in make_exercises.expected_exercises().items():
        (folder / package / path.name).write_text(text)
    sys.path.insert(0, str(folder))
    try:
        return importlib.import_module(f"{package}.{name}")
    finally:
        sys.path.remove(str(folder))


@pytest.mark.parametrize("name", SOLUTION_FILES)
def test_exercise_api_matches_solution(name, tmp_path):
    sol = importlib.import_module(f"solutions.{name}")
    ex = generated_module(name, tmp_path)
    sol_api, ex_api = _public(sol), _public(ex)
    assert sorted(sol_api) == sorted(ex_api), f"{name}: names differ"
    for attr, obj in sol_api.items():
        assert _signature(obj) == _signature(ex_api[attr]), f"{name}.{attr}: signature differs"
        if inspect.isclass(obj):
            methods = {m for m in vars(obj) if not m.startswith("__") or m == "__init__"}
            assert methods == {m for m in vars(ex_api[attr]) if not m.startswith("__")
                               or m == "__init__"}, f"{name}.{attr}: methods differ"


def test_stub_generation_replaces_each_block():
    source = (
        "def f(x):\n"
        "    '''doc'''\n"
        "    # BEGIN SOLUTION\n"
        "    return x + 1\n"
        "    # END SOLUTION\n"
        "\n"
        "class A:\n"
        "    def g(self):\n"
        "        y = 1\n"
        "        # BEGIN SOLUTION\n"
        "        return y\n"
        "        # END SOLUTION\n"
    )
    stub = make_exercises.make_stub(source, 7)
    assert 'raise NotImplementedError("Exercise 7.1: f")' in stub
    assert '        raise NotImplementedError("Exercise 7.2: g")' in stub
    assert "return x + 1" not in stub and "y = 1" in stub


def test_stub_generation_takes_a_label_for_warm_ups():
    source = ("def f():\n    # BEGIN SOLUTION 4.0a\n    pass\n    # END SOLUTION\n"
              "def g():\n    # BEGIN SOLUTION\n    pass\n    # END SOLUTION\n")
    stub = make_exercises.make_stub(source, 4)
    assert 'raise NotImplementedError("Exercise 4.0a: f")' in stub
    assert 'raise NotImplementedError("Exercise 4.2: g")' in stub
    with pytest.raises(ValueError, match="label"):
        make_exercises.make_stub("def f():\n    # BEGIN SOLUTION 5.1\n    pass\n"
                                 "    # END SOLUTION\n", 4)


@pytest.mark.parametrize(
    "source",
    ["def f():\n    # BEGIN SOLUTION\n    pass\n",
     "def f():\n    # END SOLUTION\n",
     "def f():\n    pass\n"],
)
def test_stub_generation_rejects_broken_markers(source):
    with pytest.raises(ValueError):
        make_exercises.make_stub(source, 1)


def _paged_ref_functions() -> dict[str, list[tuple[str, object]]]:
    """Every module-level function (and Triton kernel) of paged_ref, by name."""
    import pkgutil

    import paged_ref

    found: dict[str, list[tuple[str, object]]] = {}
    for info in pkgutil.walk_packages(paged_ref.__path__, "paged_ref."):
        try:
            module = importlib.import_module(info.name)
        except ImportError:  # an optional dependency (GPU-only, engine extras) is missing
            continue
        for name, obj in _public(module).items():
            if not inspect.isclass(obj):
                found.setdefault(name, []).append((info.name, obj))
    return found


def _parameters(obj) -> list[tuple[str, str]]:
    fn = getattr(obj, "fn", obj)
    return [(p.name, p.kind.name) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("name", SOLUTION_FILES)
def test_same_name_as_paged_ref_means_the_same_signature(name):
    """A function an exercise shares a name with in paged_ref takes the same parameters, so
    "compare with paged_ref's version" compares like with like."""
    library = _paged_ref_functions()
    sol = importlib.import_module(f"solutions.{name}")
    clashes = []
    for attr, obj in _public(sol).items():
        if inspect.isclass(obj):
            continue
        for where, other in library.get(attr, []):
            if _parameters(obj) != _parameters(other):
                clashes.append(f"{name}.{attr}{inspect.signature(getattr(obj, 'fn', obj))} vs "
                               f"{where}.{attr}{inspect.signature(getattr(other, 'fn', other))}")
    assert not clashes, "same name, different signature (rename one):\n" + "\n".join(clashes)
