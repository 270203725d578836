"""The engine on a tiny random Llama (fast, CPU): greedy tokens against transformers, and the
CUDA-graph decode path's bookkeeping (static buffers, buckets, padding rows) with a stand-in
for the graph that replays by calling the captured step again."""

from __future__ import annotations

import pytest
import torch

from paged_ref import _device

pytest.importorskip("transformers")

from paged_bench.engine import workload  # noqa: E402
from paged_ref.engine import Engine  # noqa: E402
from paged_ref.engine.runner import ModelRunner, graph_buckets  # noqa: E402


class FakeGraph:
    """Replays by running the captured step again (what a CUDA graph does, minus the GPU)."""

    def __init__(self, step):
        self.step = step

    def replay(self):
        with torch.inference_mode():
            self.step()

    def pool(self):
        return None


from tests.engine.checks import hf_greedy  # noqa: E402


@pytest.fixture(scope="module")
def case(tiny):
    prompts, outputs = workload(8, tiny.config.vocab_size, seed=3, prompt_mean=20,
                                output_mean=10, max_len=40)
    return prompts, outputs, [hf_greedy(tiny, p, n) for p, n in zip(prompts, outputs, strict=True)]


@pytest.mark.parametrize("config", [
    dict(num_blocks=64, block_size=16),
    dict(num_blocks=12, block_size=4, max_num_batched_tokens=24),
    dict(num_blocks=12, block_size=4, max_num_batched_tokens=24, preemption_mode="swap"),
    dict(num_blocks=40, block_size=1, max_num_seqs=5, enable_prefix_caching=False),
])
def test_greedy_tokens_equal_transformers(tiny, case, config):
    prompts, outputs, expected = case
    engine = Engine(tiny, **config)
    assert engine.generate(prompts, outputs, ignore_eos=True) == expected


@pytest.mark.parametrize("max_num_seqs", [5, 16])
def test_graph_path_bookkeeping(tiny, case, monkeypatch, max_num_seqs):
    prompts, outputs, expected = case
    monkeypatch.setattr(ModelRunner, "_capture_one", staticmethod(lambda step, pool:
                                                                  FakeGraph(step)))
    engine = Engine(tiny, num_blocks=48, block_size=4, max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=40)  # (cuda_graphs=True needs a GPU: captured here)
    engine.runner._capture(graph_buckets(max_num_seqs))
    assert sorted(engine.runner.graphs) == graph_buckets(max_num_seqs)
    replays = []
    real = engine.runner._replay
    monkeypatch.setattr(engine.runner, "_replay", lambda step: replays.append(
        len(step.seq_lens)) or real(step))
    assert engine.generate(prompts, outputs, ignore_eos=True) == expected
    assert replays and any(b not in engine.runner.graphs for b in replays), "padded buckets"


def test_graph_path_samples_from_the_graphs_hidden_states(tiny, case, monkeypatch):
    """Sampling rows beside greedy ones in graph-replayed decode steps: seeded requests give
    the tokens they give without graphs (the sampler reads the graph's hidden states)."""
    from paged_ref.engine import SamplingParams

    prompts, outputs, expected = case
    params = [SamplingParams(max_tokens=n, ignore_eos=True, **({} if i % 2 else dict(
        temperature=0.3, top_k=20, seed=i))) for i, n in enumerate(outputs)]
    runs, mixed = [], []
    for graphs in (False, True):
        monkeypatch.setattr(ModelRunner, "_capture_one", staticmethod(
            lambda step, pool: FakeGraph(step)))
        engine = Engine(tiny, num_blocks=48, block_size=4, max_num_seqs=8,
                        max_num_batched_tokens=3)  # (decode steps with a 1-token prefill)
        if graphs:
            engine.runner._capture(graph_buckets(8))
            runner, real = engine.runner, engine.runner.execute

            def execute(step, sampling=None, runner=runner, real=real):
                mixed.append(runner._graphed(step) and sampling is not None
                             and len(step.sample_rows) < len(step.seq_lens))
                return real(step, sampling)

            monkeypatch.setattr(runner, "execute", execute)
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        final = {}
        while engine.has_unfinished_requests():
            final.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
        runs.append([final[i] for i in ids])
    assert runs[0] == runs[1] and any(mixed), "no replayed step with a row that samples not"
    assert runs[0][1::2] == expected[1::2] and runs[0][0::2] != expected[0::2]


def test_graph_buckets():
    assert graph_buckets(256)[:6] == [1, 2, 4, 8, 16, 32] and graph_buckets(256)[-1] == 256
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(1) == [1]


def test_step_recorder_draws_the_block_tables(tiny, case):
    from paged_course.engine_view import StepRecorder, describe

    prompts, outputs, _ = case
    rec = StepRecorder()
    Engine(tiny, num_blocks=12, block_size=4, max_num_batched_tokens=24).generate(
        prompts, outputs, ignore_eos=True, on_step=rec)
    rows = rec.table()
    assert len(rows) == len(rec.events) and rows[0]["admitted"]
    assert any(e.preempted for e in rec.events) and "preempted" in describe(
        next(e for e in rec.events if e.preempted))
    fig = rec.figure(1)
    gids = {a.get_gid() for ax in fig.axes for a in ax.patches if a.get_gid()}
    assert any(g.startswith("pool:") for g in gids) and any(g.startswith("logical:") for g in gids)


def test_step_widget_without_ipywidgets_shows_the_last_step(tiny, case, monkeypatch, capsys):
    """Plain Python (the GPU machine's notebook runner) has no ipywidgets: the widget call
    says so and returns the last step's picture; with nothing recorded, a clear error."""
    import sys

    from paged_course.engine_view import StepRecorder

    with pytest.raises(ValueError, match="no steps recorded"):
        StepRecorder().widget()
    prompts, outputs, _ = case
    rec = StepRecorder()
    Engine(tiny, num_blocks=12, block_size=4).generate(prompts, outputs, ignore_eos=True,
                                                       on_step=rec)
    monkeypatch.setitem(sys.modules, "ipywidgets", None)  # import ipywidgets -> ImportError
    fig = rec.widget()
    assert "ipywidgets is not installed" in capsys.readouterr().out
    last = rec.figure(len(rec.events) - 1)._suptitle.get_text()
    assert fig._suptitle.get_text() == last and last.startswith(f"step {rec.events[-1].step}:")


ON_CPU_TRITON = pytest.mark.skipif(not _device.INTERPRET, reason="Triton on the CPU model: "
                                   "the interpreter (compiled: test_engine_gpu.py)")


@ON_CPU_TRITON
def test_fused_triton_ops_give_transformers_tokens(tiny, case):
    """The fused Triton kernels (interpreted here) inside the whole engine, prefill and
    decode steps: tokens equal transformers'."""
    prompts, outputs, expected = case
    engine = Engine(tiny, num_blocks=64, block_size=4, fused_backend="triton")
    assert engine.runner.fused_backend == "triton"
    pick = [3, 4, 6]  # short ones: the interpreter runs each program alone
    got = engine.generate([prompts[i] for i in pick], [outputs[i] for i in pick],
                          ignore_eos=True)
    assert got == [expected[i] for i in pick]


def test_projection_biases_and_norm_weights_are_used():
    """A Llama config with ``attention_bias`` and ``mlp_bias``: the fused projections add them;
    and norm weights that are not all ones: each add + norm uses the right one."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=2, head_dim=8, vocab_size=128,
                      attention_bias=True, mlp_bias=True, tie_word_embeddings=False,
                      initializer_range=0.3)  # (0.02: attention would hardly move a token)
    torch.manual_seed(2)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:  # (initialised to 0 and 1: a
                p.normal_(mean=float("norm" in name), std=0.5)  # dropped one goes unseen)
    prompts, outputs = workload(3, cfg.vocab_size, seed=4, prompt_mean=12, output_mean=6,
                                max_len=30)
    expected = [hf_greedy(model, p, n) for p, n in zip(prompts, outputs, strict=True)]
    for backend in ("torch", "triton") if _device.INTERPRET else ("torch",):
        engine = Engine(model, num_blocks=32, block_size=4, fused_backend=backend)
        assert engine.generate(prompts, outputs, ignore_eos=True) == expected, backend


def test_runner_uses_fused_ops_and_leaves_the_model_alone(tiny, case, monkeypatch):
    """No call to transformers' norm, q/k/v or MLP modules (the fused ops replace them);
    the model's weights unchanged."""
    prompts, outputs, expected = case
    before = {k: v.clone() for k, v in tiny.state_dict().items()}

    def forbidden(*args, **kwargs):
        raise AssertionError("the runner called a transformers module it fuses")

    layer = tiny.model.layers[0]
    for module in (layer.input_layernorm, layer.post_attention_layernorm, tiny.model.norm,
                   layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                   layer.mlp, layer.mlp.gate_proj, layer.mlp.up_proj):
        monkeypatch.setattr(module, "forward", forbidden)
    engine = Engine(tiny, num_blocks=64, block_size=16)
    assert engine.generate(prompts[:2], outputs[:2], ignore_eos=True) == expected[:2]
    monkeypatch.undo()
    after = tiny.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_bad_fused_backend_is_a_value_error(tiny):
    with pytest.raises(ValueError, match="fused_backend"):
        Engine(tiny, num_blocks=8, fused_backend="fast")


def test_format_sweep_buys_blocks_by_bytes(tiny, tmp_path, monkeypatch):
    """The same KV memory in each format: blocks in proportion to the bytes a token takes
    (scales included), the whole workload served in each, more room holding more requests. A
    planted sweep that sizes every pool by the plain cache's bytes is caught."""
    from paged_bench import engine as bench_engine
    from paged_ref.cache_math import kv_bytes_per_token
    from paged_ref.quant import KVFormat
    from tests.mutations.mutate import mutant_of

    cfg = tiny.config
    shape = dict(num_layers=cfg.num_hidden_layers, num_kv_heads=cfg.num_key_value_heads,
                 head_dim=cfg.head_dim)
    rows = bench_engine.format_sweep(tiny, 0.25, ["plain", "fp8", "fp8_token_head"], n=24,
                                     seed=0, max_len=128, max_new=40)
    assert [r["kv_format"] for r in rows] == ["float32", "fp8", "fp8_token_head"]
    for r, fmt in zip(rows, (torch.float32, KVFormat.parse("fp8"),
                             KVFormat.parse("fp8_token_head")), strict=True):
        assert r["bytes_per_token"] == kv_bytes_per_token(**shape, dtype=fmt)
        assert r["num_blocks"] == int(0.25 * 2**20 // (r["bytes_per_token"] * 16))
        assert r["tokens_of_room"] == 16 * r["num_blocks"]
    assert {r["output_tokens"] for r in rows} == {24 * 40}  # every pool served every request
    assert rows[1]["num_blocks"] == 4 * rows[0]["num_blocks"]  # 1 byte a value against 4
    assert rows[1]["max_requests_held"] > rows[0]["max_requests_held"]
    assert rows[0]["preemptions"] > rows[1]["preemptions"]
    same_bytes = [("dtype=fmt or model.dtype", "dtype=model.dtype")]
    mutant = mutant_of(bench_engine, same_bytes, tmp_path, monkeypatch)
    planted = mutant.format_sweep(tiny, 0.25, ["plain", "fp8"], n=24, seed=0, max_len=128,
                                  max_new=40)
    assert planted[1]["num_blocks"] != rows[1]["num_blocks"]
