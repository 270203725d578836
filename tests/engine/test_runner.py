"""The engine on a tiny random Llama (fast, CPU): greedy tokens against transformers, and the
CUDA-graph decode path's bookkeeping (static buffers, buckets, padding rows) with a stand-in
for the graph that replays by calling the captured step again."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from paged_ref.course.bench_engine import build_model, workload  # noqa: E402
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


@pytest.fixture(scope="module")
def tiny():
    return build_model("tiny", dtype=torch.float32, device="cpu", seed=1)


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def case(tiny):
    prompts, outputs = workload(12, tiny.config.vocab_size, seed=3, prompt_mean=20,
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
                    max_num_batched_tokens=40, cuda_graphs=True)
    assert sorted(engine.runner.graphs) == graph_buckets(max_num_seqs)
    replays = []
    real = engine.runner._replay
    monkeypatch.setattr(engine.runner, "_replay", lambda step: replays.append(
        len(step.seq_lens)) or real(step))
    assert engine.generate(prompts, outputs, ignore_eos=True) == expected
    assert replays and any(b not in engine.runner.graphs for b in replays), "padded buckets"


def test_graph_buckets():
    assert graph_buckets(256)[:6] == [1, 2, 4, 8, 16, 32] and graph_buckets(256)[-1] == 256
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(1) == [1]
