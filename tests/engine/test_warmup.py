"""``Engine.warmup``: dummy requests through the real step path before the first request, that
leave the engine as a fresh one (no block held, nothing cached, stats zero, request ids and
the RNG as they were), and that run every prefill tile variant and both sampler paths.
CPU, the tiny random Llama (``tiny`` fixture); the GPU check (no kernel compiled inside the
first ``generate``) is in test_warmup_gpu.py."""

from __future__ import annotations

import copy
import dataclasses
import gc
import sys
import weakref

import pytest
import torch

from paged_ref.engine import Engine, SamplingParams
from paged_ref.models import warmup as warmup_module
from tests.conftest import KERNEL_DEVICE
from tests.mutations.mutate import mutant_of

POOL = dict(num_blocks=48, block_size=4, max_num_batched_tokens=32, max_num_seqs=8)


def _prompts(n=5, seed=0, vocab=256):
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 30, (n,), generator=gen).tolist()
    return [torch.randint(3, vocab, (k,), generator=gen).tolist() for k in lens]


def _state(engine) -> dict:
    """What a fresh engine and one after warm-up must agree on."""
    m = engine.scheduler.manager
    return {"free_blocks": m.num_free_blocks, "cached_blocks": m.cached_blocks(),
            "seq_ids": list(m.seq_ids), "requests": dict(engine.requests),
            "waiting": list(engine.scheduler.waiting), "running": engine.scheduler.running,
            "preemptions": engine.scheduler.num_preemptions, "stats": engine.stats,
            "prefix_stats": dataclasses.asdict(m.stats())}


def _warm(engine) -> list[str]:
    """Warm ``engine`` up; what it changed of the global RNG (a list of differences)."""
    before = torch.get_rng_state()
    seconds = engine.warmup()
    assert seconds > 0 and engine.warmup_seconds == seconds
    return [] if torch.equal(before, torch.get_rng_state()) else ["the global RNG moved"]


def _differences(warm, fresh, prompts, new=6) -> list[str]:
    """Where ``warm`` (after warm-up) and ``fresh`` differ, before and through a run."""
    diffs = [f"{k}: {a!r} != {b!r}" for (k, a), b in zip(_state(warm).items(),
                                                          _state(fresh).values(), strict=True)
             if a != b]
    runs = []
    for engine in (warm, fresh):
        events = []
        torch.manual_seed(7)  # (the unseeded sampling row draws from the global RNG)
        rid = engine.add_request(prompts[0], SamplingParams(max_tokens=new, temperature=1.0))
        while engine.has_unfinished_requests():
            engine.step()
        out = engine.generate(prompts, new, ignore_eos=True, on_step=lambda e, ev=events: ev.append(
            (e.ran, e.block_tables, e.seq_lens, e.num_free_blocks, e.cached_tokens)))
        s = engine.stats
        runs.append((rid, out, events, s.steps, s.computed_tokens, s.cached_tokens,
                     s.preemptions, s.max_running))
    names = ("first request id", "outputs", "step events", "steps", "computed tokens",
             "cached tokens", "preemptions", "max running")
    return diffs + [f"run {n}: {a!r} != {b!r}" for n, a, b in zip(names, *runs, strict=True)
                    if a != b]


CONFIGS = {
    "default": {},
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "swap": dict(preemption_mode="swap"),
    "reserve_max": dict(reservation="reserve_max", max_model_len=64),
    "short_model_len": dict(max_model_len=3),
    "tiny_budget": dict(max_num_batched_tokens=3),
    "prefix_policy": dict(scheduling_policy="prefix", max_overtakes=2),
    # (a pool the dummies overflow: their blocks would go down to the disk; short prompts)
    "three_tiers": dict(num_blocks=5, num_host_blocks=1, num_disk_blocks=16),
}


def _config(name: str, folder) -> tuple[dict, list[list[int]], int]:
    """Configuration ``name``'s engine arguments (a disk tier in ``folder``), prompts and new
    tokens per prompt."""
    kw = POOL | CONFIGS[name]
    if "num_disk_blocks" in kw:
        return kw | {"disk_path": folder}, [p[:8] for p in _prompts()], 4
    if name == "short_model_len":
        return kw, [p[:1] for p in _prompts()], 2
    return kw, _prompts(), 6


@pytest.mark.parametrize("name", list(CONFIGS))
def test_after_warmup_the_engine_is_a_fresh_one(tiny, name, tmp_path):
    kw, prompts, new = _config(name, tmp_path)
    warm, fresh = Engine(tiny, **kw), Engine(tiny, **kw)
    assert warm.warmup_seconds == fresh.warmup_seconds == 0.0  # (a CPU: off by default)
    moved = _warm(warm)
    assert moved + _differences(warm, fresh, prompts, new=new) == []


def test_warmup_at_construction_and_its_argument(tiny):
    assert Engine(tiny, **POOL, warmup=True).warmup_seconds > 0
    with pytest.raises(TypeError, match="warmup must be a bool"):
        Engine(tiny, **POOL, warmup="yes")


@pytest.fixture()
def unfrozen():
    """Only explicit collections during the test (an automatic one could free the garbage a
    planted mistake keeps); a warm-up's ``gc.freeze()`` undone after it."""
    gc.unfreeze()
    gc.disable()
    yield
    gc.enable()
    gc.unfreeze()


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self):
        self.me = self


@pytest.mark.parametrize("planted, caught", [
    ("as written", None),
    ("freezes without collecting first", ("    gc.collect()\n", "")),
    ("never freezes", ("    gc.freeze()\n", "")),
])
def test_warmup_collects_then_freezes(tiny, unfrozen, planted, caught, tmp_path,
                                      monkeypatch):
    """Warm-up ends with gc.collect() then gc.freeze(): what is alive then (the model, the
    engine) is out of the collector's sweeps, and garbage made before it is not kept. The
    calls are counted where ``warmup`` itself makes them (on the GPU machine something else
    in the process froze objects too, so the freeze count could not tell)."""
    if caught is not None:
        mutant = mutant_of(warmup_module, [caught], tmp_path, monkeypatch)
        monkeypatch.setattr(Engine, "warmup", mutant.warmup)
    engine = Engine(tiny, **POOL)
    garbage = weakref.ref(_Cycle())  # (unreachable from the start, kept alive by its cycle)
    calls = []

    def spy(name, real):
        def call(*args):
            if sys._getframe(1).f_code.co_name == "warmup":  # (warm-up's own calls only)
                calls.append(name)
            return real(*args)
        return call

    for name in ("collect", "freeze"):
        monkeypatch.setattr(gc, name, spy(name, getattr(gc, name)))
    engine.warmup()
    problems = ([] if calls[-2:] == ["collect", "freeze"] else
                [f"warm-up's last collector calls: {calls}"]) + (
        [] if garbage() is None else ["garbage made before warm-up frozen with the rest"])
    assert (problems == []) == (caught is None), problems


def test_warmup_after_the_first_request_is_refused(tiny):
    engine = Engine(tiny, **POOL)
    engine.warmup()
    engine.warmup()  # (still fresh: again is fine)
    engine.add_request([5, 6, 7])
    with pytest.raises(RuntimeError, match="before the first request"):
        engine.warmup()
    engine.abort(0)
    with pytest.raises(RuntimeError, match="before the first request"):
        engine.warmup()


def test_warmup_runs_every_prefill_variant_and_both_sampler_paths(tiny, monkeypatch):
    """With the Triton attention kernels (interpreted on a CPU, compiled on a GPU): a long-only
    prefill launch (default tiles), a short-only one (small tiles) and a mixed step's two
    launches over sequence subsets; the sampler with and without top-k / top-p; decode steps."""
    from paged_ref.engine import runner
    from paged_ref.kernels.triton import prefill

    launches, sampled, decodes = set(), [], []
    real_launch, real_sample = prefill._launch, runner.sample

    def spy_launch(args, seq_ids, strides, consts, causal, config, *rest):
        launches.add(("short" if config == prefill.SHORT_CONFIG else "long", seq_ids is not None))
        return real_launch(args, seq_ids, strides, consts, causal, config, *rest)

    def spy_sample(logits, batch):
        sampled.append(any(batch.top_k) or min(batch.top_p) < 1)
        return real_sample(logits, batch)

    monkeypatch.setattr(prefill, "_launch", spy_launch)
    monkeypatch.setattr(runner, "sample", spy_sample)
    model = copy.deepcopy(tiny).to(KERNEL_DEVICE)  # (the kernels' device: compiled on a GPU)
    engine = Engine(model, **POOL, attention_backend="triton", warmup=False)
    real_execute = engine.runner.execute
    monkeypatch.setattr(engine.runner, "execute", lambda step, s=None: (
        decodes.append(step.is_decode), real_execute(step, s))[1])
    engine.warmup()
    assert launches == {("long", False), ("long", True), ("short", True), ("short", False)}
    assert set(sampled) == {True, False}
    assert True in decodes and False in decodes


def test_waves_fit_the_engine_and_never_hit_the_prefix_cache():
    waves = warmup_module.warmup_waves(vocab_size=256, max_model_len=4096, pool_tokens=4096,
                                       max_num_batched_tokens=2048, num_q_heads=32,
                                       num_kv_heads=8)
    prompts = [ids for wave in waves for ids, _ in wave]
    short = warmup_module.short_rows(32, 8)
    assert short == 4 and [len(p) for p in prompts] == [1024, 2, 1024, 2]
    assert len({tuple(p[:2]) for p in prompts}) == len(prompts), "a prompt repeats another"
    assert all(3 <= t < 256 for p in prompts for t in p)
    tight = warmup_module.warmup_waves(vocab_size=256, max_model_len=3, pool_tokens=64,
                                       max_num_batched_tokens=8, num_q_heads=4, num_kv_heads=2)
    for ids, params in (r for wave in tight for r in wave):
        assert len(ids) + params.max_tokens - 1 <= 3


# (planted mistake in Engine.warmup (paged_ref.models.warmup.warmup), old text, new text,
# configuration)
PLANTED = [
    ("warmup on the engine's own scheduler: its prompts' hashes stay cached",
     "engine.scheduler = copy.deepcopy(engine.scheduler, {id(engine.disk_tier): None})", "pass",
     "default"),
    ("request ids not reset", "(engine.scheduler, engine.stats), engine._next_id, engine._last = "
     "kept, 0, ()", "(engine.scheduler, engine.stats), engine._last = kept, ()", "default"),
    ("the global RNG not restored", "with torch.random.fork_rng(devices=cuda):",
     "with torch.no_grad():", "default"),
    ("the dummies share the disk tier: their blocks stay in its file",
     "{id(engine.disk_tier): None}", "{id(engine.disk_tier): engine.disk_tier}", "three_tiers"),
]


@pytest.mark.parametrize("old, new, name", [p[1:] for p in PLANTED], ids=[p[0] for p in PLANTED])
def test_planted_warmup_mistakes_are_caught(tiny, old, new, name, tmp_path, monkeypatch):
    mutant = mutant_of(warmup_module, [(old, new)], tmp_path, monkeypatch)
    kw, prompts, tokens = _config(name, tmp_path)
    warm, fresh = Engine(tiny, **kw), Engine(tiny, **kw)
    monkeypatch.setattr(warm, "warmup", mutant.warmup.__get__(warm))
    assert _warm(warm) + _differences(warm, fresh, prompts, new=tokens) != []
