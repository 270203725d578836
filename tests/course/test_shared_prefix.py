"""The shared-prefix workload (``make_shared_prefix_trace``): prompts that share what they
should (a chat's system prompt; each turn the whole conversation before it), lengths and
arrivals as documented, one seed one trace. Then likely mistakes are planted and a check must
fail."""

from __future__ import annotations

import numpy as np
import pytest

from paged_course.serving import workload
from paged_course.serving.workload import SharedPrefixTrace
from tests.mutations.mutate import mutant_of

VOCAB = 512


def check_prompts_share_what_they_should(wl):
    for seed in range(3):
        t = wl.make_shared_prefix_trace(150, 5.0, seed=seed, max_len=1536)
        assert isinstance(t, wl.SharedPrefixTrace) and len(t) == 150
        assert len(t.system_lens) == 4 and all(200 <= n <= 800 for n in t.system_lens)
        prompts = [t.prompt_ids(i, VOCAB) for i in range(len(t))]
        by_turn = {t.turns[i]: i for i in range(len(t))}
        for i, (c, k) in enumerate(t.turns):
            r, chat, p = t.requests[i], t.chats[c], prompts[i]
            assert len(p) == r.prompt_len and r.output_len == chat.output_lens[k]
            assert r.prompt_len + r.output_len <= t.max_len
            assert min(p) >= 3 and max(p) < VOCAB
            system = t.system_lens[chat.system]
            want = sum(chat.user_lens[:k]) + sum(chat.output_lens[:k]) + chat.user_lens[k]
            assert r.prompt_len == system + want
            if k and (c, k - 1) in by_turn:  # this turn extends the last one and its reply
                j = by_turn[c, k - 1]
                assert p[:len(prompts[j])] == prompts[j]
                assert len(p) == len(prompts[j]) + chat.output_lens[k - 1] + chat.user_lens[k]
                assert t.requests[j].arrival_s < r.arrival_s
        firsts = {}
        for i, (c, _) in enumerate(t.turns):
            s = t.chats[c].system
            head = prompts[i][:t.system_lens[s]]
            assert firsts.setdefault(s, head) == head, "one system prompt, one text"
        assert len(firsts) > 1, "chats spread over the system prompts"
        a, b = [i for i in range(len(t)) if t.turns[i][1] == 0 and
                t.chats[t.turns[i][0]].system == t.chats[t.turns[0][0]].system][:2]
        n = t.system_lens[t.chats[t.turns[a][0]].system]
        assert prompts[a][n:n + 8] != prompts[b][n:n + 8], "two chats differ after it"


def check_arrivals_and_rate(wl):
    t = wl.make_shared_prefix_trace(400, 8.0, seed=4)
    arrivals = np.array([r.arrival_s for r in t.requests])
    assert (np.diff(arrivals) >= 0).all() and arrivals[0] > 0
    assert 0.6 < len(t) / t.duration_s / 8.0 < 1.6, len(t) / t.duration_s
    assert max(k for _, k in t.turns) == 3 and min(len(c.user_lens) for c in t.chats) >= 0
    users = [n for c in t.chats for n in c.user_lens]
    outs = [n for c in t.chats for n in c.output_lens]
    assert 50 < np.mean(users) < 80 and 100 < np.mean(outs) < 160
    at = {turn: r.arrival_s for turn, r in zip(t.turns, t.requests, strict=True)}
    think = [at[c, k] - at[c, k - 1] for c, k in at if k and (c, k - 1) in at]
    assert 0.8 < np.mean(think) / (10 / 8.0) < 1.25, "think time: think_gaps mean gaps"
    faster = t.at_rate(16.0)
    assert isinstance(faster, wl.SharedPrefixTrace) and faster.turns == t.turns
    assert np.allclose([r.arrival_s for r in faster.requests], arrivals / 2)
    assert faster.prompt_ids(7, VOCAB) == t.prompt_ids(7, VOCAB)


def check_seeds(wl):
    a, b = (wl.make_shared_prefix_trace(60, 3.0, seed=s) for s in (0, 0))
    assert a == b and a.prompt_ids(5, VOCAB) == b.prompt_ids(5, VOCAB)
    c = wl.make_shared_prefix_trace(60, 3.0, seed=1)
    assert c.requests != a.requests and c.system_lens != a.system_lens


CHECKS = [check_prompts_share_what_they_should, check_arrivals_and_rate, check_seeds]


@pytest.mark.parametrize("check", CHECKS, ids=lambda c: c.__name__)
def test_shared_prefix_trace(check):
    check(workload)


def test_bad_arguments_and_no_plain_file(tmp_path):
    for kw in ({"n": 0}, {"num_systems": 0}, {"max_turns": 0}, {"system_len": (300, 200)},
               {"system_len": (100, 2047)}):
        args = {"n": 10, **kw}
        with pytest.raises(ValueError):
            workload.make_shared_prefix_trace(args.pop("n"), 1.0, **args)
    with pytest.raises(ValueError):
        workload.make_shared_prefix_trace(10, 0.0)
    t = workload.make_shared_prefix_trace(10, 1.0)
    with pytest.raises(TypeError, match="shared-prefix"):
        workload.save_trace(t, tmp_path / "t.jsonl")
    with pytest.raises(ValueError):
        t.prompt_ids(0, 3)
    assert isinstance(t, SharedPrefixTrace)


MUTATIONS = [
    ("the reply left out of the next turn's prompt",
     [("out += ids(chat.user_lens[j], 11, c, j) + ids(chat.output_lens[j], 12, c, j)",
       "out += ids(chat.user_lens[j], 11, c, j)")]),
    ("each chat its own system prompt text",
     [("out = ids(self.system_lens[chat.system], 10, chat.system)",
       "out = ids(self.system_lens[chat.system], 10, c)")]),
    ("turns of a chat arrive together",
     [("            t += rng.exponential(think_gaps) / rate\n", "")]),
    ("the think time not scaled with the rate",
     [("t += rng.exponential(think_gaps) / rate", "t += rng.exponential(think_gaps)")]),
    ("chats start at the request rate (too many requests a second)",
     [("chat_rate = rate / ((1 + max_turns) / 2)", "chat_rate = rate")]),
]


@pytest.mark.parametrize("description, edits", MUTATIONS, ids=[m[0] for m in MUTATIONS])
def test_planted_mistake_is_caught(description, edits, tmp_path, monkeypatch):
    mutant = mutant_of(workload, edits, tmp_path, monkeypatch)
    failed = 0
    for check in CHECKS:
        try:
            check(mutant)
        except AssertionError:
            failed += 1
    assert failed, f"no check caught {description!r}"
