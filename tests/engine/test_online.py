"""The online engine (``add_request`` / ``step`` / ``abort`` / ``has_unfinished_requests``) on the
tiny random Llama: requests that join a running batch get the tokens they get alone, an abort
frees everything, per-request timing, and the paper's reservation baselines in the same engine."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from paged_bench.engine import workload  # noqa: E402
from paged_ref.cache_math import blocks_needed  # noqa: E402
from paged_ref.engine import Engine, RequestOutput, SamplingParams  # noqa: E402
from tests.engine.checks import (  # noqa: E402
    assert_cached_kv_is_written,
    assert_idle_and_whole,
    hf_greedy,
)

CONFIGS = {
    "roomy": dict(num_blocks=64, block_size=4),
    "no-prefix-cache": dict(num_blocks=64, block_size=4, enable_prefix_caching=False),
    "preempting": dict(num_blocks=14, block_size=4, max_num_batched_tokens=24),
    "swap": dict(num_blocks=14, block_size=4, max_num_batched_tokens=24,
                 preemption_mode="swap"),
    "chunked": dict(num_blocks=64, block_size=4, max_num_batched_tokens=7, max_num_seqs=3),
}


@pytest.fixture(scope="module")
def case(tiny):
    prompts, outputs = workload(10, tiny.config.vocab_size, seed=11, prompt_mean=14,
                                output_mean=8, max_len=30)
    prompts[3] = prompts[0][:8] + prompts[3]  # a shared first two blocks: prefix-cache hits
    return prompts, outputs, [hf_greedy(tiny, p, n) for p, n in zip(prompts, outputs,
                                                                     strict=True)]


def params(n, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def drain(engine, streams, *, joining=(), max_steps=500):
    """Step ``engine`` until it is done, adding ``joining`` (``(step, prompt, n)``) on the way;
    ``streams`` collects each request's new tokens. Returns ``{request id: final output}``."""
    final, joining = {}, list(joining)
    for step in range(max_steps):
        for _, prompt, n in [j for j in joining if j[0] == step]:
            streams[engine.add_request(prompt, params(n))] = []
        joining = [j for j in joining if j[0] > step]
        if not engine.has_unfinished_requests() and not joining:
            return final
        for out in engine.step():
            assert isinstance(out, RequestOutput) and len(out.new_token_ids) == 1
            streams[out.request_id] += out.new_token_ids
            assert out.output_token_ids == streams[out.request_id]
            assert out.finished == (out.request_id not in engine.requests)
            if out.finished:
                assert out.finish_reason == "length"
                final[out.request_id] = out.output_token_ids
        check_between_steps(engine)
    raise AssertionError("no progress")


def check_between_steps(engine):
    """Between steps every running request's blocks hold exactly its computed tokens."""
    m = engine.scheduler.manager
    for r in engine.scheduler.running:
        assert m.seq_len(r.req_id) == r.num_computed, f"request {r.req_id} is ahead"
    assert set(engine.requests) == {r.req_id for r in (*engine.scheduler.waiting,
                                                        *engine.scheduler.running)}


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_requests_joining_mid_run_get_the_tokens_they_get_alone(tiny, case, config):
    prompts, outputs, expected = case
    engine = Engine(tiny, **config)
    streams = {}
    first = [engine.add_request(p, params(n)) for p, n in zip(prompts[:4], outputs[:4],
                                                               strict=True)]
    for rid in first:
        streams[rid] = []
    rng = random.Random(5)
    joining = sorted((rng.randint(1, 12), p, n) for p, n in zip(prompts[4:], outputs[4:],
                                                                  strict=True))
    final = drain(engine, streams, joining=joining)
    order = [prompts.index(p) for _, p, _ in joining]
    got = [final[rid] for rid in first] + [final[rid] for rid in range(4, 10)]
    assert got == [expected[i] for i in [0, 1, 2, 3, *order]]
    assert_idle_and_whole(engine)


def test_has_unfinished_requests_and_empty_steps(tiny, case):
    prompts, outputs, _ = case
    engine = Engine(tiny, num_blocks=32, block_size=4)
    assert not engine.has_unfinished_requests() and engine.step() == []
    rid = engine.add_request(prompts[0], params(2))
    assert engine.has_unfinished_requests() and rid == 0
    assert engine.step()[0].finished is False and engine.step()[0].finished is True
    assert not engine.has_unfinished_requests() and engine.step() == []


@pytest.mark.parametrize("config", ["roomy", "no-prefix-cache", "swap", "chunked"])
def test_abort_frees_everything(tiny, case, config):
    """Abort a waiting request, one in the middle of its (chunked) prefill and one decoding:
    each gives back all it holds, the others' tokens do not change, and what the aborted ones
    left in the prefix cache is written K/V that a later request may hit."""
    prompts, outputs, expected = case
    engine = Engine(tiny, **{**CONFIGS[config], "max_num_batched_tokens": 7, "max_num_seqs": 3})
    ids = [engine.add_request(p, params(n)) for p, n in zip(prompts[:5], outputs[:5],
                                                             strict=True)]
    engine.step()
    mid_prefill = next(r for r in engine.scheduler.running if r.num_computed < len(r.prompt))
    waiting = engine.scheduler.waiting[-1]
    engine.abort(waiting.req_id)
    engine.abort(mid_prefill.req_id)
    while not any(r.output for r in engine.scheduler.running):
        engine.step()
    decoding = next(r for r in engine.scheduler.running if r.output)
    engine.abort(decoding.req_id)
    for r in (waiting, mid_prefill, decoding):
        assert r.finish_reason == "abort" and r.req_id not in engine.requests
        assert r.req_id not in engine.scheduler.manager
    streams = {rid: list(engine.requests[rid].output) for rid in engine.requests}
    final = drain(engine, streams)
    for rid, out in final.items():
        assert out == expected[ids.index(rid)]
    assert_idle_and_whole(engine)
    if engine.scheduler.manager.enable_prefix_caching:
        assert assert_cached_kv_is_written(engine, tiny) > 0
    again = [engine.add_request(prompts[ids.index(r.req_id)], params(outputs[ids.index(
        r.req_id)])) for r in (waiting, mid_prefill, decoding)]
    final = drain(engine, {rid: [] for rid in again})
    assert [final[rid] for rid in again] == [expected[ids.index(r.req_id)]
                                             for r in (waiting, mid_prefill, decoding)]


def test_abort_of_unknown_and_finished_ids(tiny, case):
    prompts, _, _ = case
    engine = Engine(tiny, num_blocks=32, block_size=4)
    rid = engine.add_request(prompts[0], params(1))
    engine.step()
    engine.abort(rid)  # finished: nothing to do
    engine.abort(rid)
    for bad in (1, -1, "0", None):
        with pytest.raises(ValueError, match="unknown request id"):
            engine.abort(bad)
    assert_idle_and_whole(engine)


def test_request_metrics(tiny, case):
    prompts, _, _ = case
    engine = Engine(tiny, num_blocks=32, block_size=4)
    import time

    t0 = time.perf_counter() - 5.0  # it arrived 5 s ago
    rid = engine.add_request(prompts[0], params(4), arrival_time=t0)
    outs = [o for _ in range(4) for o in engine.step()]
    m = outs[-1].metrics
    assert outs[-1].request_id == rid and len(m.token_times) == 4
    assert m.first_scheduled >= t0 + 5.0 and m.ttft >= 5.0
    assert m.tpot == pytest.approx((m.token_times[-1] - m.token_times[0]) / 3)
    assert m.e2e == pytest.approx(m.finished - t0) and m.e2e >= m.ttft
    assert m.normalized_latency == pytest.approx(m.e2e / 4)
    got = engine.generate(prompts[:2], [3, 1], ignore_eos=True)
    s = engine.stats
    assert [len(x) for x in got] == [3, 1] and s.metrics[1].tpot is None
    assert s.ttft_s == [x.ttft for x in s.metrics] and all(t > 0 for t in s.ttft_s)
    with pytest.raises(TypeError, match="arrival_time"):
        engine.add_request(prompts[0], arrival_time="now")


def test_generate_refuses_while_online_requests_run(tiny, case):
    prompts, _, _ = case
    engine = Engine(tiny, num_blocks=32, block_size=4)
    engine.add_request(prompts[0], params(3))
    with pytest.raises(RuntimeError, match="abort the 1 requests"):
        engine.generate(prompts[:1], 2)
    assert len(engine.requests) == 1


def test_stop_token_ids_and_eos(tiny, case):
    prompts, outputs, expected = case
    engine = Engine(tiny, num_blocks=32, block_size=4)
    greedy = hf_greedy(tiny, prompts[1], 8)
    stop = greedy[-1]
    cut = greedy.index(stop) + 1
    rid = engine.add_request(prompts[1], SamplingParams(max_tokens=8, stop_token_ids=[stop],
                                                        ignore_eos=True))
    outs = [o for _ in range(8) for o in engine.step() if o.request_id == rid]
    assert outs[-1].output_token_ids == greedy[:cut] and outs[-1].finish_reason == "stop"
    eos = Engine(tiny, num_blocks=32, block_size=4, eos_token_id=torch.tensor(stop))
    assert eos.generate([prompts[1]], 8) == [greedy[:cut]]
    assert eos.generate([prompts[1]], 8, ignore_eos=True) == [greedy]


# ---- the paper's baselines: reservation inside the same engine ----------------------------


@pytest.mark.parametrize("policy,held,free_after_first_step", [
    ("paged", 14, 40 - 14 * 2),  # blocks on demand: each 6-token prompt takes 2 blocks
    ("reserve_max", 2, 40 - 2 * 16),  # max_model_len 64 = 16 blocks each
    ("reserve_pow2", 6, 40 - 6 * 6),  # 6 + 16 (next power of two of 10) = 22 tokens: 6 blocks
    ("reserve_oracle", 10, 40 - 10 * 4),  # 6 + 10 = 16 tokens: 4 blocks
])
def test_reservation_holds_the_hand_counted_requests(tiny, policy, held, free_after_first_step):
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 256, (6,), generator=gen).tolist() for _ in range(14)]
    engine = Engine(tiny, num_blocks=40, block_size=4, max_model_len=64, reservation=policy,
                    enable_prefix_caching=False)
    events = []
    got = engine.generate(prompts, 10, ignore_eos=True, on_step=events.append)
    assert engine.stats.max_running == held
    assert events[0].num_free_blocks == free_after_first_step, "reserved blocks are taken"
    if policy != "paged":  # a reservation pays for the blocks its request grows into
        each = (40 - free_after_first_step) // held
        assert [e.num_free_blocks for e in events] == [40 - each * len(e.block_tables)
                                                       for e in events]
    assert (engine.stats.preemptions > 0) == (policy == "paged")
    assert got == [hf_greedy(tiny, p, 10) for p in prompts]
    assert_idle_and_whole(engine)


@pytest.mark.parametrize("policy", ["reserve_max", "reserve_pow2", "reserve_oracle"])
def test_reservation_outputs_equal_paged_under_every_config(tiny, case, policy):
    prompts, outputs, expected = case
    for config in (CONFIGS["chunked"], dict(num_blocks=30, block_size=4)):
        engine = Engine(tiny, **config, reservation=policy, max_model_len=40)
        assert engine.generate(prompts, outputs, ignore_eos=True) == expected
        assert_idle_and_whole(engine)


def test_reservation_that_can_never_fit_is_refused(tiny):
    engine = Engine(tiny, num_blocks=8, block_size=4, max_model_len=64,
                    reservation="reserve_max")
    with pytest.raises(ValueError, match="can never fit"):
        engine.add_request([5, 6, 7], params(2))
    assert blocks_needed(64, 4) > 8 and not engine.requests
    with pytest.raises(ValueError, match="reservation"):
        Engine(tiny, num_blocks=8, reservation="orca")


def test_bench_fit_sweep_runs_the_real_reservation(tiny):
    """``paged_bench.engine.fit_sweep``'s reserve-max rows come from ``reservation=
    "reserve_max"``: a 512-token budget holds 512 // 256 requests of max_len 256."""
    from paged_bench.engine import fit_sweep

    rows = fit_sweep(tiny, [512], n=8, seed=0, max_len=256, block_size=4)
    held = {r["mode"]: r["max_requests_held"] for r in rows}
    assert held["reserve_max"] == 512 // 256 < held["paged"]
