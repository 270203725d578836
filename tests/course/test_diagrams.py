"""paged_course.diagrams: the timeline of lesson 06 follows its measured durations, and the
pictures of lessons 00 and 09 draw what they are given."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from paged_course import diagrams


def random_steps(rng: random.Random) -> dict:
    steps = {s: rng.uniform(1, 80) for s in diagrams.HOST_STEPS}
    steps["planned_call"] = rng.uniform(20, 90)
    return steps


@pytest.mark.parametrize("seed", range(5))
def test_planned_calls_never_wait_and_kernels_queue_back_to_back(seed):
    rng = random.Random(seed)
    steps, kernel, calls = random_steps(rng), rng.uniform(1, 400), rng.randint(1, 6)
    segs = diagrams.call_timeline(steps, kernel, calls, planned=True)
    host = [s for s in segs if s.lane == "host"]
    gpu = [s for s in segs if s.lane == "GPU"]
    assert [s.label for s in host] == ["planned call"] * calls
    assert host[-1].end == pytest.approx(calls * steps["planned_call"])
    for a, b in zip(gpu, gpu[1:], strict=False):
        assert b.start >= a.end - 1e-9          # one kernel at a time
        assert b.start == pytest.approx(max(a.end, host[b.call].end))
    end = diagrams.timeline_end(segs)
    assert end == pytest.approx(max(calls * kernel + steps["planned_call"],
                                    calls * steps["planned_call"] + kernel))


@pytest.mark.parametrize("seed", range(5))
def test_checks_on_the_host_wait_for_the_previous_kernel(seed):
    rng = random.Random(seed)
    steps, kernel, calls = random_steps(rng), rng.uniform(1, 400), rng.randint(2, 6)
    segs = diagrams.call_timeline(steps, kernel, calls, planned=False)
    gpu = [s for s in segs if s.lane == "GPU"]
    for call in range(1, calls):
        check = next(s for s in segs if s.call == call and s.label == "check_values")
        assert check.start >= gpu[call - 1].end - 1e-9   # the read-back waits for the GPU
    for call in range(calls):   # the GPU is idle by then: each kernel starts at its launch
        launch = next(s for s in segs if s.call == call and s.label == "launch")
        assert gpu[call].start == pytest.approx(launch.end)


def test_a_worked_timeline():
    steps = {"check_shapes": 1, "check_values": 2, "dispatch_and_scratch": 3, "allocate_out": 4,
             "launch": 5, "planned_call": 6}
    segs = diagrams.call_timeline(steps, 100, 2, planned=False)
    # call 0: host 0..15, kernel 15..115; call 1: shapes 15..16, wait 16..115, values
    # 115..117, then 3 + 4 + 5: launch ends at 129; kernel 129..229
    assert diagrams.timeline_end(segs) == 229
    wait = [s for s in segs if s.label == "wait"]
    assert [(s.start, s.end) for s in wait] == [(16, 115)]
    planned = diagrams.call_timeline(steps, 100, 2, planned=True)
    assert diagrams.timeline_end(planned) == 206       # 6 + 2 x 100: the GPU never idles


def test_bad_timeline_arguments_raise():
    with pytest.raises(ValueError, match="kernel_us"):
        diagrams.call_timeline(random_steps(random.Random(0)), -1, planned=True)
    with pytest.raises(ValueError, match="calls"):
        diagrams.call_timeline(random_steps(random.Random(0)), 1, 0, planned=True)


def test_pictures_draw():
    rng = random.Random(3)
    fig = diagrams.draw_call_timeline([("a", random_steps(rng), 20.0),
                                       ("b", random_steps(rng), 240.0)])
    assert len(fig.axes) == 2
    fig = diagrams.draw_program_ids([0] * 8 + [1] * 8 + [2] * 4 + [-1] * 4, 8, 20)
    assert "20 elements written, 4 lanes masked" in fig.axes[0].get_title()
    with pytest.raises(ValueError, match="multiple of block"):
        diagrams.draw_program_ids([0, 0, 1], 2, 3)


def test_engine_loop_shows_the_step():
    event = SimpleNamespace(step=3, ran=[(0, 40, 1), (1, 37, 1), (2, 0, 64)], admitted=[2],
                            preempted=[], finished=[1], new_tokens={0: 11, 1: 12},
                            num_free_blocks=40, num_tokens=66)
    facts = diagrams.loop_facts(event, num_layers=30)
    assert facts["schedule"].startswith("1 prefill chunk(s), 2 decode(s)")
    assert "admitted [2]" in facts["schedule"] and "finished [1]" in facts["update"]
    assert facts["layout"] == "66 tokens, 3 requests"
    fig = diagrams.draw_engine_loop(event, num_layers=30)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "30 layers, once over 66 tokens" in texts and "step 3 of a run" in texts


MISTAKES = [
    ("the read-back does not wait for the GPU",
     'if step == "check_values" and gpu_free > host:', "if False:",
     "test_checks_on_the_host_wait_for_the_previous_kernel or test_a_worked_timeline"),
    ("a kernel starts before the GPU is free", "start = max(host, gpu_free)", "start = host",
     "test_planned_calls_never_wait_and_kernels_queue_back_to_back"),
]


@pytest.mark.parametrize("mistake", MISTAKES, ids=lambda m: m[0])
def test_planted_timeline_mistakes_are_caught(mistake, tmp_path, monkeypatch):
    from tests.mutations.mutate import mutant_of

    _, old, new, keyword = mistake
    mutant = mutant_of(diagrams, [(old, new)], tmp_path, monkeypatch)
    monkeypatch.setattr(__import__(__name__, fromlist=["diagrams"]), "diagrams", mutant)
    failed = 0
    for name in keyword.split(" or "):
        test = globals()[name]
        cases = [{"seed": s} for s in range(5)] if "seed" in test.__code__.co_varnames else [{}]
        for kwargs in cases:
            try:
                test(**kwargs)
            except AssertionError:
                failed += 1
    assert failed, f"no test caught: {mistake[0]}"
