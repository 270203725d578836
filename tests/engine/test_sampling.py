"""Sampling: ``SamplingParams``' checks, the batched sampler's distribution (top-k / top-p never
outside their set, frequencies within binomial bounds of the softmax), and the engine's sampled
requests (seeded ones reproducible whatever runs beside them, temperature -> 0 is greedy)."""

from __future__ import annotations

import math

import pytest
import torch

from paged_ref.engine import SamplingParams
from paged_ref.sampling.sampler import SamplingBatch, sample


@pytest.mark.parametrize("kw,error,match", [
    (dict(max_tokens=0), ValueError, "max_tokens"),
    (dict(max_tokens=2.0), TypeError, "max_tokens"),
    (dict(temperature=-0.1), ValueError, "temperature"),
    (dict(temperature=float("nan")), ValueError, "temperature"),
    (dict(temperature=float("inf")), ValueError, "temperature"),
    (dict(temperature="hot"), TypeError, "temperature"),
    (dict(top_p=0.0), ValueError, "top_p"),
    (dict(top_p=1.5), ValueError, "top_p"),
    (dict(top_k=-1), ValueError, "top_k"),
    (dict(top_k=2.5), TypeError, "top_k"),
    (dict(seed=-3), ValueError, "seed"),
    (dict(seed=1.0), TypeError, "seed"),
    (dict(n=0), ValueError, "n must be"),
    (dict(n=2.0), TypeError, "n must be"),
    (dict(stop_token_ids="12"), TypeError, "stop_token_ids"),
    (dict(stop_token_ids=[1, -2]), ValueError, r"stop_token_ids\[1\]"),
    (dict(ignore_eos=1), TypeError, "ignore_eos"),
])
def test_sampling_params_are_checked_at_construction(kw, error, match):
    with pytest.raises(error, match=match):
        SamplingParams(**kw)


def test_sampling_params_defaults_and_frozen():
    p = SamplingParams(max_tokens=4, stop_token_ids=[3, 4], temperature=1)
    assert p.greedy is False and SamplingParams().greedy and p.stop_token_ids == (3, 4)
    with pytest.raises(AttributeError):
        p.temperature = 0.5


def allowed(logits, temperature, top_k, top_p):
    """The tokens top-k and top-p keep, written as their definitions read."""
    probs = (logits.double() / temperature).softmax(-1)
    order = probs.argsort(descending=True).tolist()
    keep, mass = [], 0.0
    for rank, t in enumerate(order):
        if (top_k and rank >= top_k) or mass >= top_p:
            break
        keep.append(t)
        mass += probs[t].item()
    return set(keep)


def draws(logits, n, seed=0, **kw):
    """``n`` tokens drawn from one row of logits (``n`` rows in one call)."""
    torch.manual_seed(seed)
    batch = SamplingBatch(list(range(n)), [kw.get("temperature", 1.0)] * n,
                          [kw.get("top_p", 1.0)] * n, [kw.get("top_k", 0)] * n, [None] * n)
    return sample(logits.expand(n, -1), batch)


@pytest.mark.parametrize("top_k,top_p,temperature", [(3, 1.0, 1.0), (0, 0.6, 1.0),
                                                    (5, 0.8, 0.7), (1, 1.0, 2.0),
                                                    (0, 0.05, 1.0), (40, 0.999, 0.5)])
def test_top_k_top_p_never_draw_outside_their_set(top_k, top_p, temperature):
    gen = torch.Generator().manual_seed(top_k)
    logits = torch.randn(64, generator=gen) * 2
    keep = allowed(logits, temperature, top_k, top_p)
    got = draws(logits, 4000, top_k=top_k, top_p=top_p, temperature=temperature)
    assert set(got.tolist()) <= keep
    probs = (logits.double() / temperature).softmax(-1)
    likely = {t for t in keep if probs[t] / probs[sorted(keep)].sum() > 0.01}
    assert likely <= set(got.tolist()), "a kept token with p > 1% never drawn in 4000"


def assert_binomial(counts, probs, n):
    """Each count within 5 standard deviations of ``n * p`` (a false alarm: < 1e-6 each)."""
    for t, p in enumerate(probs.tolist()):
        sd = math.sqrt(n * p * (1 - p))
        assert abs(counts[t] - n * p) <= 5 * sd + 1, (t, counts[t], n * p)


@pytest.mark.parametrize("kw", [dict(temperature=0.8), dict(temperature=1.3, top_k=4),
                                dict(temperature=1.0, top_p=0.7)])
def test_frequencies_follow_the_softmax(kw):
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(12, generator=gen)
    keep = torch.tensor(sorted(allowed(logits, kw["temperature"], kw.get("top_k", 0),
                                       kw.get("top_p", 1.0))))
    masked = torch.full_like(logits, -torch.inf)
    masked[keep] = logits[keep] / kw["temperature"]
    n = 20000
    counts = torch.bincount(draws(logits, n, seed=1, **kw), minlength=12)
    assert_binomial(counts.tolist(), masked.double().softmax(-1), n)


def test_seeded_rows_use_their_own_generator():
    logits = torch.randn(3, 50)
    gens = [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(7)]
    batch = SamplingBatch([0, 1, 2], [1.0] * 3, [1.0] * 3, [0] * 3, gens)
    first = sample(logits[[0, 0, 0]], batch)
    assert first[0] == first[2]  # the same seed, the same logits: the same draw
    again = sample(logits[[0, 0, 0]], SamplingBatch(
        [0, 1, 2], [1.0] * 3, [1.0] * 3, [0] * 3,
        [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(7)]))
    assert again[0] == first[0] and again[2] == first[2]


#: (temperature, top_k, top_p) of the rows of one batched call: every row its own rules.
MIXED = [(0.7, 0, 1.0), (1.3, 4, 1.0), (1.0, 0, 0.6), (2.0, 6, 0.9), (0.5, 1, 1.0)]


def test_a_batch_of_mixed_rows_draws_each_from_its_own_distribution():
    """One call, rows of five different (temperature, top_k, top_p), each row's own logits:
    each row's draws stay inside its own top-k / top-p set and follow its own softmax."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(len(MIXED), 10, generator=gen) * 1.5
    n = 8000
    rows = [r for r in range(len(MIXED)) for _ in range(n)]
    torch.manual_seed(2)
    got = sample(logits[rows], SamplingBatch(
        list(range(len(rows))), [MIXED[r][0] for r in rows], [MIXED[r][2] for r in rows],
        [MIXED[r][1] for r in rows], [None] * len(rows))).view(len(MIXED), n)
    for r, (temperature, top_k, top_p) in enumerate(MIXED):
        keep = allowed(logits[r], temperature, top_k, top_p)
        assert set(got[r].tolist()) <= keep, f"row {r} drew outside its set"
        masked = torch.full((10,), -torch.inf, dtype=torch.float64)
        idx = torch.tensor(sorted(keep))
        masked[idx] = logits[r, idx].double() / temperature
        assert_binomial(torch.bincount(got[r], minlength=10).tolist(), masked.softmax(-1), n)


def test_temperature_towards_zero_is_the_argmax_row_by_row():
    """2,000 rows of random logits at temperature 1e-3 (their top two at least 0.05 apart):
    every draw is the row's argmax -- the sampler, not the greedy path, picks them."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(2000, 64, generator=gen)
    top2 = logits.topk(2).values
    logits = logits[top2[:, 0] - top2[:, 1] > 0.05]
    batch = SamplingBatch(list(range(len(logits))), [1e-3] * len(logits), [1.0] * len(logits),
                          [0] * len(logits), [None] * len(logits))
    assert len(logits) > 1500
    assert torch.equal(sample(logits, batch), logits.argmax(-1))
    hot = SamplingBatch(batch.rows, [1.0] * len(logits), batch.top_p, batch.top_k,
                        batch.generators)
    assert not torch.equal(sample(logits, hot), logits.argmax(-1)), "nothing sampled at 1.0"


# ---- likely sampler mistakes, planted one at a time: the checks above must fail ------------

PLANTED_SAMPLER = {
    "top-p drops the token that crosses the threshold": (
        "probs.cumsum(dim=-1) - probs >= ", "probs.cumsum(dim=-1) >= "),
    "top-k keeps one token too many": ("[None] >= k[:, None]", "[None] > k[:, None]"),
    "temperature ignored": ("x = logits.float() / torch.tensor(batch.temperature, device=dev)"
                            "[:, None]", "x = logits.float()"),
    "the softmax's weights dropped (uniform draws)": ("(x.softmax(dim=-1) / race",
                                                      "((x > -1e30) / race"),
    "seeded rows drawn from the default generator": ("row.exponential_(generator=gen)",
                                                     "row.exponential_()"),
    "the first row's temperature for every row": (
        "torch.tensor(batch.temperature, device=dev)[:, None]", "batch.temperature[0]"),
    "top-p of the first row for every row": (
        "torch.tensor(batch.top_p, device=dev)[:, None]", "batch.top_p[0]"),
}


@pytest.mark.parametrize("name", PLANTED_SAMPLER)
def test_planted_sampler_mistake_is_caught(name, monkeypatch, tmp_path):
    import sys

    from paged_ref.sampling import sampler
    from tests.mutations.mutate import mutant_of

    mutant = mutant_of(sampler, [PLANTED_SAMPLER[name]], tmp_path, monkeypatch)
    monkeypatch.setattr(sys.modules[__name__], "sample", mutant.sample)
    with pytest.raises(AssertionError):
        for kw in ([dict(temperature=0.8), dict(temperature=1.3, top_k=4),
                    dict(temperature=1.0, top_p=0.7)]):
            test_frequencies_follow_the_softmax(kw)
        for args in ((3, 1.0, 1.0), (0, 0.6, 1.0), (5, 0.8, 0.7), (0, 0.05, 1.0)):
            test_top_k_top_p_never_draw_outside_their_set(*args)
        test_seeded_rows_use_their_own_generator()
        test_a_batch_of_mixed_rows_draws_each_from_its_own_distribution()


# ---- through the engine ---------------------------------------------------------------------

pytest.importorskip("transformers")


def run_online(engine, requests):
    """``requests``: ``(prompt, SamplingParams)``; returns their outputs in order."""
    ids = [engine.add_request(p, sp) for p, sp in requests]
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out.output_token_ids
    return [final[i] for i in ids]


@pytest.fixture(scope="module")
def prompts(tiny):
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(3, 256, (int(n),), generator=gen).tolist() for n in (5, 9, 13, 4)]


def test_seeded_request_gives_the_same_tokens_whatever_runs_beside_it(tiny, prompts):
    from paged_ref.engine import Engine

    sp = SamplingParams(max_tokens=12, temperature=0.2, top_p=0.95, seed=123, ignore_eos=True)
    alone = run_online(Engine(tiny, num_blocks=32, block_size=4), [(prompts[0], sp)])[0]
    others = [(p, SamplingParams(max_tokens=9, temperature=0.2, ignore_eos=True))
              for p in prompts[1:]] + [(prompts[2], SamplingParams(max_tokens=5))]
    crowd = run_online(Engine(tiny, num_blocks=14, block_size=4, max_num_batched_tokens=8),
                       [*others[:2], (prompts[0], sp), *others[2:]])
    assert crowd[2] == alone and len(alone) == 12
    other_seed = run_online(Engine(tiny, num_blocks=32, block_size=4), [(prompts[0], SamplingParams(
        max_tokens=12, temperature=0.2, top_p=0.95, seed=124, ignore_eos=True))])[0]
    assert other_seed != alone, "another seed, the same 12 tokens: the seed is not used"


def test_temperature_towards_zero_is_greedy_and_greedy_rows_stay_argmax(tiny, prompts):
    from paged_ref.engine import Engine
    from tests.engine.checks import hf_greedy

    expected = [hf_greedy(tiny, p, 8) for p in prompts]
    cold = [(p, SamplingParams(max_tokens=8, temperature=1e-6, seed=i, ignore_eos=True))
            for i, p in enumerate(prompts)]
    hot = [(p, SamplingParams(max_tokens=8, temperature=5.0, ignore_eos=True)) for p in prompts]
    greedy = [(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts]
    got = run_online(Engine(tiny, num_blocks=48, block_size=4),
                     [x for trio in zip(cold, hot, greedy, strict=True) for x in trio])
    assert got[0::3] == expected and got[2::3] == expected
    assert got[1::3] != expected, "temperature 5 reproduced the argmax: nothing was sampled"


def test_first_token_frequencies_on_the_tiny_model(tiny, prompts):
    """600 requests of one prompt, seeds 0..599, at the temperature where the likeliest token
    has p < 0.5: the first tokens' counts are within binomial bounds of the softmax of
    transformers' logits."""
    from paged_ref.engine import Engine

    n = 600
    with torch.inference_mode():
        logits = tiny(torch.tensor([prompts[1]])).logits[0, -1].double()
    temperature = next(t for t in (0.01 * 1.2**k for k in range(60))
                       if (logits / t).softmax(-1).max() < 0.5)
    probs = (logits / temperature).softmax(-1)
    assert 0.3 < probs.max() < 0.5  # (the likeliest token: the binomial bound at its widest)
    requests = [(prompts[1], SamplingParams(max_tokens=1, temperature=temperature, seed=s))
                for s in range(n)]
    got = run_online(Engine(tiny, num_blocks=64, block_size=4), requests)
    counts = torch.bincount(torch.tensor([g[0] for g in got]), minlength=256).tolist()
    assert_binomial(counts, probs, n)


def test_temperature_zero_is_todays_greedy_whatever_else_is_set(tiny, prompts):
    """``temperature=0`` is the argmax path, bit for bit: with top-k / top-p / a seed / n
    samples set, through add_request and generate alike, the greedy tokens transformers gives."""
    from paged_ref.engine import Engine
    from tests.engine.checks import hf_greedy

    expected = [hf_greedy(tiny, p, 8) for p in prompts]
    engine = Engine(tiny, num_blocks=64, block_size=4)
    assert engine.generate(prompts, 8, ignore_eos=True) == expected
    odd = SamplingParams(max_tokens=8, temperature=0.0, top_k=3, top_p=0.5, seed=9,
                         ignore_eos=True)
    assert run_online(engine, [(p, odd) for p in prompts]) == expected
    assert engine.generate(prompts, params=odd) == expected
    assert engine.generate(prompts, params=SamplingParams(max_tokens=8, n=2, ignore_eos=True)) \
        == [[e, e] for e in expected]


def test_parallel_samples_first_tokens_follow_the_softmax(tiny, prompts):
    """One request with n = 600 (seeded: each sample its own stream): the prompt's logits are
    computed once and the 600 first tokens, drawn from them row by row, fall within binomial
    bounds of transformers' softmax."""
    from paged_ref.engine import Engine

    n = 600
    with torch.inference_mode():
        logits = tiny(torch.tensor([prompts[1]])).logits[0, -1].double()
    temperature = next(t for t in (0.01 * 1.2**k for k in range(60))
                       if (logits / t).softmax(-1).max() < 0.5)
    engine = Engine(tiny, num_blocks=16, block_size=4)
    got = engine.generate([prompts[1]], params=SamplingParams(
        max_tokens=1, temperature=temperature, seed=3, n=n))[0]
    assert engine.stats.computed_tokens == len(prompts[1]), "the prompt computed more than once"
    counts = torch.bincount(torch.tensor([g[0] for g in got]), minlength=256).tolist()
    assert_binomial(counts, (logits / temperature).softmax(-1), n)


def test_sampling_batch_of_a_step_keeps_the_sampling_rows_only():
    greedy, hot = SamplingParams(), SamplingParams(temperature=0.7, top_k=5, top_p=0.9)
    assert SamplingBatch.of([greedy, None, greedy], [None] * 3) is None
    gen = torch.Generator().manual_seed(0)
    got = SamplingBatch.of([greedy, hot, None, hot], [None, gen, None, None])
    assert (got.rows, got.temperature, got.top_k, got.top_p) == ([1, 3], [0.7, 0.7], [5, 5],
                                                                [0.9, 0.9])
    assert got.generators[0] is gen and got.generators[1] is None
