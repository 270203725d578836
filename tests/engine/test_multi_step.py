"""Multi-step decoding (``Engine(num_scheduler_steps=K)``, vLLM's option): a step where every
request decodes greedily runs up to ``K`` decode passes, each request's input the token its pass
before picked, its blocks taken ahead (``KVCacheManager.lookahead``), the tokens read back once.

Checked on a tiny random Llama whose greedy tokens vary (``varied``: the ``tiny`` fixture's
shape, weights 15x larger; ``tiny``'s repeat one token, which hides a token recorded one place
off) on the CPU, the graph path with a stand-in graph: the tokens equal
transformers' (one pass a step), also across a stop in the middle of a step's passes, online
requests joining mid-run and a sampling request (one pass while it runs); between steps every
block a table lists is held, no request is ahead of its K/V, no lookahead block is left over;
every prefix-cache entry holds its tokens' K/V (generated blocks are cached too). Then the likely
mistakes are planted back and must be caught."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from paged_bench.engine import workload  # noqa: E402
from paged_ref.cache_math import blocks_needed  # noqa: E402
from paged_ref.engine import Engine, SamplingParams  # noqa: E402
from paged_ref.engine import engine as engine_module  # noqa: E402
from paged_ref.engine import runner as runner_module  # noqa: E402
from paged_ref.engine import scheduler as scheduler_module  # noqa: E402
from paged_ref.engine.runner import ModelRunner, graph_buckets  # noqa: E402
from paged_ref.memory import tables as tables_module  # noqa: E402
from tests.engine.checks import (  # noqa: E402
    assert_cached_kv_is_written,
    assert_idle_and_whole,
    assert_running_kv_is_theirs,
    assert_tables_hold_their_counts,
    hf_greedy,
)
from tests.engine.test_runner import FakeGraph  # noqa: E402
from tests.mutations.mutate import mutant_of  # noqa: E402

CONFIGS = {
    "roomy": dict(num_blocks=64, block_size=4),
    # (a pool that preempts, and where the lookahead is sometimes short: one pass then)
    "tight": dict(num_blocks=12, block_size=4, max_num_batched_tokens=16),
    "block 5, no prefix cache": dict(num_blocks=40, block_size=5, enable_prefix_caching=False),
    "reserve_oracle": dict(num_blocks=64, block_size=4, reservation="reserve_oracle"),
    "graphs": dict(num_blocks=48, block_size=4, max_num_seqs=8),
}


@pytest.fixture(scope="module")
def case(varied):
    prompts, outputs = workload(8, varied.config.vocab_size, seed=11, prompt_mean=9,
                                output_mean=9, max_len=40)
    prompts[5] = prompts[1][:8] + prompts[5]  # shares two blocks of 4 with prompt 1
    for i in range(0, 8, 2):  # (these end on a full block of 4: cached once they finish)
        outputs[i] += (1 - len(prompts[i]) - outputs[i]) % 4
    return prompts, outputs, [hf_greedy(varied, p, n) for p, n in zip(prompts, outputs,
                                                                   strict=True)]


def engine_of(model, monkeypatch, config, steps):
    """An engine with ``num_scheduler_steps=steps``; ``"graphs"``: decode steps replay
    stand-in graphs (the static buffers, buckets and padding rows of the GPU path)."""
    if config == "graphs":
        monkeypatch.setattr(ModelRunner, "_capture_one", staticmethod(
            lambda step, pool: FakeGraph(step)))
    engine = Engine(model, **CONFIGS[config], num_scheduler_steps=steps)
    if config == "graphs":
        engine.runner._capture(graph_buckets(8))
    return engine


def checked_between_steps(engine, model):
    """Before every schedule: the running requests' K/V are their own tokens', each block's
    count is the tables', and no table holds a block past its length (lookahead used up)."""
    real, m = engine.scheduler.schedule, engine.scheduler.manager

    def schedule(*args):
        assert_running_kv_is_theirs(engine, model)
        assert_tables_hold_their_counts(m)
        for r in engine.scheduler.running:
            assert m.seq_len(r.req_id) == r.num_computed, f"{r.req_id} ahead of its K/V"
            assert len(m.block_table(r.req_id)) == blocks_needed(r.num_computed,
                                                                 engine.block_size)
        return real(*args)
    engine.scheduler.schedule = schedule


@pytest.mark.parametrize("steps", [2, 5])
@pytest.mark.parametrize("config", CONFIGS)
def test_multi_step_gives_transformers_tokens(varied, case, monkeypatch, config, steps):
    prompts, outputs, expected = case
    engine, passes = engine_of(varied, monkeypatch, config, steps), []
    checked_between_steps(engine, varied)
    got = engine.generate(prompts, outputs, ignore_eos=True,
                          on_step=lambda e: passes.append(e.passes))
    assert got == expected
    assert max(passes) == steps, "no step ran several passes"
    assert engine.stats.output_tokens == sum(outputs)
    assert_idle_and_whole(engine)
    if engine.scheduler.manager.enable_prefix_caching:
        assert assert_cached_kv_is_written(engine, varied) > 0


def test_fewer_steps_and_the_same_stats(varied, case):
    prompts, outputs, _ = case
    runs = {}
    for steps in (1, 4):
        engine = Engine(varied, **CONFIGS["roomy"], num_scheduler_steps=steps)
        engine.generate(prompts, outputs, ignore_eos=True)
        runs[steps] = engine.stats
    assert runs[4].steps < runs[1].steps / 2
    for field in ("output_tokens", "computed_tokens", "cached_tokens"):
        assert getattr(runs[4], field) == getattr(runs[1], field), field
    assert [len(m.token_times) for m in runs[4].metrics] == outputs


def test_a_stop_in_the_middle_of_the_passes(varied, case):
    """Each request stops at a token it emits half-way through a step's passes: the tokens
    after it (computed, their K/V written into lookahead blocks) are dropped and freed."""
    prompts, outputs, expected = case
    stops = [SamplingParams(max_tokens=n, stop_token_ids=[want[len(want) // 2]],
                           ignore_eos=True)
             for n, want in zip(outputs, expected, strict=True)]
    cut = [want[:want.index(want[len(want) // 2]) + 1] for want in expected]
    engine = Engine(varied, **CONFIGS["roomy"], num_scheduler_steps=6)
    assert engine.generate(prompts, params=stops) == cut
    assert any(len(c) < n for c, n in zip(cut, outputs, strict=True))
    assert_idle_and_whole(engine)
    assert assert_cached_kv_is_written(engine, varied) > 0


def test_online_requests_join_between_multi_steps(varied, case):
    """Requests added while others run get their tokens alone; a step's output carries each
    request's tokens of all its passes, and what the steps delivered is what it finished with."""
    prompts, outputs, expected = case
    engine = Engine(varied, **CONFIGS["tight"], num_scheduler_steps=4)
    ids, delivered, final, several = {}, {}, {}, False
    for i, (p, n) in enumerate(zip(prompts, outputs, strict=True)):
        ids[engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True))] = i
        for _ in range(2):  # (two steps between arrivals)
            for o in engine.step():
                several |= len(o.new_token_ids) > 1
                delivered.setdefault(o.request_id, []).extend(o.new_token_ids)
                if o.finished:
                    final[o.request_id] = o.output_token_ids
    while engine.has_unfinished_requests():
        for o in engine.step():
            delivered.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                final[o.request_id] = o.output_token_ids
    assert several
    assert {rid: final[rid] for rid in ids} == {rid: expected[i] for rid, i in ids.items()}
    assert delivered == final
    assert_idle_and_whole(engine)


def test_a_sampling_request_runs_one_pass_a_step(varied, case):
    """While a sampling request runs, steps run one pass (sampling is outside the graphs);
    every request's tokens are those of an engine without multi-step decoding."""
    prompts, outputs, _ = case
    params = [SamplingParams(max_tokens=n, ignore_eos=True) if i != 2 else
              SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.8, seed=7)
              for i, n in enumerate(outputs)]
    runs, passes = {}, []
    for steps in (1, 4):
        engine = Engine(varied, **CONFIGS["roomy"], num_scheduler_steps=steps)
        passes.clear()
        runs[steps] = engine.generate(prompts, params=params,
                                      on_step=lambda e: passes.append((e.passes, e.ran)))
    assert runs[4] == runs[1]
    sampling_runs = [p for p, ran in passes if any(r == 2 for r, _, _ in ran)]
    assert set(sampling_runs) == {1}
    assert max(p for p, _ in passes) == 4


def test_a_fault_in_a_multi_step_loses_nothing(varied, case, monkeypatch):
    """The decode kernel raises in the second pass of the first multi-step (every prompt is
    prefilled in the first step; two layers a pass): the step's requests are
    aborted (blocks, lookahead ones too, freed; no hash over unwritten K/V); the next call
    gives transformers' tokens."""
    prompts, outputs, expected = case
    engine = Engine(varied, **CONFIGS["roomy"], num_scheduler_steps=4)
    real, calls = runner_module.paged_attention, [0]

    def raising(*args, **kwargs):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("planted fault")
        return real(*args, **kwargs)

    with monkeypatch.context() as mp:
        mp.setattr(runner_module, "paged_attention", raising)
        with pytest.raises(RuntimeError, match="planted"):
            engine.generate(prompts, outputs, ignore_eos=True)
    assert calls[0] == 3
    assert_idle_and_whole(engine)
    assert_cached_kv_is_written(engine, varied)
    assert engine.generate(prompts, outputs, ignore_eos=True) == expected


def test_bad_num_scheduler_steps_is_refused(varied):
    for bad, exc in ((0, ValueError), (2.0, TypeError), (True, TypeError)):
        with pytest.raises(exc, match="num_scheduler_steps"):
            Engine(varied, num_blocks=8, num_scheduler_steps=bad)


# ---- the likely mistakes, planted back ------------------------------------------------------

PLANTED = {
    "the pass inputs skip the token before (extend records the wrong ids)": (
        scheduler_module, [("tokens[:-1])  # (the inputs", "tokens[1:])  # (the inputs")]),
    "a request past its own passes writes its last slot again (no scratch slot)": (
        tables_module, [("np.where(passes < steps_b, slots + pos % block_size, scratch_slot)",
                         "slots + pos % block_size")]),
    "the tokens after a stop are kept": (
        scheduler_module, [("del tokens[stop + 1:]", "pass")]),
    "the lookahead does not take the blocks": (
        scheduler_module, [("self.manager.lookahead([r.req_id for r in reqs], [n - 1 for n in "
                            "steps])", "pass")]),
    "later passes read the first pass's input ids": (
        runner_module, [("            self.g_input_ids[:bucket].copy_(self.g_tokens[:bucket])",
                         "            pass"),
                        ("                tokens.append(ids)",
                         "                tokens.append(ids)\n"
                         "                ids = torch.tensor(step.input_ids)")]),
}


@pytest.mark.parametrize("name", PLANTED)
def test_planted_mistake_is_caught(varied, case, monkeypatch, tmp_path, name):
    module, edits = PLANTED[name]
    mutant = mutant_of(module, edits, tmp_path, monkeypatch)
    if module is scheduler_module:
        monkeypatch.setattr(engine_module, "Scheduler", mutant.Scheduler)
    elif module is tables_module:
        monkeypatch.setattr(runner_module, "pass_inputs", mutant.pass_inputs)
    else:
        monkeypatch.setattr(engine_module, "ModelRunner", mutant.ModelRunner)
    prompts, outputs, expected = case
    caught = []
    for config in ("roomy", "graphs"):
        if config == "graphs":
            monkeypatch.setattr(mutant.ModelRunner if module is runner_module else ModelRunner,
                                "_capture_one", staticmethod(lambda step, pool: FakeGraph(step)))
        engine = Engine(varied, **CONFIGS[config], num_scheduler_steps=6)
        if config == "graphs":
            engine.runner._capture(graph_buckets(8))
        stops = [SamplingParams(max_tokens=n, stop_token_ids=[want[len(want) // 2]],
                           ignore_eos=True)
                 for n, want in zip(outputs, expected, strict=True)]
        try:
            got = engine.generate(prompts, params=stops)
            cut = [want[:want.index(want[len(want) // 2]) + 1] for want in expected]
            assert got == cut, "other tokens"
            assert_idle_and_whole(engine)
            assert_cached_kv_is_written(engine, varied)
            assert engine.generate(prompts, outputs, ignore_eos=True) == expected, "no stops"
            assert_cached_kv_is_written(engine, varied)
        except (AssertionError, ValueError, IndexError, RuntimeError) as e:
            caught.append(f"{config}: {e}")
    assert caught, f"planted mistake not caught: {name}"
