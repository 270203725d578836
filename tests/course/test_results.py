"""paged_course.results / timing / syllabus: the notebooks' readers of committed results,
their CPU timer and the lesson list, on the committed files and on small made-up ones."""

from __future__ import annotations

import json

import matplotlib
import pytest

matplotlib.use("Agg")

from paged_course import results, syllabus, timing  # noqa: E402


def _row(case, backend, ms, **extra):
    return {"case": case, "backend": backend, "label": extra.pop("label", backend), "ms": ms,
            "gbps": 1.0 / ms, "pct_copy_bw": 10.0 / ms, "rel_err": 1e-3, **extra}


@pytest.fixture
def made_up():
    return {"gpu": "G", "date": "2026-01-01", "torch": "t", "triton": "tr", "copy_bw_gbps": 100.0,
            "results": [_row("A", "triton", 2.0), _row("A", "flashinfer", 1.5, label="fi[x]"),
                        _row("A", "flashinfer", 1.0, label="fi[y]"),
                        _row("A", "triton_split", 0.5, sweep="chunks", num_chunks=4),
                        _row("A", "triton_split", 0.8, num_chunks=2),
                        _row("B", "triton", 3.0)]}


def test_best_and_row(made_up):
    assert results.best(made_up, "A", "flashinfer")["label"] == "fi[y]"
    assert results.best(made_up, "A", "triton_split")["ms"] == 0.8  # sweeps left out
    assert results.best(made_up, "B", "flashinfer") is None
    assert results.row(made_up, "A", "fi[x]")["ms"] == 1.5
    with pytest.raises(KeyError, match="label='nope'"):
        results.row(made_up, "A", "nope")
    assert results.stamp(made_up) == "G, 2026-01-01 (torch t, triton tr)"


def test_backend_table_keeps_complete_cases(made_up, capsys):
    table = results.print_backend_table(made_up, ["triton", "triton_split", "flashinfer"])
    assert list(table) == ["A"]
    out = capsys.readouterr().out
    assert "1.25x" in out  # FlashInfer 1.0 ms over ours 0.8 ms


def test_runs_differ_names_both_numbers(made_up):
    cfg = {"tile": 64, "num_warps": 4, "num_stages": 3}
    earlier = {**made_up, "results": [_row("A", "triton_split", 0.9, num_chunks=1, config=cfg)]}
    assert results.runs_differ(earlier, made_up, cfg) == [
        "A: 0.9000 ms with 1 chunk(s) in the sweep, 0.8000 ms with 2 chunk(s) in the results"]
    same = {**made_up, "results": [_row("A", "triton_split", 0.81, num_chunks=2, config=cfg)]}
    assert results.runs_differ(same, made_up, cfg) == []


def test_committed_files_read_and_tabulate(tmp_path):
    bench = results.load_results("decode")
    assert bench["results"] and "copy_bw_gbps" in bench
    text = results.markdown_table(bench)
    assert text.count("| B64_L4096 |") >= 4 and bench["gpu"] in text
    path = tmp_path / "x.json"
    path.write_text(json.dumps(bench))
    assert results.load_results(path) == bench
    fig = results.draw_pct_copy_bw(bench, ["triton", "flashinfer"])
    assert len(fig.axes[0].patches) == 2 * len(results.cases(bench))


def test_committed_tuning_run_differs_from_results_and_says_so():
    # The lesson 05 tables come from two runs; runs_differ must name the cases where they
    # disagree (issue 8: B4_L2048 0.0597 vs 0.0263 ms, B32_ragged 4 vs 8 chunks).
    cfg = {"tile": 64, "num_warps": 4, "num_stages": 3}
    lines = results.runs_differ(results.load_results("tune_configs"),
                                results.load_results("decode"), cfg)
    assert any(line.startswith("B32_ragged: ") and "4 chunk(s) in the sweep" in line
               and "8 chunk(s) in the results" in line for line in lines)
    assert any(line.startswith("B4_L2048: ") for line in lines)


def test_wall_ms_is_a_median():
    calls = []
    assert timing.wall_ms(lambda: calls.append(1), repeat=3) >= 0
    assert len(calls) == 3
    assert timing.gbps(2e9, 1000.0) == pytest.approx(2.0)


def test_syllabus_state_comes_from_the_files(tmp_path):
    (tmp_path / "00_setup.ipynb").write_text("{}")
    (tmp_path / "03_gather_attention.ipynb").write_text("{}")
    table = syllabus.syllabus_markdown(tmp_path)
    lines = table.splitlines()[2:]
    assert len(lines) == 13 and lines[0].startswith("| 00 ") and lines[-1].startswith("| 12 ")
    assert "ready: `00_setup.ipynb`" in lines[0] and "ready: `03_gather" in lines[3]
    assert all("planned" in line for i, line in enumerate(lines) if i not in (0, 3))


def test_environment_and_write_result(tmp_path):
    env = results.environment()
    stamp = {"gpu", "torch", "triton", "cuda", "flashinfer", "python", "date", "commit"}
    assert stamp <= env.keys()
    path = results.write_result({**env, "results": []}, tmp_path / "new" / "r.json")
    assert path == tmp_path / "new" / "r.json"
    assert json.loads(path.read_text())["date"] == env["date"]
    assert results.stamp(json.loads(path.read_text())).startswith(env["gpu"])


def test_reference_gpu_reads_its_ceilings_from_the_committed_runs():
    ref = results.reference_gpu()
    decode, prefill = results.load_results("decode"), results.load_results("prefill")
    assert ref["copy_bw_gbps"] == decode["copy_bw_gbps"]
    assert ref["matmul_tflops"] == prefill["matmul_tflops"]
    assert abs(ref["ridge_flop_per_byte"] - prefill["matmul_tflops"] * 1e3
               / decode["copy_bw_gbps"]) < 1e-9
