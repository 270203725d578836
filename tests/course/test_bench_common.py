"""What the benchmark suites share (paged_bench.common), on a CPU: the command line,
the check-then-time loop, FlashInfer's page table; and every suite's --help and CPU answer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_bench import __main__ as entry
from paged_bench import common as bench_common
from paged_course import results
from paged_course.timing import wall_ms


def test_suite_parser_defaults_and_lists():
    p = bench_common.suite_parser("x", "first line\nmore", out="x.json", cases=["a", "b"],
                                  backends=("t", "u"))
    args = p.parse_args([])
    assert (args.cases, args.backends) == (["a", "b"], ["t", "u"])
    assert args.out == results.RESULTS / results.gpu_kind() / "x.json"  # what lessons read
    args = p.parse_args(["--cases", "b,", "--backends", "", "--out", "o/r.json"])
    assert (args.cases, args.backends, args.out) == (["b"], [], Path("o/r.json"))
    assert p.description == "first line" and p.prog.endswith("paged_bench x")


@pytest.mark.parametrize("argv, message", [(["--cases", "a,zz"], "unknown case zz"),
                                           (["--backends", "q"], "unknown backend q")])
def test_suite_parser_names_the_unknown(argv, message, capsys):
    p = bench_common.suite_parser("x", "doc", out="x.json", cases=["a"], backends=["t"])
    with pytest.raises(SystemExit) as exc:
        p.parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_check_then_time_checks_skips_and_times(capsys):
    x = torch.randn(5, generator=torch.Generator().manual_seed(3))

    def broken():
        raise RuntimeError("out of shared memory")

    runners = {"good": ("b1", {"tile": 8}, lambda: x * 2),
               "bad": ("b2", {}, broken),
               "off": ("b1", {}, lambda: x * 2 + 1)}
    measured = bench_common.check_then_time(
        "C", runners, lambda out: float((out - 2 * x).abs().max()), passes=3,
        timer=lambda fn: wall_ms(fn, repeat=1))
    assert [m.label for m in measured] == ["good", "off"]
    assert "C bad: skipped (RuntimeError: out of shared memory)" in capsys.readouterr().out
    good, off = measured
    assert good.error == 0 and off.error == pytest.approx(1.0)
    assert len(good.ms_passes) == 3 and good.ms == min(good.ms_passes)
    row = good.row("C", gbps=1.0, label="good[x]")
    assert row == {"case": "C", "backend": "b1", "label": "good[x]", "ms": good.ms,
                   "rel_err": 0.0, "gbps": 1.0, "tile": 8}


def test_flashinfer_page_table_ragged_with_garbage():
    # Sequence lengths 33 (3 pages, last holds 1), 64 (exactly 4 pages), 5 (1 page of 5);
    # entries past the used pages are garbage and must not appear.
    tables = torch.tensor([[3, 1, 7, -1, 2**30], [5, 0, 9, 2, -1], [8, -1, 2**30, -1, 4]],
                          dtype=torch.int32)
    lens = torch.tensor([33, 64, 5], dtype=torch.int32)
    indptr, indices, last = bench_common.flashinfer_page_table(tables, lens, 16)
    assert indptr.tolist() == [0, 3, 7, 8]
    assert indices.tolist() == [3, 1, 7, 5, 0, 9, 2, 8]
    assert last.tolist() == [1, 16, 5]
    assert {t.dtype for t in (indptr, indices, last)} == {torch.int32}


@pytest.mark.parametrize("suite", ["decode", "prefill", "quant", "engine", "transfer",
                                   "serving"])
def test_every_suite_has_help(suite, capsys):
    with pytest.raises(SystemExit) as exc:
        entry.main([suite, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"paged_bench {suite}" in out and "--out" in out


def test_entry_point_refuses_unknown_suites(capsys):
    assert entry.main(["common"]) == 2  # what the suites share is no suite
    assert entry.main(["nope"]) == 2
    assert entry.main([]) == 2
    assert "unknown suite 'nope'" in capsys.readouterr().err


@pytest.mark.parametrize("suite, argv, expected", [
    ("decode", ["--cases", "B4_L2048"], ["B4_L2048", "33.6 MB"]),
    ("prefill", ["--cases", "P8_L2048"], ["P8_L2048", "FLOP/byte"]),
    ("quant", ["--cases", "B4_L2048"], ["int4_g128", "x fewer than bf16"]),
])
def test_suites_refuse_without_a_gpu_and_say_what_they_would_measure(suite, argv, expected,
                                                                       capsys):
    if torch.cuda.is_available():
        pytest.skip("on a GPU the benchmark runs")
    assert entry.main([suite, *argv]) == 2
    out = capsys.readouterr().out
    assert all(text in out for text in ["No CUDA GPU", *expected]), out


def test_events_ms_times_only_the_call_after_its_warm_up(monkeypatch):
    """``before()`` runs ahead of every call and is not timed; warm-up calls are dropped; the
    median of the rest is returned (CUDA events stood in for by a clock the calls advance)."""
    from paged_course import timing

    clock = {"now": 0.0}

    class Event:
        def __init__(self, enable_timing):
            assert enable_timing

        def record(self):
            self.at = clock["now"]

        def synchronize(self):
            synced.append(self)

        def elapsed_time(self, end):
            return end.at - self.at

    monkeypatch.setattr(timing.torch.cuda, "Event", Event)
    durations = iter([100.0, 100.0, 3.0, 1.0, 2.0])  # two warm-up calls, then 3, 1, 2 ms
    flushes = []

    def call():
        clock["now"] += next(durations)

    def flush():
        flushes.append(1)
        clock["now"] += 50.0  # (not timed)

    synced = []
    assert timing.events_ms(call, before=flush, reps=3, warmup=2) == 2.0
    assert len(flushes) == 5
    assert len(synced) == 1  # one wait, after all calls are queued (not one per call)
