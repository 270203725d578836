"""``python -m paged_bench engine``'s arithmetic, on a CPU (the suite itself needs a GPU)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from paged_bench.engine import busy_seconds, fresh, step_roofline_ms, workload


def event(start_us: float, end_us: float):
    return SimpleNamespace(time_range=SimpleNamespace(start=start_us, end=end_us))


@pytest.mark.parametrize("ranges, busy_us", [
    ([], 0),
    ([(0, 10)], 10),
    ([(0, 10), (20, 25)], 15),  # a gap is not busy
    ([(0, 10), (5, 12)], 12),  # overlapping kernels (two streams) count once
    ([(0, 30), (5, 12), (40, 41)], 31),  # one inside another
    ([(40, 41), (0, 30), (5, 12)], 31),  # in any order
])
def test_busy_time_is_the_union_of_the_kernels_time_ranges(ranges, busy_us):
    assert busy_seconds([event(a, b) for a, b in ranges]) == pytest.approx(busy_us / 1e6)


def test_the_step_roofline_takes_whichever_binds_the_matmuls():
    """The 1B-like shape on an H200 (2.47 GB of bf16 weights, 4,274 GB/s, 680 TFLOP/s): at
    batch 64 the weights' bytes bind (0.578 ms), at batch 256 the FLOPs do (2 x 256 x 1.24e9
    = 0.63 TFLOP: 0.931 ms); the K/V is read once on top either way."""
    w, bw, peak = 2_471_628_800, 4273.6, 680.0
    kv64, kv256 = 595_591_168, 2_382_364_672
    assert step_roofline_ms(w, kv64, 64, bw, peak) == pytest.approx((w + kv64) / bw / 1e6)
    assert step_roofline_ms(w, kv256, 256, bw, peak) == pytest.approx(
        2 * 256 * w / 2 / 680e12 * 1e3 + kv256 / bw / 1e6)
    assert step_roofline_ms(w, kv256, 256, bw, peak) == pytest.approx(1.488, abs=1e-3)
    assert step_roofline_ms(w, kv256, 256, bw, peak, element_size=4) < step_roofline_ms(
        w, kv256, 256, bw, peak)  # (float32 weights: half the FLOPs per byte)


def test_each_run_of_the_engine_suite_gets_prompts_the_prefix_cache_never_saw():
    """``fresh``: the same lengths, ids in the model's range, and no 16-token block alike
    between rounds (so the timed and the profiled run compute every prompt token)."""
    from paged_ref import KVCacheManager

    prompts, _ = workload(64, 300)
    rounds = [fresh(prompts, r, 300) for r in range(3)]
    assert rounds[0] == prompts
    for ids in rounds:
        assert [len(p) for p in ids] == [len(p) for p in prompts]
        assert all(3 <= t < 300 for p in ids for t in p)
    m = KVCacheManager(3 * sum(len(p) // 16 + 1 for p in prompts), 16,
                       enable_prefix_caching=True)
    for r, ids in enumerate(rounds):
        for i, p in enumerate(ids):
            assert m.add_sequence((r, i), token_ids=p) == 0, (r, i)


def test_prefill_step_times_both_paths_of_the_runner_and_restores_it(monkeypatch):
    """``prefill_step`` (CPU, tiny model, stand-in graphs): the step it builds replays
    piecewise, both paths give the same tokens, and the runner keeps its graphs after."""
    pytest.importorskip("transformers")
    import torch

    from paged_bench.engine import PREFILL_STEPS, build_model, prefill_step
    from paged_ref.engine import Engine
    from paged_ref.engine.runner import ModelRunner
    from paged_ref.models.piecewise import PiecewiseGraphs
    from tests.engine.test_runner import FakeGraph

    monkeypatch.setattr(ModelRunner, "_capture_one", staticmethod(
        lambda step, pool: FakeGraph(step)))
    engine = Engine(build_model("tiny", dtype=torch.float32, device="cpu"), num_blocks=64,
                    block_size=16, max_num_seqs=64)
    runner = engine.runner
    runner.piecewise = graphs = PiecewiseGraphs(runner, 128, 64, runner._capture_one)
    row = prefill_step(engine, (64,), 63)
    assert (row["tokens"], row["requests"]) == (127, 64)
    assert row["replayed"] and row["same_tokens"]
    assert row["eager"]["wall_ms"] > 0 and row["piecewise"]["busy_ms"] == 0  # (no GPU)
    assert runner.piecewise is graphs
    assert not prefill_step(engine, (200,), 0)["replayed"]  # (past the largest bucket)
    assert [name for name, _, _ in PREFILL_STEPS][-2:] == ["mixed_64_63", "mixed_16_15"]
