"""Parallel sampling through fork (``SamplingParams(n=k)``) on the tiny random Llama: the prompt
is computed once and the samples share its blocks, each sample draws from its own generator
(sample ``i`` of a seeded request gives what a request seeded with ``sample_seed(i)`` gives
alone), the shared last block is copied on write (K/V checked against transformers'), samples
are preempted and recomputed like any request, ``abort`` of the request frees every sample,
and the outputs carry the ``n`` completions."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from paged_ref.engine import CompletionOutput, Engine, RequestOutput, SamplingParams  # noqa: E402
from paged_ref.engine import request as request_module  # noqa: E402
from paged_ref.memory import manager as manager_module  # noqa: E402
from paged_ref.sampling import params as params_module  # noqa: E402
from tests.engine.checks import (  # noqa: E402
    assert_idle_and_whole,
    assert_running_kv_is_theirs,
    assert_tables_hold_their_counts,
    hf_greedy,
)
from tests.mutations.mutate import mutant_of  # noqa: E402


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(5)
    return [torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in (7, 10, 5)]


def hot(n=1, seed=None, max_tokens=8):
    return SamplingParams(max_tokens=max_tokens, temperature=1.5, seed=seed, n=n,
                          ignore_eos=True)


def alone(model, prompt, params, **config):
    """``prompt`` with ``params`` in an engine of its own: its final tokens (a list per sample)."""
    engine = Engine(model, **{"num_blocks": 32, "block_size": 4, **config})
    return engine.generate([prompt], params=params)[0]


def run(engine, requests, check=None):
    """Step ``engine`` through ``(prompt, params)`` requests; ``check(engine)`` after each step.
    Returns each request's final :class:`RequestOutput` and the outputs of every step."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    final, seen = {}, []
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.append(out)
            if out.finished:
                final[out.request_id] = out
        if check is not None:
            check(engine)
    return [final[i] for i in ids], seen


def assert_samples_are_their_seeds(model, prompt, sp, got):
    """Sample ``i`` of ``got`` (``prompt`` with ``sp``) is what a request seeded with
    ``sp.sample_seed(i)`` draws alone (sample 0: ``sp.seed``)."""
    assert len(got) == sp.n and all(len(s) == sp.max_tokens for s in got)
    for i in range(sp.n):
        seed = SamplingParams(seed=sp.seed).sample_seed(i)
        assert got[i] == alone(model, prompt, hot(seed=seed, max_tokens=sp.max_tokens)), i


def test_sample_i_draws_what_its_own_seed_draws_alone(tiny, prompts):
    sp = hot(n=4, seed=77)
    engine = Engine(tiny, num_blocks=40, block_size=4)
    got = engine.generate([prompts[0]], params=sp)[0]
    assert_samples_are_their_seeds(tiny, prompts[0], sp, got)
    assert len({tuple(s) for s in got}) == 4, "samples drew the same tokens"
    assert engine.generate([prompts[0]], params=sp)[0] == got, "a seeded request changed"
    assert_idle_and_whole(engine)


def test_samples_are_independent_of_how_many_there_are(tiny, prompts):
    """Sample 1 of n = 2 is sample 1 of n = 5: its generator is its own, not a shared one."""
    two, five = (alone(tiny, prompts[1], hot(n=n, seed=3)) for n in (2, 5))
    assert five[:2] == two


def test_the_prompt_is_computed_once_and_its_blocks_shared(tiny, prompts):
    """One prefill of the prompt (not n), n sequences on its blocks right after the fork, every
    write copy-on-write (each sample's K/V are its own tokens')."""
    engine = Engine(tiny, num_blocks=40, block_size=4, enable_prefix_caching=False)
    m, steps = engine.scheduler.manager, []

    def check(e):
        assert_tables_hold_their_counts(m)
        assert_running_kv_is_theirs(e, tiny)
        steps.append((sorted(m.seq_ids), m.num_blocks - m.num_free_blocks))

    [out], _ = run(engine, [(prompts[1], hot(n=3, seed=1))], check)
    assert steps[0] == ([0, 1, 2], 3), "10 tokens in blocks of 4: 3 blocks, shared by 3"
    assert steps[1] == ([0, 1, 2], 5), "the first two writers copy the partial block"
    assert len(out.outputs) == 3 and all(len(c.token_ids) == 8 for c in out.outputs)
    assert_idle_and_whole(engine)


def test_tokens_computed_count_the_prompt_once(tiny, prompts):
    engine = Engine(tiny, num_blocks=40, block_size=4, enable_prefix_caching=False)
    engine.generate([prompts[1]], params=hot(n=4, seed=2, max_tokens=5))
    # prompt 10 + 4 tokens each of 4 samples decoded (the 5th is sampled, never computed)
    assert engine.stats.computed_tokens == 10 + 4 * 4
    assert engine.stats.output_tokens == 4 * 5


@pytest.mark.parametrize("config", [
    dict(num_blocks=9, block_size=4, max_num_batched_tokens=12),
    dict(num_blocks=9, block_size=4, max_num_batched_tokens=12, enable_prefix_caching=False),
    dict(num_blocks=9, block_size=4, max_num_batched_tokens=12, preemption_mode="swap"),
], ids=["prefix-cache", "no-prefix-cache", "swap"])
def test_preempted_samples_are_recomputed_and_draw_the_same(tiny, prompts, config):
    """A pool too small for the samples of three requests: samples are preempted (their blocks
    freed), recomputed (prompt + their own tokens), and still draw what they draw alone."""
    requests = [(p, hot(n=3, seed=10 + j)) for j, p in enumerate(prompts)]
    engine = Engine(tiny, **config)
    finals, _ = run(engine, requests,
                    lambda e: assert_tables_hold_their_counts(e.scheduler.manager))
    assert engine.scheduler.num_preemptions > 0, "nothing was preempted: make the pool smaller"
    for (p, sp), out in zip(requests, finals, strict=True):
        assert [c.token_ids for c in out.outputs] == alone(tiny, p, sp)
    assert_idle_and_whole(engine)


def test_a_copy_on_write_needs_a_free_block_or_a_preemption(tiny):
    """Two blocks, a 5-token prompt, n = 2: the samples share both blocks; the first decode's
    copy-on-write of the partial block finds none free, so the other sample is preempted
    (not an OutOfBlocksError out of step), and both finish."""
    prompt = [9, 40, 41, 77, 200]
    engine = Engine(tiny, num_blocks=2, block_size=4, enable_prefix_caching=False)
    got = engine.generate([prompt], params=hot(n=2, seed=4, max_tokens=3))[0]
    assert engine.stats.preemptions >= 1
    assert got == alone(tiny, prompt, hot(n=2, seed=4, max_tokens=3))
    assert_idle_and_whole(engine)


def test_greedy_samples_are_the_greedy_tokens(tiny, prompts):
    expected = hf_greedy(tiny, prompts[2], 6)
    got = alone(tiny, prompts[2], SamplingParams(max_tokens=6, n=3, ignore_eos=True))
    assert got == [expected] * 3


def test_outputs_carry_every_sample(tiny, prompts):
    """One RequestOutput per request and step: ``outputs`` has the n completions; the fields
    before it are sample 0's; ``finished`` once every sample is; n = 1 keeps its shape."""
    stop = SamplingParams(max_tokens=6, temperature=1.5, seed=8, n=3, stop_token_ids=[5, 6, 7])
    requests = [(prompts[0], SamplingParams(max_tokens=4, ignore_eos=True)),
                (prompts[1], hot(n=3, seed=6, max_tokens=5)), (prompts[2], stop)]
    engine = Engine(tiny, num_blocks=48, block_size=4)
    finals, seen = run(engine, requests)
    for out in seen:
        assert isinstance(out, RequestOutput) and all(isinstance(c, CompletionOutput)
                                                      for c in out.outputs)
        assert out.output_token_ids == out.outputs[0].token_ids
        assert len(out.outputs) == (1 if out.request_id == 0 else 3)
        assert out.finished == all(c.finished for c in out.outputs)
    single, three, _ = finals
    assert single.outputs == [CompletionOutput(0, single.output_token_ids, True, "length")]
    assert [c.index for c in three.outputs] == [0, 1, 2]
    assert all(c.finish_reason == "length" and len(c.token_ids) == 5 for c in three.outputs)
    assert [c.token_ids for c in three.outputs] == alone(tiny, prompts[1], requests[1][1])
    assert [len(o.new_token_ids) for o in seen if o.request_id == 1] == [1] * 5
    assert {0, 1, 4} == {o.request_id for o in seen}, "ids: request 1's samples are 2 and 3"


def test_abort_frees_every_sample(tiny, prompts):
    engine = Engine(tiny, num_blocks=40, block_size=4)
    rid = engine.add_request(prompts[1], hot(n=4, seed=1))
    other = engine.add_request(prompts[0], hot(n=2, seed=2))
    for _ in range(3):
        engine.step()
    assert len(engine.scheduler.running) == 6, "both requests forked"
    engine.abort(rid)
    assert_tables_hold_their_counts(engine.scheduler.manager)
    assert [r.req_id for r in engine.scheduler.running] == [other, other + 1]
    engine.abort(other)
    assert_idle_and_whole(engine)
    before = engine.add_request(prompts[2], hot(n=3))  # aborted mid-prefill: before the fork
    engine.abort(before)
    assert_idle_and_whole(engine)
    engine.abort(rid + 2)  # (a sample's id: finished with its request, nothing to do)


def test_generate_takes_sampling_params(tiny, prompts):
    engine = Engine(tiny, num_blocks=48, block_size=4)
    greedy = engine.generate(prompts, 4, ignore_eos=True)
    assert engine.generate(prompts, params=SamplingParams(max_tokens=4, ignore_eos=True)) == greedy
    mixed = engine.generate(prompts, params=[SamplingParams(max_tokens=4, ignore_eos=True),
                                             hot(n=2, seed=1, max_tokens=3), hot(seed=2)])
    assert mixed[0] == greedy[0] and len(mixed[1]) == 2 and len(mixed[2]) == 8
    assert mixed[1] == alone(tiny, prompts[1], hot(n=2, seed=1, max_tokens=3))
    for bad in (dict(), dict(max_new_tokens=4, params=hot()), dict(params=[hot()] * 2),
                dict(params={"max_tokens": 4})):
        with pytest.raises((TypeError, ValueError), match="max_new_tokens|params"):
            engine.generate(prompts, **bad)
    assert_idle_and_whole(engine)


# ---- planted mistakes: the checks above must fail ------------------------------------------


def test_forgotten_copy_on_write_is_caught(tiny, prompts, monkeypatch, tmp_path):
    """Samples write into their shared last block (no copy-on-write): their K/V stop being
    their own tokens'. (Their tokens may not show it: on the tiny random model one position's
    K/V barely moves the logits.)"""
    mutant = mutant_of(manager_module, [("elif self.ref_count(table[j]) > 1:", "elif False:")],
                       tmp_path, monkeypatch)
    monkeypatch.setattr("paged_ref.engine.scheduler.KVCacheManager", mutant.KVCacheManager)
    with pytest.raises(AssertionError, match="another sequence wrote"):
        run(Engine(tiny, num_blocks=40, block_size=4), [(prompts[1], hot(n=3, seed=1))],
            lambda e: assert_running_kv_is_theirs(e, tiny))


def test_copy_on_write_not_counted_before_taking_slots_is_caught(tiny, monkeypatch, tmp_path):
    """The scheduler counts only block boundaries: the copy-on-write into a full pool raises
    out of step instead of preempting."""
    from paged_ref.engine import engine as engine_module
    from paged_ref.engine import scheduler as scheduler_module
    from paged_ref.memory.allocator import OutOfBlocksError

    mutant = mutant_of(scheduler_module, [("need += 1  # (its last", "need += 0  # (its last")],
                       tmp_path, monkeypatch)
    monkeypatch.setattr(engine_module, "Scheduler", mutant.Scheduler)
    engine = Engine(tiny, num_blocks=2, block_size=4, enable_prefix_caching=False)
    with pytest.raises(OutOfBlocksError):
        engine.generate([[9, 40, 41, 77, 200]], params=hot(n=2, seed=4, max_tokens=3))


PLANTED_SEEDS = {
    "every sample seeded with the request's seed": (
        params_module, "SamplingParams", "sample_seed", "if self.seed is None or i == 0:",
        "if True:"),
    "every sample drawing from sample 0's generator": (
        request_module, "Request", "samplers",
        "generator=generator(self.params.sample_seed(i))", "generator=self.generator"),
}


@pytest.mark.parametrize("name", PLANTED_SEEDS)
def test_samples_sharing_a_seed_or_generator_are_caught(tiny, prompts, monkeypatch, tmp_path,
                                                        name):
    module, cls, method, old, new = PLANTED_SEEDS[name]
    mutant = mutant_of(module, [(old, new)], tmp_path, monkeypatch)
    planted = getattr(getattr(mutant, cls), method)
    monkeypatch.setattr(mutant, cls, getattr(module, cls))  # (it makes the real ones)
    monkeypatch.setattr(getattr(module, cls), method, planted)
    sp = hot(n=3, seed=77)
    got = Engine(tiny, num_blocks=40, block_size=4).generate([prompts[0]], params=sp)[0]
    monkeypatch.undo()
    with pytest.raises(AssertionError):
        assert_samples_are_their_seeds(tiny, prompts[0], sp, got)
