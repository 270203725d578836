"""Beam search: :class:`paged_ref.sampling.beam.BeamSearch` alone (driven by transformers'
logits) and ``Engine.beam_search`` on the tiny random Llama, both against transformers'
``generate(num_beams=k, num_return_sequences=k, do_sample=False)`` -- sequences and
``sequences_scores`` -- for widths 2-4, length penalties 1 / 0 / 2 / -0.5 and
``early_stopping`` False / True / "never", with an EOS that finishes hypotheses early. In the
engine the beams fork and free blocks: reference counts equal the tables every step, each beam's
K/V are its own tokens', blocks are shared, and nothing is left when it ends (or fails)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from paged_ref.cache_math import blocks_needed  # noqa: E402
from paged_ref.engine import Engine, RequestOutput  # noqa: E402
from paged_ref.sampling import beam as beam_module  # noqa: E402
from paged_ref.sampling.beam import BeamSearch  # noqa: E402
from tests.engine.checks import (  # noqa: E402
    assert_idle_and_whole,
    assert_running_kv_is_theirs,
    assert_tables_hold_their_counts,
)
from tests.mutations.mutate import mutant_of  # noqa: E402

#: (width, length_penalty, early_stopping), each run with and without an EOS token.
SETTINGS = [(2, 1.0, False), (3, 0.0, True), (4, 2.0, "never"), (2, -0.5, False),
            (4, 1.5, True), (3, 1.0, "never")]
MAX_TOKENS = 6


@torch.inference_mode()
def hf_beams(model, prompt, width, max_tokens, eos, length_penalty=1.0, early_stopping=False):
    """transformers' ``(sequences, sequences_scores)``: generated tokens (the EOS kept, the
    padding after it cut) and scores, best first."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=width,
                         num_return_sequences=width, do_sample=False, max_new_tokens=max_tokens,
                         output_scores=True, return_dict_in_generate=True, eos_token_id=eos,
                         pad_token_id=eos, length_penalty=length_penalty,
                         early_stopping=early_stopping)
    seqs = []
    for row in out.sequences[:, len(prompt):].tolist():
        cut = row.index(eos) + 1 if eos in row else len(row)
        seqs.append(row[:cut])
    return seqs, out.sequences_scores.tolist()


@torch.inference_mode()
def pure_beams(model, prompt, width, max_tokens, eos, length_penalty=1.0, early_stopping=False,
               search_cls=BeamSearch):
    """:class:`BeamSearch` fed by transformers' own logits (each beam's full sequence re-run)."""
    search = search_cls(width, max_tokens, stop_ids=[eos], length_penalty=length_penalty,
                        early_stopping=early_stopping)
    while not search.done:
        logits = model(torch.tensor([prompt + list(b.tokens) for b in search.beams])).logits
        top = logits[:, -1].float().log_softmax(-1).topk(search.num_candidates)
        search.step([list(zip(v, t, strict=True)) for v, t in zip(top.values.tolist(),
                                                                  top.indices.tolist(),
                                                                  strict=True)])
    return [list(h.tokens) for h in search.best()], [h.score for h in search.best()]


def assert_same_beams(got, want, label=""):
    """``got`` and ``want``: ``(sequences, scores)``, best first."""
    (seqs, scores), (want_seqs, want_scores) = got, want
    assert seqs == want_seqs, f"{label}: sequences {seqs} != transformers' {want_seqs}"
    assert scores == pytest.approx(want_scores, abs=2e-5), f"{label}: scores"


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(31)
    return [torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in (3, 9, 6)]


@pytest.fixture(scope="module")
def eos(tiny, prompts):
    """An EOS that finishes hypotheses early: in prompt 0's beams without one, the first token
    other than its best beam's first (a likely second choice there)."""
    seqs, _ = hf_beams(tiny, prompts[0], 4, MAX_TOKENS, eos=0)
    return next(t for s in seqs for t in s if t != seqs[0][0])


@pytest.fixture(scope="module")
def expected(tiny, prompts, eos):
    """transformers' beams per prompt, setting and EOS (0: never a likely token here)."""
    out = {(i, setting, e): hf_beams(tiny, p, setting[0], MAX_TOKENS, e, *setting[1:])
           for i, p in enumerate(prompts) for setting in SETTINGS for e in (0, eos)}
    early = [s for seqs, _ in out.values() for s in seqs if len(s) < MAX_TOKENS]
    assert len(early) >= 6, "no hypothesis finished early: the EOS choice tests nothing"
    return out


def test_beam_bookkeeping_equals_transformers(tiny, prompts, eos, expected):
    for i, p in enumerate(prompts):
        for setting in SETTINGS:
            for e in (0, eos):
                got = pure_beams(tiny, p, setting[0], MAX_TOKENS, e, *setting[1:])
                assert_same_beams(got, expected[i, setting, e], f"prompt {i} {setting} EOS {e}")


@pytest.mark.parametrize("config", [
    dict(num_blocks=64, block_size=4),
    dict(num_blocks=64, block_size=4, enable_prefix_caching=False),
    # room for one prompt's beams at a time (3 x 4 blocks), prefill in chunks
    dict(num_blocks=12, block_size=4, max_num_batched_tokens=5),
], ids=["prefix-cache", "no-prefix-cache", "one-at-a-time"])
def test_engine_beam_search_equals_transformers(tiny, prompts, eos, expected, config):
    """All prompts in one call, per setting and EOS, in prompt order."""
    for setting in SETTINGS:
        width, lp, es = setting
        if config["num_blocks"] < 16 and width > 3:
            continue
        for e in (0, eos):
            engine = Engine(tiny, eos_token_id=e, **config)
            outs = engine.beam_search(prompts, width, MAX_TOKENS, length_penalty=lp,
                                      early_stopping=es)
            for i, out in enumerate(outs):
                assert_same_beams(([c.token_ids for c in out.outputs],
                                   [c.score for c in out.outputs]), expected[i, setting, e],
                                  f"prompt {i} {setting} EOS {e}")
            assert_idle_and_whole(engine)


def test_outputs_and_a_reused_engine(tiny, prompts, eos, expected):
    """The outputs' shape; the engine serves generate and the same beam search afterwards."""
    engine = Engine(tiny, num_blocks=64, block_size=4, eos_token_id=eos)
    outs = engine.beam_search(prompts, 3, MAX_TOKENS, length_penalty=0.0, early_stopping=True)
    for out in outs:
        assert isinstance(out, RequestOutput) and out.finished and len(out.outputs) == 3
        assert out.output_token_ids == out.outputs[0].token_ids
        assert [c.index for c in out.outputs] == [0, 1, 2]
        assert all(c.finish_reason == ("stop" if c.token_ids[-1] == eos else "length")
                   for c in out.outputs)
        assert out.metrics.finished is not None
    assert {c.finish_reason for o in outs for c in o.outputs} == {"stop", "length"}
    assert [o.request_id for o in outs] == sorted(o.request_id for o in outs)
    assert_idle_and_whole(engine)
    assert engine.generate(prompts, 3, ignore_eos=True)
    again = engine.beam_search(prompts, 3, MAX_TOKENS, length_penalty=0.0, early_stopping=True)
    for a, b in zip(again, outs, strict=True):  # (prefix-cache hits now: scores within 1e-6)
        assert_same_beams(*(([c.token_ids for c in o.outputs], [c.score for c in o.outputs])
                            for o in (a, b)))


def watch(engine, check):
    """Run ``check(engine)`` before every step's schedule (between steps)."""
    real = engine.scheduler.schedule

    def schedule(*args):
        check(engine)
        return real(*args)
    engine.scheduler.schedule = schedule


def test_beams_fork_and_free_blocks_and_share_them(tiny, prompts):
    """Every step: reference counts are the tables', each beam's K/V its own tokens'; and the
    beams hold fewer blocks than copies of them would."""
    engine = Engine(tiny, num_blocks=64, block_size=4, enable_prefix_caching=False,
                    eos_token_id=0)
    m, held, unshared = engine.scheduler.manager, [], []

    def check(e):
        assert_tables_hold_their_counts(m)
        assert_running_kv_is_theirs(e, tiny)
        held.append(m.num_blocks - m.num_free_blocks)
        unshared.append(sum(blocks_needed(m.seq_len(s), m.block_size) for s in m.seq_ids))

    watch(engine, check)
    engine.beam_search(prompts[1:2], 4, 10)
    assert len(held) == 10 and sum(held) < 0.8 * sum(unshared), (held, unshared)
    assert_idle_and_whole(engine)


def test_bad_calls_are_refused_before_any_work(tiny, prompts):
    engine = Engine(tiny, num_blocks=8, block_size=4, max_num_seqs=6)
    for args, kw, error, match in [
        ((prompts, 0, 4), {}, ValueError, "beam_width"),
        ((prompts, 2.0, 4), {}, TypeError, "beam_width"),
        ((prompts, 2, 0), {}, ValueError, "max_tokens"),
        ((prompts, 2, 4), dict(early_stopping="sometimes"), ValueError, "early_stopping"),
        ((prompts, 2, 4), dict(length_penalty="long"), TypeError, "length_penalty"),
        ((prompts, 2, 4), dict(length_penalty=float("inf")), ValueError, "length_penalty"),
        ((prompts, 8, 4), {}, ValueError, "seats"),  # more beams than max_num_seqs
        ((prompts, 4, 9), {}, ValueError, "num_blocks=8"),  # 4 x 3 blocks > 8
        (([[]], 2, 4), {}, ValueError, "empty"),
        (("hello", 2, 4), {}, TypeError, "prompts"),
    ]:
        with pytest.raises(error, match=match):
            engine.beam_search(*args, **kw)
        assert_idle_and_whole(engine)
    engine.add_request(prompts[0])
    with pytest.raises(RuntimeError, match="its own prompts"):
        engine.beam_search(prompts, 2, 4)
    with pytest.raises(ValueError, match="reservation"):
        Engine(tiny, num_blocks=64, block_size=4, reservation="reserve_max").beam_search(
            prompts, 2, 4)


def test_a_failed_step_leaves_nothing_behind(tiny, prompts, monkeypatch):
    engine = Engine(tiny, num_blocks=64, block_size=4)
    want = engine.beam_search(prompts, 2, MAX_TOKENS)
    calls, real = [0], engine.runner.top_logprobs

    def failing(step, k):
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt("planted")
        return real(step, k)

    monkeypatch.setattr(engine.runner, "top_logprobs", failing)
    with pytest.raises(KeyboardInterrupt):
        engine.beam_search(prompts, 2, MAX_TOKENS)
    assert_idle_and_whole(engine)
    monkeypatch.undo()
    for a, b in zip(engine.beam_search(prompts, 2, MAX_TOKENS), want, strict=True):
        assert_same_beams(*(([c.token_ids for c in o.outputs], [c.score for c in o.outputs])
                            for o in (a, b)))


# ---- planted mistakes: the checks above must fail ------------------------------------------


def test_scores_without_the_length_penalty_are_caught(tiny, prompts, eos, expected,
                                                      monkeypatch, tmp_path):
    mutant = mutant_of(beam_module, [("return logprob / length ** self.length_penalty",
                                      "return logprob")], tmp_path, monkeypatch)
    setting = SETTINGS[0]
    got = pure_beams(tiny, prompts[1], setting[0], MAX_TOKENS, eos, *setting[1:],
                     search_cls=mutant.BeamSearch)
    with pytest.raises(AssertionError, match="scores"):
        assert_same_beams(got, expected[1, setting, eos])


PLANTED_FREES = {
    "a dropped beam's blocks leak": ("scheduler", 'self._finish(req, "dropped")',
                                     'self.running.remove(req)\n                    req.status = '
                                     'Status.FINISHED'),
    "a dropped beam's shared blocks freed twice": (
        "manager", "                self._allocator.free(block_id)\n        self._copies",
        "                self._allocator.free(block_id)\n                if self._allocator"
        ".ref_count(block_id):\n                    self._allocator.free(block_id)\n"
        "        self._copies"),
    "a beam kept once freed as if dropped": (
        "scheduler", "if all(child is not req for child, _ in went_on):", "if True:"),
}


@pytest.mark.parametrize("name", PLANTED_FREES)
def test_dropped_beams_freed_twice_or_leaked_are_caught(tiny, prompts, monkeypatch, tmp_path,
                                                        name):
    from paged_ref.engine import engine as engine_module
    from paged_ref.engine import scheduler as scheduler_module
    from paged_ref.memory import manager as manager_module

    where, old, new = PLANTED_FREES[name]
    if where == "scheduler":
        mutant = mutant_of(scheduler_module, [(old, new)], tmp_path, monkeypatch)
        monkeypatch.setattr(engine_module, "Scheduler", mutant.Scheduler)
    else:
        mutant = mutant_of(manager_module, [(old, new)], tmp_path, monkeypatch)
        monkeypatch.setattr(scheduler_module, "KVCacheManager", mutant.KVCacheManager)
    engine = Engine(tiny, num_blocks=64, block_size=4, eos_token_id=0)
    watch(engine, lambda e: assert_tables_hold_their_counts(e.scheduler.manager))
    with pytest.raises((AssertionError, RuntimeError, ValueError),
                       match="ref_count|holds sequences|missed|double free"):
        engine.beam_search(prompts, 3, MAX_TOKENS)
        assert_idle_and_whole(engine)
