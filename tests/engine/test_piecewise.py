"""Piecewise CUDA graphs for prefill and mixed steps (``paged_ref/models/piecewise.py``),
checked on the CPU with a stand-in graph that replays by running the captured piece again: the
static buffers, token buckets, padding rows and sampled rows of the GPU path. A step run
piecewise gives the eager step's tokens, hidden states and cache writes (exactly: the same ops
on the same rows, padding aside), also a small step after a large one (stale buffers); an
engine whose prefill and mixed steps replay piecewise gives transformers' greedy tokens, with
every running request's K/V its own between steps. Then the likely mistakes are planted back
(``test_planted_mistake_is_caught``) and must be caught. On the GPU,
``tests/engine/test_warmup_gpu.py`` runs the real graphs."""

from __future__ import annotations

import importlib

import pytest
import torch

pytest.importorskip("transformers")

from paged_bench.engine import workload  # noqa: E402
from paged_ref.engine import Engine  # noqa: E402
from paged_ref.engine import runner as runner_module  # noqa: E402
from paged_ref.engine.runner import ModelRunner, StepInputs, graph_buckets  # noqa: E402
from paged_ref.models.piecewise import token_buckets  # noqa: E402
from tests.engine.checks import assert_running_kv_is_theirs, hf_greedy  # noqa: E402
from tests.engine.test_runner import FakeGraph  # noqa: E402
from tests.mutations.mutate import Mutation, mutant_of  # noqa: E402

BLOCK = 4


def stand_in_graphs(monkeypatch):
    monkeypatch.setattr(ModelRunner, "_capture_one", staticmethod(
        lambda step, pool: FakeGraph(step)))


def test_token_buckets():
    assert token_buckets(2048)[:6] == [16, 32, 64, 128, 256, 384]
    assert token_buckets(2048)[-3:] == [1536, 1792, 2048]
    assert token_buckets(40) == [16, 32, 40] and token_buckets(5) == [5]
    buckets = token_buckets(3000)
    assert buckets == sorted(set(buckets)) and buckets[-1] == 3000


def step_of(prefills: list[int], decodes: list[int], first_block: int) -> StepInputs:
    """A step: new prompts of ``prefills`` tokens, then decodes at cached lengths ``decodes``,
    each on blocks of its own from ``first_block`` on (ids 5, 6, ...; every row sampled)."""
    step = StepInputs([], [], [], [0], [], [], [])
    block = first_block
    for n, start in [(n, 0) for n in prefills] + [(1, d - 1) for d in decodes]:
        end = start + n
        table = list(range(block, block + -(-end // BLOCK)))
        block += len(table)
        step.input_ids += [5 + (7 * t) % 200 for t in range(start, end)]
        step.positions += list(range(start, end))
        step.slot_mapping += [table[t // BLOCK] * BLOCK + t % BLOCK for t in range(start, end)]
        step.query_start_loc.append(len(step.input_ids))
        step.seq_lens.append(end)
        step.block_tables.append(table)
    step.sample_rows = list(range(len(step.seq_lens)))
    return step


def test_a_piecewise_step_equals_the_eager_step(varied, monkeypatch):
    check_steps_equal_eager(varied, monkeypatch)


@pytest.mark.gpu
def test_real_piecewise_graphs_equal_the_eager_step(varied, monkeypatch):
    """The same on a GPU, with CUDA graphs (float32; cuBLAS may pick other kernels for a
    padded token count: hidden states to 1e-4)."""
    import copy

    check_steps_equal_eager(copy.deepcopy(varied).cuda(), monkeypatch, tolerance=1e-4)


def check_steps_equal_eager(varied, monkeypatch, tolerance=1e-5):
    if not next(varied.parameters()).is_cuda:
        stand_in_graphs(monkeypatch)
    runner = Engine(varied, num_blocks=64, block_size=BLOCK, max_num_seqs=8,
                    max_num_batched_tokens=40, warmup=False).runner
    runner.piecewise = None  # (a GPU engine captured its own: the eager steps first)
    torch.manual_seed(0)
    for caches in (runner.cache.k_caches, runner.cache.v_caches):
        for c in caches:  # (garbage everywhere: the decodes attend their earlier tokens')
            c.copy_(torch.randn_like(c))
    before = [c.clone() for c in runner.cache.k_caches + runner.cache.v_caches]
    # a large step, then smaller ones (buffers stale past their tokens), one in bucket 40
    steps = [step_of([9, 14], [6, 11, 3], 0), step_of([5], [9, 2], 20), step_of([2, 30], [7], 30)]
    eager = []
    for step in steps:
        tokens, hidden = runner._run(step)
        eager.append((tokens.clone(), hidden.clone(),
                      [c.clone() for c in runner.cache.k_caches + runner.cache.v_caches]))
    for c, b in zip(runner.cache.k_caches + runner.cache.v_caches, before, strict=True):
        c.copy_(b)
    runner.piecewise = runner_module.PiecewiseGraphs(runner, 40, 8, runner._capture_one)
    assert sorted(runner.piecewise.graphs) == [16, 32, 40]
    runs = []
    real = runner.piecewise.run
    monkeypatch.setattr(runner.piecewise, "run", lambda step, bucket, attend: runs.append(
        (len(step.input_ids), bucket)) or real(step, bucket, attend))
    for step, (tokens, hidden, cache) in zip(steps, eager, strict=True):
        got_tokens, got_hidden = runner._run(step)
        assert got_tokens.tolist() == tokens.tolist()
        torch.testing.assert_close(got_hidden, hidden, rtol=tolerance, atol=tolerance)
        spare = slice(runner.scratch_slot // BLOCK, None)  # (the padding rows' block)
        for got, want in zip(runner.cache.k_caches + runner.cache.v_caches, cache, strict=True):
            torch.testing.assert_close(got[:spare.start], want[:spare.start], rtol=tolerance,
                                       atol=tolerance)
    assert runs == [(26, 32), (7, 16), (33, 40)], "each step padded to its bucket"


def test_steps_past_the_buckets_run_eagerly(varied, monkeypatch):
    stand_in_graphs(monkeypatch)
    runner = Engine(varied, num_blocks=64, block_size=BLOCK, max_num_seqs=3,
                    max_num_batched_tokens=40).runner
    runner.piecewise = runner_module.PiecewiseGraphs(runner, 16, 3, runner._capture_one)
    assert runner.piecewise.bucket_of(step_of([16], [], 0)) == 16
    assert runner.piecewise.bucket_of(step_of([17], [], 0)) is None  # more tokens
    assert runner.piecewise.bucket_of(step_of([3], [5, 5, 5], 0)) is None  # 4 sampled rows


@pytest.fixture(scope="module")
def case(varied):
    prompts, outputs = workload(8, varied.config.vocab_size, seed=5, prompt_mean=14,
                                output_mean=8, max_len=40)
    return prompts, outputs, [hf_greedy(varied, p, n) for p, n in zip(prompts, outputs,
                                                                   strict=True)]


def test_piecewise_engine_gives_transformers_tokens(varied, case, monkeypatch):
    check_engine_tokens(varied, case, monkeypatch)


def check_engine_tokens(varied, case, monkeypatch):
    """Prefill chunks, mixed steps and (whole-graph) decode steps; every running request's
    K/V its own tokens' before each schedule (a padding row written into a real slot shows)."""
    prompts, outputs, expected = case
    stand_in_graphs(monkeypatch)
    engine = Engine(varied, num_blocks=40, block_size=BLOCK, max_num_seqs=8,
                    max_num_batched_tokens=24)
    engine.runner._capture(graph_buckets(8))
    runner = engine.runner
    runner.piecewise = runner_module.PiecewiseGraphs(runner, 24, 8, runner._capture_one)
    runs, real = [], runner.piecewise.run
    monkeypatch.setattr(runner.piecewise, "run", lambda step, bucket, attend: runs.append(
        (len(step.input_ids), len(step.seq_lens))) or real(step, bucket, attend))
    schedule = engine.scheduler.schedule

    def checked(*args):
        assert_running_kv_is_theirs(engine, varied)
        return schedule(*args)
    engine.scheduler.schedule = checked
    assert engine.generate(prompts, outputs, ignore_eos=True) == expected
    assert any(n > b > 1 for n, b in runs), "no mixed or multi-request step ran piecewise"
    assert any(n not in token_buckets(24) for n, _ in runs), "no step was padded"


PLANTED = [
    Mutation("padding rows write their K/V to slot 0, not the scratch slot",
             "host[2] = self.runner.scratch_slot", "host[2] = 0", "piecewise"),
    Mutation("the attention output is not stored for the next piece",
             "self.attn[:tokens] = attend(layer, self.q[:tokens])",
             "attend(layer, self.q[:tokens])", "piecewise"),
    Mutation("each request samples from its first token, not its last",
             "step.query_start_loc[b + 1] - 1 for b", "step.query_start_loc[b] for b",
             "piecewise"),
    Mutation("the residual stream is not carried from piece to piece",
             "            self.h[:n] = h\n", "", "piecewise"),
    Mutation("rotary cos / sin are not kept for the later pieces",
             "self.cos[:n], self.sin[:n] = cos, sin", "pass", "piecewise"),
]


@pytest.mark.parametrize("mutation", PLANTED, ids=str)
def test_planted_mistake_is_caught(mutation, varied, case, tmp_path, monkeypatch):
    piecewise = importlib.import_module("paged_ref.models.piecewise")
    mutant = mutant_of(piecewise, mutation.edits(), tmp_path, monkeypatch)
    monkeypatch.setattr(runner_module, "PiecewiseGraphs", mutant.PiecewiseGraphs)
    caught = []
    for check, args in ((check_steps_equal_eager, (varied,)),
                        (check_engine_tokens, (varied, case))):
        with monkeypatch.context() as mp:
            try:
                check(*args, mp)
            except Exception as e:  # (a wrong answer, or a mutant that crashes)
                caught.append(f"{check.__name__}: {type(e).__name__}")
    assert caught, f"mutation survived: {mutation}"
