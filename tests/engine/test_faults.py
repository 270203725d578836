"""Faults lose nothing: the engine's part of the fault-injection suite (tiny random Llama, CPU).

A fault is planted at one point of a step, on its n-th call, as an exception or a
``KeyboardInterrupt`` (``POINTS``: adding ``generate``'s requests, the schedule and its policy
functions, the block moves, the layout, inside the forward at a layer (a monkeypatched module),
the K/V write, the prefill kernel, the decode plan and kernel, the greedy pick, the sampler, the
scheduler's update before it starts and half-way through it, ``on_step``). After it propagates:

* ``generate``: nothing is left inside the engine (no request, no sequence, every block free or
  cached), every prefix-cache entry holds the K/V of the tokens it is cached under (against
  transformers), and the next call's outputs equal a fresh engine's;
* ``step`` (online): the requests the step scheduled are aborted, the others carry on and get
  the tokens they get alone (greedy, or sampled with their own seed), every finished request's
  output is exactly the tokens its steps delivered, and between steps no request's blocks run
  ahead of its K/V.

Then the bugs of issue 36's scenarios 4 and 5 are planted back (``mutant_of``), with the two
found in the audit (an update that failed half-way; a fault while ``generate`` adds its
requests), and the same checks must fail (scenario 6, configuration, is ``test_config.py``'s).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from paged_bench.engine import workload  # noqa: E402
from paged_ref import offline as offline_module  # noqa: E402
from paged_ref.engine import Engine, SamplingParams  # noqa: E402
from paged_ref.engine import engine as engine_module  # noqa: E402
from paged_ref.engine import runner as runner_module  # noqa: E402
from paged_ref.engine import scheduler as scheduler_module  # noqa: E402
from tests.engine.checks import (  # noqa: E402
    assert_cached_kv_is_written,
    assert_idle_and_whole,
    hf_greedy,
)
from tests.mutations.mutate import mutant_of  # noqa: E402


class Boom(Exception):
    """The planted fault."""


CONFIGS = {  # (pools that preempt: 7 blocks of 4 tokens, 16 tokens a step)
    "tight": dict(num_blocks=7, block_size=4, max_num_batched_tokens=16),
    "no-prefix-cache": dict(num_blocks=7, block_size=4, max_num_batched_tokens=16,
                            enable_prefix_caching=False),
    "swap": dict(num_blocks=7, block_size=4, max_num_batched_tokens=16, preemption_mode="swap"),
}

#: Where a fault is planted: ``point(engine, model) -> (object, attribute)``.
POINTS = {
    "adding the call's requests": lambda e, m: (e, "_add"),
    "schedule": lambda e, m: (e.scheduler, "schedule"),
    "admit policy": lambda e, m: (e.scheduler, "admit"),
    "preemption policy": lambda e, m: (e.scheduler, "choose_victim"),
    "block moves": lambda e, m: (e.runner.cache, "apply_block_ops"),
    "layout": lambda e, m: (e, "_layout"),
    # (after layer 0's K/V are written, before layer 1's; then after both)
    "layer 0 MLP": lambda e, m: (m.model.layers[0].mlp.down_proj, "forward"),
    "layer 1 attention out": lambda e, m: (m.model.layers[1].self_attn.o_proj, "forward"),
    "K/V write": lambda e, m: (runner_module.fused, "rope_write_kv"),
    "prefill kernel": lambda e, m: (runner_module, "paged_prefill"),
    "decode plan": lambda e, m: (runner_module, "plan_decode"),
    "decode kernel": lambda e, m: (runner_module, "paged_attention"),
    "greedy pick": lambda e, m: (m.lm_head, "forward"),
    "update": lambda e, m: (e.scheduler, "update"),
    # (inside update, half-way: the chunks before it recorded, the rest not)
    "update, finishing a request": lambda e, m: (e.scheduler, "_finish"),
}


def plant(mp, obj, name: str, at: int, exc: type[BaseException] = Boom) -> list[int]:
    """Make ``obj.name`` raise ``exc`` on its ``at``-th call; returns the call counter."""
    real, calls = getattr(obj, name), [0]

    def raising(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise exc(f"planted fault: {name}, call {at}")
        return real(*args, **kwargs)

    mp.setattr(obj, name, raising)
    return calls


def fail_once(mp, target: tuple, at: int, exc: type[BaseException], run) -> None:
    """``run()`` while ``target`` (``(object, attribute)``) raises ``exc`` on its ``at``-th
    call (``plant``); the test is skipped where ``run`` calls it fewer times."""
    with mp.context() as inner:
        calls = plant(inner, *target, at, exc)
        try:
            run()
        finally:
            if calls[0] < at:
                pytest.skip(f"{target[1]} is called only {calls[0]} times here")


@pytest.fixture(scope="module")
def case(tiny):
    prompts, outputs = workload(6, tiny.config.vocab_size, seed=23, prompt_mean=10,
                                output_mean=6, max_len=24)
    prompts[3] = prompts[0][:8] + prompts[3]  # shares two blocks with prompt 0
    expected = [hf_greedy(tiny, p, n) for p, n in zip(prompts, outputs, strict=True)]
    fresh = Engine(tiny, **CONFIGS["tight"])
    assert fresh.generate(prompts, outputs, ignore_eos=True) == expected
    assert fresh.stats.preemptions and fresh.stats.cached_tokens
    return prompts, outputs, expected


def survives(engine, model, case, fire) -> None:
    """``fire(engine)`` raises; then the engine must be as a fresh one (module doc)."""
    prompts, outputs, expected = case
    engine.generate(prompts[4:], outputs[4:], ignore_eos=True)  # a used pool
    with pytest.raises((Boom, KeyboardInterrupt)):
        fire(engine)
    assert_idle_and_whole(engine)
    assert_cached_kv_is_written(engine, model)
    assert engine.generate(prompts, outputs, ignore_eos=True) == expected
    assert_idle_and_whole(engine)


def calls_at(point: str) -> tuple[int, ...]:
    return (1, 2) if point == "preemption policy" else (1, 4)


#: Every point twice in the tight pool; the points that change state in the others; Ctrl-C.
STATEFUL = ("admit policy", "preemption policy", "block moves", "layer 0 MLP", "decode kernel",
            "update")
GENERATE_FAULTS = (
    [("tight", point, at, Boom) for point in POINTS for at in calls_at(point)]
    + [(c, point, calls_at(point)[1], Boom) for c in ("no-prefix-cache", "swap")
       for point in STATEFUL]
    + [("tight", point, 4, KeyboardInterrupt) for point in (
        "adding the call's requests", "block moves", "layer 0 MLP", "K/V write",
        "prefill kernel", "decode kernel", "greedy pick", "update", "update, finishing a request")])


@pytest.mark.parametrize("config,point,at,exc", GENERATE_FAULTS,
                         ids=[f"{c}-{p}-{a}-{e.__name__}" for c, p, a, e in GENERATE_FAULTS])
def test_a_fault_in_generate_loses_nothing(tiny, case, monkeypatch, config, point, at, exc):
    engine = Engine(tiny, **CONFIGS[config])
    prompts, outputs, _ = case

    survives(engine, tiny, case, lambda e: fail_once(
        monkeypatch, POINTS[point](e, tiny), at, exc,
        lambda: e.generate(prompts, outputs, ignore_eos=True)))


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt], ids=lambda e: e.__name__)
@pytest.mark.parametrize("at", [1, 3, 9])
def test_a_fault_in_on_step_loses_nothing(tiny, case, at, exc):
    prompts, outputs, _ = case

    def on_step(event):
        if event.step == at - 1:
            raise exc("planted fault: on_step")

    survives(Engine(tiny, **CONFIGS["tight"]), tiny, case,
             lambda e: e.generate(prompts, outputs, ignore_eos=True, on_step=on_step))


@pytest.mark.parametrize("exc", [Boom, KeyboardInterrupt], ids=lambda e: e.__name__)
def test_a_fault_in_the_sampler_loses_nothing(tiny, case, monkeypatch, exc):
    prompts, outputs, _ = case
    engine = Engine(tiny, **CONFIGS["tight"])

    def fire(engine):
        with monkeypatch.context() as mp:
            plant(mp, runner_module, "sample", 3, exc)
            for p in prompts:
                engine.add_request(p, SamplingParams(max_tokens=6, temperature=0.7, seed=1))
            try:
                while engine.has_unfinished_requests():
                    engine.step()
            finally:
                for rid in list(engine.requests):
                    engine.abort(rid)

    survives(engine, tiny, case, fire)


def greedy(n: int, i: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def seeded(n: int, i: int) -> SamplingParams:
    """Request ``i`` samples (its own seed: its tokens do not depend on what else runs)."""
    return SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, seed=40 + i)


def run_to_end(engine, outputs: dict, delivered: dict) -> None:
    """Step until nothing is unfinished; each finished request's tokens into ``outputs``, each
    step's new tokens appended to ``delivered``."""
    while engine.has_unfinished_requests():
        for o in engine.step():
            delivered.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                outputs[o.request_id] = o.output_token_ids


@pytest.fixture(scope="module")
def seeded_expected(tiny, case):
    """A fresh engine's tokens for each of ``case``'s first six prompts alone, ``seeded``."""
    prompts, outputs, _ = case
    out = []
    for i, (p, n) in enumerate(zip(prompts[:6], outputs[:6], strict=True)):
        engine, got = Engine(tiny, num_blocks=32, block_size=4), {}
        rid = engine.add_request(p, seeded(n, i))
        run_to_end(engine, got, {})
        out.append(got[rid])
    return out


#: The points of a step an online request crosses (the sampler: with ``seeded`` requests).
ONLINE_POINTS = ["admit policy", "preemption policy", "layer 0 MLP", "decode kernel", "update",
                 "update, finishing a request", "sampler"]


def online_fault(engine, model, case, mp, point, at, exc=Boom, expected=None):
    """Six requests stepping (``seeded`` ones for the sampler, which ``expected`` then
    holds); a fault at ``point``'s ``at``-th call. Checks the module doc's online promises, and
    that each finished request's output is the tokens its steps delivered (none skipped, none
    past ``max_tokens``); returns the aborted requests."""
    prompts, outputs, hf = case
    params = seeded if point == "sampler" else greedy
    expected = hf if expected is None else expected
    ids = [engine.add_request(p, params(n, i))
           for i, (p, n) in enumerate(zip(prompts[:6], outputs[:6], strict=True))]
    where = (runner_module, "sample") if point == "sampler" else POINTS[point](engine, model)
    calls, delivered, final = plant(mp, *where, at, exc), {}, {}
    for _ in range(200):
        before = {rid: r.num_computed for rid, r in engine.requests.items()}
        try:
            outs = engine.step()
        except exc:
            break
        assert calls[0] < at
        for o in outs:
            delivered.setdefault(o.request_id, []).extend(o.new_token_ids)
    else:
        pytest.skip(f"{point} is called only {calls[0]} times")
    mp.undo()
    m = engine.scheduler.manager
    aborted = [rid for rid in before if rid not in engine.requests]
    for rid, r in engine.requests.items():  # (as before, or preempted by the failed step)
        assert r.num_computed == before[rid] or (r.num_computed == 0 and rid not in m), (
            f"survivor {rid}'s computed tokens changed")
    for r in engine.scheduler.running:
        assert m.seq_len(r.req_id) == r.num_computed, f"request {r.req_id} is ahead of its K/V"
    assert_cached_kv_is_written(engine, model)
    run_to_end(engine, final, delivered)
    assert all(final[rid] == expected[ids.index(rid)] for rid in final)
    again = [engine.add_request(prompts[ids.index(rid)], params(outputs[ids.index(rid)],
                                                                ids.index(rid)))
             for rid in aborted]
    run_to_end(engine, final, delivered)
    assert [final[rid] for rid in again] == [expected[ids.index(rid)] for rid in aborted]
    for rid, tokens in final.items():
        assert delivered[rid] == tokens, f"request {rid}: delivered {delivered[rid]}, " \
                                         f"finished with {tokens}"
    assert_idle_and_whole(engine)
    return aborted


@pytest.mark.parametrize("point,at", [(p, at) for p in ONLINE_POINTS for at in (
    (1, 2) if p == "preemption policy" else (2, 5))])
def test_a_fault_in_step_aborts_the_scheduled_requests_only(tiny, case, seeded_expected,
                                                           monkeypatch, point, at):
    engine = Engine(tiny, **CONFIGS["tight"], max_num_seqs=4)
    expected = seeded_expected if point == "sampler" else None
    with monkeypatch.context() as mp:
        aborted = online_fault(engine, tiny, case, mp, point, at, expected=expected)
    assert aborted or point in ("admit policy", "preemption policy")


@pytest.mark.parametrize("point", ["layer 0 MLP", "update, finishing a request", "sampler"])
def test_ctrl_c_in_step_aborts_the_scheduled_requests_only(tiny, case, seeded_expected,
                                                            monkeypatch, point):
    engine = Engine(tiny, **CONFIGS["tight"], max_num_seqs=4)
    expected = seeded_expected if point == "sampler" else None
    with monkeypatch.context() as mp:
        assert online_fault(engine, tiny, case, mp, point, 3, KeyboardInterrupt, expected)


# ---- issue 36's scenarios 4 and 5 planted back: the checks above must fail ----------------

ADD_INSIDE = ("    try:  # (adding too: a Ctrl-C half-way must not leave the first prompts "
              "queued)\n        for i, (p, n) in enumerate(checked):\n")
INDEX = ("        index = {r.req_id + j: i if r.params.n == 1 else (i, j)  # (sample j of n: "
         "id + j)\n                 for i, r in reqs.items() for j in range(r.params.n)}\n")
PLANTED = {
    "4: a failed step leaves its requests' blocks ahead of their K/V (no rollback)": (
        engine_module, [("                sched.rollback(out)\n", "")], "online"),
    "4: a failed schedule keeps the slots it took (no rollback)": (
        scheduler_module, [("            self.rollback()\n", "            pass\n")], "admit"),
    "4: an update that failed half-way leaves the requests it recorded running": (
        scheduler_module, [("if out is not None else set()", "if False else set()")],
        "half-way"),
    "5: generate adds its requests before its try (a fault while adding leaves them)": (
        offline_module, [(ADD_INSIDE, "    if True:\n" + ADD_INSIDE.split("\n", 1)[1]),
                         (INDEX, INDEX + "    try:\n")], "adding"),
    "4: an abort keeps the hashes of blocks never written": (
        scheduler_module, [('self._finish(req, "abort", num_computed=req.num_computed)',
                            'self._finish(req, "abort")')], "layer"),
    "5: an exception in generate (on_step) leaves its requests inside": (
        offline_module, [("        for r in reqs.values():\n            engine.abort(r.req_id)"
                          "\n", "        pass\n")], "on_step"),
}


@pytest.mark.parametrize("name", PLANTED)
def test_planted_scenario_is_caught(tiny, case, monkeypatch, tmp_path, name):
    module, edits, scenario = PLANTED[name]
    mutant = mutant_of(module, edits, tmp_path, monkeypatch)
    if module is scheduler_module:
        monkeypatch.setattr(engine_module, "Scheduler", mutant.Scheduler)
        cls = Engine
    elif module is offline_module:  # (generate is paged_ref.offline's)
        monkeypatch.setattr(Engine, "generate", mutant.generate)
        cls = Engine
    else:
        cls = mutant.Engine
    engine = cls(tiny, **CONFIGS["tight"], max_num_seqs=4)
    prompts, outputs, _ = case
    with pytest.raises((AssertionError, RuntimeError, ValueError)) as caught:
        with monkeypatch.context() as mp:
            if scenario == "online":
                online_fault(engine, tiny, case, mp, "layer 0 MLP", 3)
            elif scenario == "admit":
                online_fault(engine, tiny, case, mp, "admit policy", 2)
            elif scenario == "half-way":
                online_fault(engine, tiny, case, mp, "update, finishing a request", 2)
            elif scenario == "adding":
                survives(engine, tiny, case, lambda e: (plant(mp, e, "_add", 4), e.generate(
                    prompts, outputs, ignore_eos=True)))
            elif scenario == "layer":
                survives(engine, tiny, case, lambda e: (plant(
                    mp, *POINTS["layer 0 MLP"](e, tiny), 1), e.generate(
                    prompts, outputs, ignore_eos=True)))
            else:
                def on_step(event):
                    raise Boom("planted fault: on_step")
                survives(engine, tiny, case, lambda e: e.generate(prompts, outputs,
                                                                  ignore_eos=True,
                                                                  on_step=on_step))
    print(f"caught: {caught.value!r}"[:300])


def test_hashes_of_a_failed_prefill_are_dropped(tiny, case, monkeypatch):
    """Scenario 4's last symptom: a prompt that failed in its prefill (layer 1's K/V never
    written) must not serve its blocks to the next request with the same prompt."""
    prompts, outputs, expected = case
    engine = Engine(tiny, num_blocks=32, block_size=4)
    with monkeypatch.context() as mp:
        plant(mp, *POINTS["layer 0 MLP"](engine, tiny), 1)
        with pytest.raises(Boom):
            engine.generate(prompts[:1], outputs[:1], ignore_eos=True)
    assert not engine.scheduler.manager.cached_blocks()
    assert engine.generate(prompts[:1], outputs[:1], ignore_eos=True) == expected[:1]
    assert engine.stats.cached_tokens == 0
    assert assert_cached_kv_is_written(engine, tiny) >= len(prompts[0]) // 4
    assert engine.generate(prompts[:1], outputs[:1], ignore_eos=True) == expected[:1]
    assert engine.stats.cached_tokens > 0
