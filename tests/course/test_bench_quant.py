"""The quantised-cache benchmark's pieces, on the kernels' device (the interpreter on a CPU;
the timing itself needs a GPU)."""

from __future__ import annotations

import torch

from paged_bench import quant as bench_quant
from paged_course.checks import assert_close
from paged_course.testing import make_paged_inputs
from paged_ref.kernels.triton.decode import KernelConfig
from tests.conftest import KERNEL_DEVICE


def test_runners_and_reference_agree_for_every_format():
    """Every runner the benchmark times (Triton's; on a GPU with nvcc the CUDA kernels too)
    gives the float64 answer of the de-quantised cache."""
    plain = make_paged_inputs([40, 17], num_q_heads=8, num_kv_heads=2, head_dim=64,
                              dtype=torch.bfloat16, device=KERNEL_DEVICE, seed=31)
    for fmt in ("fp8", "int4"):
        inp = plain.quantized(fmt)
        ref = bench_quant.float64_reference(inp)
        assert_close(ref, inp.reference(), rel_tol=1e-12, name=f"{fmt} reference")
        runners = {**bench_quant.our_runners(inp),
                   **bench_quant.our_runners(inp, [KernelConfig(32, 4, 2)])}
        for label, (_, _, fn) in runners.items():
            assert_close(fn(), ref, name=f"{fmt} {label}")


def test_bytes_count_codes_and_scales():
    plain = make_paged_inputs([40, 17], num_q_heads=8, num_kv_heads=2, head_dim=64, seed=32,
                              dtype=torch.bfloat16)
    tokens = 57 * 2 * 2  # tokens x heads x (K, V)
    assert plain.kv_bytes == tokens * 128
    assert plain.quantized("fp8").kv_bytes == tokens * 64
    assert plain.quantized("fp8_token_head").kv_bytes == tokens * (64 + 4)
    assert plain.quantized("int4_g32").kv_bytes == tokens * (32 + 2 * 4)


def test_best_marks_skip_sweeps():
    rows = [dict(case="c", backend="triton", kv_format="fp8", ms=2.0),
            dict(case="c", backend="triton", kv_format="fp8", ms=1.0, sweep="configs"),
            dict(case="c", backend="flashinfer", kv_format="fp8", ms=3.0)]
    marked = bench_quant.mark_best(rows)
    assert [r["best"] for r in marked] == [True, False, True]


def test_best_marks_each_family_apart():
    rows = [dict(case="c", backend="triton", kv_format="fp8", ms=2.0),
            dict(case="c", backend="cuda_fp8", kv_format="fp8", ms=1.0),
            dict(case="c", backend="flashinfer", kv_format="fp8", ms=3.0)]
    marked = bench_quant.mark_best(rows)
    assert [r["best"] for r in marked] == [True, True, True]
    assert [bench_quant.family(r) for r in rows] == ["ours", "ours-CUDA", "FlashInfer"]
    assert bench_quant.family(dict(backend="cuda_int4")) == "ours-CUDA"
    assert bench_quant.family(dict(backend="triton_split")) == "ours"


def test_clean_l2_timer_flushes_by_reading_and_times_as_many_calls_as_do_bench(monkeypatch):
    """``clean_l2_ms`` (the bench's ``ms_clean_l2``) must flush with ``read_flush`` before every
    call (zeroing would leave dirty lines: the bias it exists to remove) and time ~200 ms of
    calls after ~25 ms of warm-up (100 calls were too few to be steady on the H200); a stand-in
    for the CUDA-event timer records what it was asked."""
    from paged_course import timing

    asked = []

    def fake_events_ms(fn, before=None, reps=100, warmup=10):
        asked.append((before, reps, warmup))
        return 0.1  # ms a call

    monkeypatch.setattr(timing, "events_ms", fake_events_ms)
    assert timing.clean_l2_ms(lambda: None) == 0.1
    assert all(before is timing.read_flush for before, _, _ in asked)
    assert asked[-1][1:] == (2000, 250)  # 200 ms / 0.1 ms, 25 ms / 0.1 ms
    asked.clear()
    monkeypatch.setattr(timing, "events_ms", lambda fn, before=None, reps=100, warmup=10: (
        asked.append((before, reps, warmup)) or 50.0))  # a slow call: the floors hold
    timing.clean_l2_ms(lambda: None)
    assert asked[-1][1:] == (100, 10)


def test_read_ceiling_takes_the_fastest_reader_of_all_the_bytes():
    """Lesson 10's ceiling table: per probe the fastest turn; the reader is the fastest ring that
    reads what the kernel reads (a codes-only ring reads fewer bytes and must not count); the
    85 % line is in microseconds for the kernel's bytes."""
    from paged_bench.quant import read_ceiling

    def row(probe, ms, case="B64_L4096", **extra):
        return dict(case=case, probe=probe, ms=ms, bytes=300_000_000, **extra)

    result = {"copy_bw_gbps": 4000.0, "rows": [
        row("kernel", 0.090), row("kernel", 0.089), row("bulk_s4", 0.086),
        row("bulk_s3", 0.085), row("bulk_s3", 0.084), row("bulk_s4_codes", 0.077),
        row("flat", 0.081), row("kernel", 0.010, case="B1_L131072"),
        row("bulk_s3", 0.001, kv_format="fp8")]}
    got = read_ceiling(result, "B64_L4096")
    assert got["kernel"]["ms"] == 0.089
    assert (got["reader"]["probe"], got["reader"]["ms"]) == ("bulk_s3", 0.084)
    assert got["flat"]["ms"] == 0.081
    assert abs(got["bar_us"] - 300e6 / (0.85 * 4000e9) * 1e6) < 1e-9
    # the committed run: INT4 B64_L4096's best bare reader, and FP8's B1_L131072
    from paged_course.quant_deep import study_part

    committed = read_ceiling(study_part("short_calls_study", "int4_read_ceiling"), "B64_L4096")
    assert committed["reader"]["probe"] == "bulk_s3" and committed["reader"]["ms"] < 0.0850
    assert committed["kernel"]["ms"] > committed["reader"]["ms"] > committed["bar_us"] / 1000
    fp8 = read_ceiling(study_part("short_calls_study", "fp8_read_ceiling"), "B1_L131072", "fp8")
    assert fp8["kernel"]["kv_format"] == fp8["reader"]["kv_format"] == "fp8"
    assert fp8["kernel"]["ms"] > fp8["reader"]["ms"] > fp8["bar_us"] / 1000
