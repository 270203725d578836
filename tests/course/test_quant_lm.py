"""``paged_course.quant_lm``: what a quantised cache costs a real model (the committed
SmolLM2 table), and the measures behind it checked on a tiny random Llama."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from paged_course import ROOT

pytest.importorskip("transformers")

from paged_bench.engine import build_model, workload  # noqa: E402
from paged_course import quant_lm  # noqa: E402
from tests.mutations.mutate import mutant_of  # noqa: E402


def test_first_difference():
    assert quant_lm.first_difference([1, 2, 3], [1, 2, 3]) == 3
    assert quant_lm.first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert quant_lm.first_difference([4], [1]) == 0


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama, its weights scaled up so that its greedy tokens vary (at the
    default scale it repeats one token, and a position read one off would go unnoticed)."""
    model = build_model("tiny", dtype=torch.float32, device="cpu", seed=3)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)
    return model


@pytest.fixture(scope="module")
def generations(tiny):
    prompts, _ = workload(4, tiny.config.vocab_size, seed=2, prompt_mean=12, output_mean=4,
                          max_len=20)
    baseline = quant_lm.generate(tiny, prompts, 10)
    assert all(len(set(g)) > 3 for g in baseline)
    return prompts, baseline


def test_baseline_agrees_with_itself_step_by_step(tiny, generations):
    """Scoring the baseline's own generations (chunked prefill) predicts every generated token
    (decode steps): the teacher-forced measure reads the positions it should."""
    prompts, baseline = generations
    got = quant_lm.generation_agreement(tiny, prompts, baseline, baseline)
    assert got == {"generated_tokens": 40, "step_agreement": 1.0,
                   "mean_tokens_before_first_difference": 10.0, "same_prefix_share": 1.0}
    changed = [g[:] for g in baseline]
    changed[0][3] = (changed[0][3] + 1) % tiny.config.vocab_size  # free-running: parts at 3
    got = quant_lm.generation_agreement(tiny, prompts, baseline, changed)
    assert got["mean_tokens_before_first_difference"] == (3 + 30) / 4
    assert got["same_prefix_share"] == 33 / 40


def test_planted_off_by_one_is_caught(tiny, generations, tmp_path, monkeypatch):
    """Comparing each prediction with the token after the one it predicts."""
    shifted = [("preds[len(prompt) - 1 :]", "preds.roll(1)[len(prompt) - 1 :]")]
    mutant = mutant_of(quant_lm, shifted, tmp_path, monkeypatch)
    prompts, baseline = generations
    assert mutant.generation_agreement(tiny, prompts, baseline, baseline)["step_agreement"] < 1


def test_committed_smollm2_table():
    """The issue's bar on the committed run: >= 2,000 generated tokens and a passage of >= 2,000
    tokens per format; FP8 perplexity within 1 % of the float32 cache's; the baseline agrees
    with itself."""
    data = json.loads((ROOT / "results" / "cpu" / "quant_smollm2.json").read_text())
    rows = {r["kv_format"]: r for r in data["results"]}
    base = rows["float32"]
    assert base["step_agreement"] == 1.0 and base["same_prefix_share"] == 1.0
    for fmt, row in rows.items():
        assert row["generated_tokens"] >= 2000 and row["passage_tokens"] >= 2000, fmt
        assert 0 < row["step_agreement"] <= 1 and row["perplexity"] > 0, fmt
    for fmt in ("fp8", "fp8_token_head"):
        assert rows[fmt]["perplexity"] <= 1.01 * base["perplexity"], fmt
    assert rows["int4"]["perplexity"] > rows["fp8"]["perplexity"]  # INT4's cost, stated


def test_bf16_h200_runs_and_the_lesson_reading_of_them(tmp_path, monkeypatch):
    """Lesson 10's bf16 table: each H200 run's perplexities relative to its own bf16 cache, the
    CPU noise band, and the claims its text makes of them (a planted mix-up of the two runs'
    baselines is caught)."""
    from paged_course import quant_study

    h200 = ROOT / "results" / "h200"
    runs = {name: {r["kv_format"]: r for r in json.loads(
        (h200 / f"quant_smollm2_bf16_{name}.json").read_text())["results"]}
        for name in ("auto", "torch")}
    kernels = json.loads((h200 / "quant_smollm2_bf16_auto.json").read_text())
    assert kernels["gpu"] == "NVIDIA H200" and "bfloat16 weights, cuda" in kernels["what"]
    assert all(kernels["decode_kernels"][f] == "cuda" for f in ("fp8", "int4", "fp8_token_head"))
    rows = {r["kv_format"]: r for r in quant_study.bf16_perplexity_rows()}
    for fmt, row in rows.items():
        for name, key in (("auto", "kernels_pct"), ("torch", "torch_pct")):
            want = 100 * (runs[name][fmt]["perplexity"] / runs[name]["bfloat16"]["perplexity"] - 1)
            assert row[key] == pytest.approx(want), (fmt, key)
        assert runs["auto"][fmt]["generated_tokens"] >= 2000
    fp8, th = rows["fp8"], rows["fp8_token_head"]
    assert all(0.2 < r[k] < 2.3 for r in (fp8, th) for k in ("kernels_pct", "torch_pct"))
    assert (fp8["kernels_pct"] < th["kernels_pct"]) != (fp8["torch_pct"] < th["torch_pct"])
    assert [round(x, 1) for x in fp8["noise_band"]] == [-0.7, 1.7]
    assert round(100 * rows["bfloat16"]["step_agreement"], 2) == 99.76
    probe = json.loads((h200 / "quant_lm_layer_error.json").read_text())["results"]
    for key, (lo, hi) in (("triton_rel", (1.65e-3, 1.94e-3)), ("torch_rel", (1.65e-3, 1.86e-3))):
        values = [r[key] for r in probe]
        assert round(min(values), 5) == lo and round(max(values), 5) == hi, key
    mixed = [('runs["torch"]["bfloat16"]["perplexity"]', 'runs["auto"]["bfloat16"]["perplexity"]')]
    mutant = mutant_of(quant_study, mixed, tmp_path, monkeypatch)
    assert mutant.bf16_perplexity_rows(ROOT)[1]["torch_pct"] != pytest.approx(fp8["torch_pct"])


def test_scoring_through_the_triton_kernel_and_under_noise(tiny, generations, kernel_device):
    """``backend="triton"`` scores through the prefill kernel (the interpreter on a CPU,
    compiled on a GPU: the model on the kernels' device) with the torch backend's
    log-probabilities; ``noise`` perturbs them reproducibly, per seed."""
    prompts, baseline = generations
    ids = prompts[0] + baseline[0]
    model = copy.deepcopy(tiny).to(kernel_device)
    for fmt in (None, "fp8", "fp8_token_head"):  # (INT4 kernels need head_dim >= 32; tiny's 16)
        ref, ref_pred = quant_lm.score_tokens(model, ids, kv_format=fmt, chunk=8)
        got, got_pred = quant_lm.score_tokens(model, ids, kv_format=fmt, chunk=8,
                                              backend="triton")
        torch.testing.assert_close(got, ref, atol=2e-4, rtol=0)
        assert torch.equal(got_pred, ref_pred), fmt
    plain, _ = quant_lm.score_tokens(tiny, ids, chunk=8)
    noisy = [quant_lm.score_tokens(tiny, ids, chunk=8, noise=1e-3, seed=s)[0] for s in (0, 0, 1)]
    assert torch.equal(noisy[0], noisy[1]) and not torch.equal(noisy[0], noisy[2])
    assert not torch.allclose(noisy[0], plain, atol=1e-5)
    torch.testing.assert_close(noisy[0], plain, atol=0.05, rtol=0)  # 0.1 % noise: small moves


def test_same_memory_in_the_engine_and_the_lesson_reading_of_it():
    """Lesson 10's measured "tokens that fit": room and requests held follow the bytes, tokens
    per second do not, and the decode step's extra kernels are the quantising write's (the
    numbers its text gives: 11 more kernels a layer for FP8, 43 for INT4)."""
    from paged_course import quant_study

    rows = {r["kv_format"]: r for r in quant_study.engine_format_rows()}
    plain, fp8, int4 = rows["bfloat16"], rows["fp8"], rows["int4"]
    assert fp8["tokens_of_room"] == 2 * plain["tokens_of_room"]
    assert int4["tokens_of_room"] > 3 * plain["tokens_of_room"]
    assert plain["max_requests_held"] < fp8["max_requests_held"] < int4["max_requests_held"] == 256
    assert plain["steps"] > fp8["steps"] > int4["steps"]
    assert int4["output_tok_s"] < plain["output_tok_s"] < fp8["output_tok_s"] < 1.2 * plain[
        "output_tok_s"]
    assert round(fp8["kernels_per_layer"] - plain["kernels_per_layer"]) == 11
    assert round(int4["kernels_per_layer"] - plain["kernels_per_layer"]) == 43
    assert plain["decode_graph_ms"] < fp8["decode_graph_ms"] < int4["decode_graph_ms"]
