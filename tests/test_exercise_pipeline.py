"""exercises/ is generated from solutions/, and both expose the same API."""

from __future__ import annotations

import importlib
import inspect
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import make_exercises  # noqa: E402

SOLUTION_FILES = sorted(p.stem for p in (ROOT / "solutions").glob("ex*_*.py"))


def test_exercises_are_generated_from_solutions():
    stale = [
        str(path.relative_to(ROOT))
        for path, text in make_exercises.expected_exercises().items()
        if not path.exists() or path.read_text() != text
    ]
    assert not stale, (
        f"exercises/ is out of date with solutions/: {stale}. Run `make exercises`. "
        "(If you are a learner and edited exercises/, this is expected: `make test-exercises` "
        "checks your work.)"
    )


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
        and getattr(obj, "__module__", module.__name__) == module.__name__
    }


def _signature(obj):
    fn = getattr(obj, "fn", obj)  # a @triton.jit function keeps the Python one in .fn
    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return None


@pytest.mark.parametrize("name", SOLUTION_FILES)
def test_exercise_api_matches_solution(name):
    sol = importlib.import_module(f"solutions.{name}")
    ex = importlib.import_module(f"exercises.{name}")
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
