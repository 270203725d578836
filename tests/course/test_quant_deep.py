"""Lesson 10's deep dives (10a, 10b, 10c): the study files they read, the readers' numbers and
the claims the notebooks' text makes of them, and their pictures, on a CPU.

Each claim test checks what a deep dive says against the committed study file, so a re-run that
changes the numbers fails here first; planted mistakes in the readers must show."""

from __future__ import annotations

import json
import re

import pytest
import torch

from paged_course import ROOT, quant_deep, quant_deep_plots, quant_study
from tests.mutations.mutate import mutant_of


def part(study, name):
    return quant_deep.study_part(study, name)


# ---- the study files ---------------------------------------------------------------------------

@pytest.mark.parametrize("name", quant_deep.STUDIES)
def test_every_part_is_stamped_with_its_probe_and_source(name):
    study = quant_deep.load_study(name)
    assert study["gpu"] == "NVIDIA H200" and study["parts"]
    for key, p in study["parts"].items():
        assert p["gpu"] == "NVIDIA H200", key
        assert re.fullmatch(r"2026-\d\d-\d\d", p["date"]), key
        assert re.fullmatch(r"[0-9a-f]{7,40}", p["commit"]), key
        assert p["what"] and p["source"], key
        if p["source"].startswith("benchmarks/"):  # (carried from a file git keeps)
            assert p["source"].endswith(f" at {p['commit']}"), key
    assert study["date"] == max(p["date"] for p in study["parts"].values())


def test_bad_names_are_refused_with_the_choices():
    with pytest.raises(ValueError, match="fp8_triton_study"):
        quant_deep.load_study("fp8_study")
    with pytest.raises(KeyError, match="kv_halves"):
        quant_deep.study_part("fp8_triton_study", "kv_half")


def test_best_by_takes_the_fastest_run_row_of_each_key():
    gen = torch.Generator().manual_seed(7)
    ms = (torch.rand(6, generator=gen) + 0.1).tolist()
    rows = [dict(label=lab, ms=m) for lab, m in zip("ababab", ms, strict=True)]
    rows += [dict(label="a", ms=None), dict(label="b", ms=0.0001, status="failed")]
    best = quant_deep.best_by(rows, "label")
    assert best["a"]["ms"] == min(ms[0::2]) and best["b"]["ms"] == min(ms[1::2])
    pairs = quant_deep.best_by([dict(x=1, y=2, ms=3.0), dict(x=1, y=2, ms=2.0)], "x", "y")
    assert pairs[(1, 2)]["ms"] == 2.0


# ---- 10a ---------------------------------------------------------------------------------------

def test_10a_reads_arrive_and_v_is_the_slow_half():
    """10a: FP8's rows read at ~91 %, INT4's 64-byte rows at 60 % (85 % as whole token rows);
    FP8 K costs little, FP8 V makes the kernel slower than all-bf16."""
    reads = quant_deep.read_row_summary(part("fp8_triton_study", "read_rows"))
    assert reads["fp8"]["row_bytes"] == 128 and round(reads["fp8"]["per_head"]) == 91
    assert round(reads["int4"]["per_head"]) == 60 and round(reads["int4"]["all_heads"]) == 85
    halves = quant_deep.best_by(part("fp8_triton_study", "kv_halves")["rows"], "label")
    pct = {k: round(r["pct_copy_bw"], 1) for k, r in halves.items()}
    assert (pct["fp8 K, bf16 V"], pct["bf16 K, fp8 V"], pct["fp8 K, fp8 V^T"]) == (
        87.8, 58.5, 68.1)
    assert halves["bf16 K, fp8 V"]["ms"] > halves["bf16 K, bf16 V"]["ms"]


def test_10a_pv_paths_stay_below_70_percent_and_planted_layout_swap_shows(tmp_path, monkeypatch):
    parts = (part("fp8_triton_study", "pv_paths"),
             part("fp8_triton_study", "pv_paths_launch_shapes"))
    paths = quant_deep.pv_path_best(*parts)
    assert [p["ms"] for p in paths] == sorted(p["ms"] for p in paths)
    assert paths[0]["v_layout"] == "transposed" and round(paths[0]["pct"], 1) == 69.8
    tensor_cores = [p["pct"] for p in paths if "FMA" not in p["path"]]
    assert 31 < min(tensor_cores) < max(tensor_cores) < 70
    assert round(next(p["pct"] for p in paths if "FMA" in p["path"]), 1) == 21.9
    swapped = mutant_of(quant_deep, [('"transposed" if lay == "dT"',
                                      '"transposed" if lay != "dT"')], tmp_path, monkeypatch)
    assert swapped.pv_path_best(*parts)[0]["v_layout"] != "transposed"


def test_10a_registers_prefetch_and_chunks(tmp_path, monkeypatch):
    regs, pre = part("fp8_triton_study", "regs"), part("fp8_triton_study", "prefetch")
    fp8 = quant_deep.regs_summary(regs, "fp8")
    assert (fp8["free"]["tile"], fp8["free"]["num_warps"]) == (64, 2)
    assert round(fp8["free"]["pct_copy_bw"], 1) == 66.2
    assert round(fp8["capped"]["pct_copy_bw"], 1) == 58.2
    got = {f: {k: round(v, 1) for k, v in r.items()}
           for f, r in quant_deep.prefetch_summary(regs, pre).items()}
    assert got == {"bf16": {"pipeline": 98.3, "prefetch": 57.4},
                   "fp8": {"pipeline": 66.2, "prefetch": 43.0},
                   "int4": {"pipeline": 22.9, "prefetch": 24.7}}
    # the library's configs follow the sweep (paged_ref/kernels/triton/decode.py)
    from paged_ref.kernels.triton.decode import QUANTISED_CONFIGS
    assert (QUANTISED_CONFIGS[1].tile, QUANTISED_CONFIGS[1].num_warps) == (64, 2)
    assert QUANTISED_CONFIGS[3].prefetch
    # a planted mistake: head-major prefetch rows counted with the token-major ones
    mixed = mutant_of(quant_deep, [('r["layout"] == "tok" and r["prefetch"]', 'r["prefetch"]')],
                      tmp_path, monkeypatch)
    assert round(mixed.prefetch_summary(regs, pre)["int4"]["prefetch"], 1) != 24.7
    chunks = quant_deep.split_summary(part("fp8_triton_study", "split"))
    assert list(chunks["fp8"]) == [1, 2, 4, 8]
    assert min(chunks["fp8"].values()) == chunks["fp8"][1] or (
        chunks["fp8"][1] / min(chunks["fp8"].values()) < 1.01)  # more chunks do not help


def test_10a_bfloat16_dots_were_5_to_11_percent_slower():
    from paged_bench.prefill import quant_table

    now = quant_table(json.loads((ROOT / "results" / "h200" / "prefill_quant.json").read_text()))
    first = quant_table({"results": part("fp8_triton_study", "prefill_bf16_dots")["rows"]})
    ratios = [b[f"{f} ms"] / a[f"{f} ms"] for a, b in zip(now, first, strict=True)
              for f in ("fp8", "fp8_token_head", "int4")]
    assert round(min(ratios), 2) == 1.05 and round(max(ratios), 2) == 1.11


# ---- 10b ---------------------------------------------------------------------------------------

def test_10b_design_steps_end_at_the_committed_quant_run():
    steps = quant_deep.design_steps(part("cuda_kernels_study", "design_steps"))
    assert round(steps[0]["fp8 pct"]) == 77 and steps[0]["int4 ms"] is None
    assert round(steps[1]["fp8 pct"]) == 90 and round(steps[1]["int4 pct"]) == 63
    assert round(steps[-1]["int4 pct"]) == 80
    int4 = [s["int4 ms"] for s in steps[1:]]
    assert int4 == sorted(int4, reverse=True), "INT4 gained at every step"
    quant = json.loads((ROOT / "results" / "h200" / "quant.json").read_text())
    for fmt in ("fp8", "int4"):
        best = min(r["ms"] for r in quant["results"] if r["case"] == "B64_L4096"
                   and r["kv_format"] == fmt and r["backend"].startswith("cuda"))
        assert steps[-1][f"{fmt} ms"] == best


def test_10b_tma_ring_and_lean_copies_ab(tmp_path, monkeypatch):
    tma = quant_deep.ab_change(part("cuda_kernels_study", "int4_tma_ab"),
                               "new[defines=INT4_TMA=0]", "new")
    assert set(tma) == {"B64_L4096", "B8_L32768", "B256_L1024", "B32_ragged"}
    assert all(-6.5 < r["change_pct"] < -3.5 for r in tma.values())
    lean = quant_deep.ab_change(part("cuda_kernels_study", "lean_copies_ab"), "old", "new")
    batches = [r["change_pct"] for c, r in lean.items() if c != "B1_L131072"]
    assert -2.0 < min(batches) and max(batches) < -1.1
    flipped = mutant_of(quant_deep, [('"change_pct": 100 * (b / a - 1)',
                                      '"change_pct": 100 * (a / b - 1)')], tmp_path, monkeypatch)
    assert all(r["change_pct"] > 0 for r in flipped.ab_change(
        part("cuda_kernels_study", "int4_tma_ab"), "new[defines=INT4_TMA=0]", "new").values())


def test_10b_swizzle_keeps_lines_whole_and_reads_faster():
    p = part("cuda_kernels_study", "ncu_l2_padded")
    lines = p["cache_lines"]
    assert round(p["l2_requests"] / lines, 2) == 2.70
    assert round(part("cuda_kernels_study", "ncu_l2_swizzled")["l2_requests"] / lines, 2) == 1.00
    rows = quant_deep.copy_path_rows(part("cuda_kernels_study", "copy_paths"))
    padded = [r["pct"] for r in rows if r["layout"] == "padded"]
    swizzled = [r["pct"] for r in rows if r["layout"] == "swizzled" and r["hint"] == "-"]
    hinted = [r["pct"] for r in rows if r["layout"] == "swizzled" and r["hint"] != "-"]
    assert max(padded) < 90 < 93.5 < min(swizzled) and max(hinted) < min(swizzled)
    assert all(r["hint"] == "L2::256B" for r in rows if r["layout"] == "padded")


def test_10b_launch_sweep_spread():
    sweep = part("cuda_kernels_study", "launch_sweep")
    fp8 = quant_deep.launch_sweep(sweep, "B64_L4096", "fp8")
    assert fp8[0]["label"] == "cuda[chunk=whole,stages=3,WARPS_PER_HEAD=2]"
    assert round(fp8[-1]["pct_copy_bw"] / fp8[0]["pct_copy_bw"], 2) == 0.70
    int4 = quant_deep.launch_sweep(sweep, "B64_L4096", "int4")
    assert 0.45 < int4[-1]["pct_copy_bw"] / int4[0]["pct_copy_bw"] < 0.55


# ---- 10c ---------------------------------------------------------------------------------------

def test_10c_fit_recovers_a_line_and_the_stored_fits(tmp_path, monkeypatch):
    gen = torch.Generator().manual_seed(3)
    fixed_ms, bw = float(torch.rand(1, generator=gen)) * 0.03, 4000.0
    share = 0.5 + 0.5 * float(torch.rand(1, generator=gen))
    sizes = (torch.rand(5, generator=gen) * 5e8 + 1e7).tolist()
    rows = [dict(bytes=b, ms=fixed_ms + b / (share * bw * 1e9) * 1e3) for b in sizes]
    fit = quant_deep.fit_fixed_cost(rows, bw)
    assert fit["fixed_us"] == pytest.approx(1000 * fixed_ms, rel=1e-6, abs=1e-6)
    assert fit["streaming_pct_copy_bw"] == pytest.approx(100 * share, rel=1e-9)
    with pytest.raises(ValueError, match="two sizes"):
        quant_deep.fit_fixed_cost(rows[:1] * 3, bw)
    stored = part("short_calls_study", "fixed_cost")
    for fmt, want in stored["fits"].items():
        got = quant_deep.fit_fixed_cost([r for r in stored["rows"] if r["kv_format"] == fmt],
                                        stored["copy_bw_gbps"])
        assert got["fixed_us"] == pytest.approx(want["fixed_us"], rel=1e-9)
    wrong = mutant_of(quant_deep, [("fixed_ms = my - slope * mx", "fixed_ms = my + slope * mx")],
                      tmp_path, monkeypatch)
    assert wrong.fit_fixed_cost(rows, bw)["fixed_us"] != pytest.approx(1000 * fixed_ms, rel=1e-3)


def test_10c_flush_bias_and_ceilings_as_the_text_says():
    bias = quant_deep.flush_bias(part("short_calls_study", "clean_l2"))
    streaming = [r["billed_us"] for r in bias if r["kernel"] != "FlashInfer fp8"]
    assert 5.9 < min(streaming) and max(streaming) < 9.4
    assert all(3.0 < r["copy_billed_us"] < 4.0 for r in bias)
    int4 = {r["case"]: r for r in bias if r["kernel"] == "CUDA int4"}
    uniform = [int4[c] for c in ("B64_L4096", "B8_L32768", "B256_L1024")]
    assert 85 < min(r["pct_clean"] for r in uniform) and max(r["pct_clean"] for r in uniform) < 91
    assert 77.5 < min(r["pct"] for r in uniform) and max(r["pct"] for r in uniform) < 83.5
    rows = quant_deep.ceiling_rows(part("short_calls_study", "copy_by_size"),
                                   part("cuda_kernels_study", "lean_copies_ab"))
    by = {(r["case"], r["kv_format"]): r for r in rows}
    assert round(by["B1_L131072", "int4"]["copy_pct"], 1) == 81.6
    fp8 = [by[c, "fp8"]["kernel_vs_copy_pct"] for c in ("B64_L4096", "B8_L32768", "B256_L1024")]
    assert 96.5 < min(fp8) and max(fp8) < 98.6
    int4c = [by[c, "int4"]["kernel_vs_copy_pct"] for c in ("B64_L4096", "B8_L32768", "B256_L1024")]
    assert 83 < min(int4c) and max(int4c) < 89.5


def test_10c_host_time_left_the_timer():
    before = part("short_calls_study", "host_before")
    after = part("short_calls_study", "host_after")
    worst = max(before["rows"], key=lambda r: r["bench_ms"] / r["graph_ms"])
    assert (worst["case"], worst["kv_format"]) == ("B1_L131072", "int4")
    assert worst["host_us"] > 1000 * worst["graph_ms"]  # the host slower than the GPU
    assert all(abs(r["bench_ms"] / r["graph_ms"] - 1) < 0.01 for r in after["rows"])


# ---- lesson 10's readers and every picture -----------------------------------------------------

def test_format_layout_counts_what_the_formats_say():
    head_dim = int(torch.randint(1, 3, (1,))) * 128  # (int4_g128 needs 128 channels)
    for row in quant_study.format_layout(head_dim):
        if row["format"] == "bf16":
            assert row["total"] == 2 * head_dim
        else:
            from paged_ref import KVFormat
            assert row["total"] == KVFormat.parse(row["format"]).bytes_per_token_head(head_dim)
    assert [name for name, _, _ in quant_study.format_layout(128)[3]["tensors"]] == [
        "codes", "scale", "zero"]


def test_decode_points_are_the_best_rows_of_each_family():
    quant = json.loads((ROOT / "results" / "h200" / "quant.json").read_text())
    points = quant_study.decode_points(quant, "B64_L4096")
    assert {(p["who"], p["kv_format"]) for p in points} >= {
        ("Triton", "bf16"), ("CUDA", "fp8"), ("CUDA", "int4"), ("FlashInfer", "fp8")}
    assert len({(p["who"], p["kv_format"]) for p in points}) == len(points)


def test_every_picture_draws():
    quant = json.loads((ROOT / "results" / "h200" / "quant.json").read_text())
    mix = json.loads((ROOT / "results" / "cpu" / "sm90_sass_mix.json").read_text())
    a, b, c = (lambda n, s=s: part(s, n) for s in quant_deep.STUDIES)
    figures = [
        quant_study.plot_format_bytes(), quant_study.plot_time_vs_bytes(quant),
        quant_deep_plots.plot_two_products(),
        quant_deep_plots.plot_reads_and_halves(quant_deep.read_row_summary(a("read_rows")),
                                               quant_deep.best_by(a("kv_halves")["rows"], "label")),
        quant_deep_plots.plot_sass_mix(mix),
        quant_deep_plots.plot_pv_paths(quant_deep.pv_path_best(a("pv_paths"))),
        quant_deep_plots.plot_bank_layouts(),
        quant_deep_plots.plot_tile_instructions(b("ncu_per_tile")["kernels"]),
        quant_deep_plots.plot_launch_sweep({"fp8": quant_deep.launch_sweep(
            b("launch_sweep"), "B64_L4096", "fp8")}, "B64_L4096"),
        quant_deep_plots.plot_design_steps(quant_deep.design_steps(b("design_steps"))),
        quant_deep_plots.plot_fixed_cost(c("fixed_cost")["rows"], c("fixed_cost")["fits"],
                                         c("fixed_cost")["copy_bw_gbps"]),
        quant_deep_plots.plot_flush_bias(quant_deep.flush_bias(c("clean_l2"))),
        quant_deep_plots.plot_ceilings(quant_deep.ceiling_rows(c("copy_by_size"),
                                                               b("lean_copies_ab"))),
        quant_deep_plots.plot_host_in_timer(c("host_before"), c("host_after"))]
    for fig in figures:
        assert fig.axes and any(ax.has_data() for ax in fig.axes)


@pytest.mark.parametrize("kind", ["fp8", "int4"])
def test_fragment_picture_gives_every_piece_one_lane(kind):
    fig = quant_deep_plots.plot_fragment_owners(kind, 128)
    for ax in fig.axes:
        owners = ax.images[0].get_array()
        assert owners.shape == (16, (128 if kind == "fp8" else 64) // 16)
        assert owners.min() >= 0 and owners.max() <= 31, "a piece no lane reads"
