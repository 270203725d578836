"""Serving workloads: Poisson arrivals, ShareGPT-like and Alpaca-like lengths, replayable traces.

A *trace* is a list of requests, each with an arrival time (seconds from the start), a prompt
length and an output length (its true length: the request runs with ``ignore_eos`` and
``max_tokens`` = that length, as in the PagedAttention paper's experiments). Prompt token ids
are not stored: request ``i`` of a trace with seed ``s`` has the ids
``numpy.random.default_rng([s, i]).integers(3, vocab_size, prompt_len)`` (ids 0-2 are left out:
padding, BOS and EOS in Llama-family vocabularies), so a trace file is a few numbers a line and
the same trace gives the same prompts on every machine.

Arrivals: the gaps between requests are independent exponentials of mean ``1 / rate``
(a Poisson process of rate ``rate`` requests/s), drawn as ``Exp(1) / rate`` from the seed, so
traces of one seed at two rates hold the same requests in the same order, with every gap scaled
(:meth:`Trace.at_rate`): a sweep over rates changes only the load.

Lengths (:data:`LENGTHS`): lognormal with the means the paper reports for its two datasets
(Kwon et al., SOSP 2023, §6.1 and Fig. 11: ShareGPT 161.31 input / 337.99 output tokens, Alpaca
19.31 / 58.45) and a log-spread ``sigma = 1`` (lesson 01's
:func:`paged_course.simulate.sample_requests`), clipped so that prompt + output fits ``max_len``.
:func:`length_table` prints the parameters and the means a trace has next to the paper's.

A shared-prefix trace (:func:`make_shared_prefix_trace`, for prefix-aware scheduling): a few
system prompts and multi-turn chats, each turn's prompt the chat so far plus a new user turn;
its prompt ids are built from those parts (:meth:`SharedPrefixTrace.prompt_ids`).

The file format (JSON lines, :func:`save_trace` / :func:`load_trace`)::

    {"format": "paged-course-trace/1", "dataset": "ShareGPT-like", "rate_rps": 2.0, "seed": 0,
     "max_len": 1024, "prompt_ids": "numpy.random.default_rng([seed, i]).integers(3, ..."}
    {"arrival_s": 0.412, "prompt_len": 97, "output_len": 211}
    ...
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from paged_course.sharing_sim import DATASETS, dataset

FORMAT = "paged-course-trace/1"
PROMPT_IDS = "numpy.random.default_rng([seed, i]).integers(3, vocab_size, prompt_len)"
#: Lognormal log-spread of both lengths (lesson 01's ``sample_requests`` default).
SIGMA = 1.0
#: Per dataset: (prompt mean, output mean) in tokens, the paper's (Kwon et al., SOSP 2023).
LENGTHS = DATASETS


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: when it arrives (s), its prompt and true output length (tokens)."""

    arrival_s: float
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Trace:
    """Requests in arrival order, with what derives their prompt ids (``seed``)."""

    requests: tuple[TraceRequest, ...]
    dataset: str
    rate_rps: float
    seed: int
    max_len: int

    def __len__(self) -> int:
        return len(self.requests)

    def prompt_ids(self, i: int, vocab_size: int) -> list[int]:
        """Token ids of request ``i``'s prompt (see the module doc), ints in ``[3, vocab_size)``."""
        if vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4, got {vocab_size}")
        rng = np.random.default_rng([self.seed, i])
        return rng.integers(3, vocab_size, self.requests[i].prompt_len).tolist()

    def at_rate(self, rate_rps: float) -> Trace:
        """The same requests arriving at ``rate_rps``: every arrival time scaled by
        ``self.rate_rps / rate_rps``."""
        check_rate(rate_rps)
        k = self.rate_rps / rate_rps
        return replace(self, rate_rps=float(rate_rps), requests=tuple(
            replace(r, arrival_s=r.arrival_s * k) for r in self.requests))

    def head(self, n: int) -> Trace:
        """The first ``n`` requests (the same arrivals and lengths; ``n`` from 1 to len)."""
        if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= len(self):
            raise ValueError(f"n must be an int from 1 to {len(self)}, got {n!r}")
        return replace(self, requests=self.requests[:n])

    @property
    def duration_s(self) -> float:
        """The last arrival (s)."""
        return self.requests[-1].arrival_s if self.requests else 0.0


def check_rate(rate_rps: float) -> float:
    if isinstance(rate_rps, bool) or not isinstance(rate_rps, (int, float)):
        raise TypeError(f"rate_rps must be a number, got {type(rate_rps).__name__}")
    if not (rate_rps > 0 and math.isfinite(rate_rps)):
        raise ValueError(f"rate_rps must be a finite number > 0, got {rate_rps}")
    return float(rate_rps)


def poisson_arrivals(n: int, rate_rps: float, seed: int = 0) -> np.ndarray:
    """Arrival times (s, float64 ``[n]``, increasing) of a Poisson process of rate ``rate_rps``
    requests/s: cumulative sums of exponential gaps of mean ``1 / rate_rps``; the first request
    arrives after one gap. Deterministic for a seed; the gaps are ``Exp(1) / rate_rps``."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"n must be an int >= 0, got {n!r}")
    rate = check_rate(rate_rps)
    gaps = np.random.default_rng([seed, 1]).exponential(1.0, n)  # (stream 1: the lengths use 0)
    return np.cumsum(gaps) / rate


def make_trace(name: str, n: int, rate_rps: float, seed: int = 0, max_len: int = 1024) -> Trace:
    """``n`` requests of dataset ``name`` (:data:`LENGTHS`) arriving at ``rate_rps`` requests/s.

    Args:
        name: ``"ShareGPT-like"`` or ``"Alpaca-like"``.
        n: requests (>= 1).
        rate_rps: mean arrival rate, requests/s (> 0).
        seed: draws the lengths, the gaps and the prompt ids.
        max_len: prompt + output <= max_len tokens (the engine's ``max_model_len``).

    Raises:
        ValueError: an unknown name, ``n < 1``, a rate that is not > 0, ``max_len < 2``.
    """
    reqs = dataset(name, n, seed=seed, max_len=max_len)
    arrivals = poisson_arrivals(n, rate_rps, seed)
    return Trace(tuple(TraceRequest(float(t), int(p), int(o)) for t, p, o in
                       zip(arrivals, reqs.prompt, reqs.output, strict=True)),
                 name, float(rate_rps), int(seed), int(max_len))


def length_table(n: int = 10_000, seed: int = 0, max_len: int = 1024) -> list[dict]:
    """Per dataset: the lognormal's parameters (``mu`` of each log-length, ``sigma``), the
    paper's means and the means of ``n`` sampled requests (after clipping to ``max_len``)."""
    rows = []
    for name, (p_mean, o_mean) in LENGTHS.items():
        r = dataset(name, n, seed=seed, max_len=max_len)
        rows.append({"dataset": name, "sigma": SIGMA,
                     "mu prompt": round(math.log(p_mean) - SIGMA**2 / 2, 3),
                     "mu output": round(math.log(o_mean) - SIGMA**2 / 2, 3),
                     "paper mean in / out": f"{p_mean} / {o_mean}",
                     f"ours (max_len {max_len}) in / out":
                         f"{r.prompt.mean():.1f} / {r.output.mean():.1f}"})
    return rows


def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write ``trace`` as JSON lines (a header, then one line per request); returns the path.
    TypeError for a :class:`SharedPrefixTrace` (the format cannot say which prompts share)."""
    if isinstance(trace, SharedPrefixTrace):
        raise TypeError("save_trace writes plain traces; rebuild a shared-prefix trace from its "
                        "make_shared_prefix_trace arguments instead")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    head = {"format": FORMAT, "dataset": trace.dataset, "rate_rps": trace.rate_rps,
            "seed": trace.seed, "max_len": trace.max_len, "prompt_ids": PROMPT_IDS}
    lines = [json.dumps(head)] + [json.dumps({"arrival_s": r.arrival_s, "prompt_len":
                                              r.prompt_len, "output_len": r.output_len})
                                  for r in trace.requests]
    path.write_text("\n".join(lines) + "\n")
    return path


def load_trace(path: str | Path) -> Trace:
    """Read a file :func:`save_trace` wrote.

    Raises:
        ValueError: not that format, or a request line without its three fields, lengths
            < 1, or arrivals that go back in time.
    """
    lines = [ln for ln in Path(path).read_text().splitlines() if ln.strip()]
    if not lines:
        raise ValueError(f"{path}: empty trace file")
    head = json.loads(lines[0])
    if head.get("format") != FORMAT:
        raise ValueError(f"{path}: not a {FORMAT} file (header {lines[0][:80]!r})")
    reqs = []
    for k, line in enumerate(lines[1:], 2):
        row = json.loads(line)
        try:
            req = TraceRequest(float(row["arrival_s"]), int(row["prompt_len"]),
                               int(row["output_len"]))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{path}:{k}: a request needs arrival_s, prompt_len, output_len "
                             f"({err})") from None
        if req.prompt_len < 1 or req.output_len < 1:
            raise ValueError(f"{path}:{k}: lengths must be >= 1, got {row}")
        if reqs and req.arrival_s < reqs[-1].arrival_s:
            raise ValueError(f"{path}:{k}: arrivals must not decrease")
        reqs.append(req)
    return Trace(tuple(reqs), head["dataset"], float(head["rate_rps"]), int(head["seed"]),
                 int(head["max_len"]))


# ---- a shared-prefix workload: system prompts and multi-turn chats ---------------------------

#: Its name (``Trace.dataset``) and its shape's defaults (:func:`make_shared_prefix_trace`).
SHARED_PREFIX = "shared-prefix"
CHAT_SIGMA = 0.5  #: the lognormal log-spread of user turns and replies


@dataclass(frozen=True)
class Chat:
    """One conversation: its system prompt (an index) and per turn the user's and the reply's
    lengths (tokens; the reply is the request's output)."""

    system: int
    user_lens: tuple[int, ...]
    output_lens: tuple[int, ...]


@dataclass(frozen=True)
class SharedPrefixTrace(Trace):
    """A :class:`Trace` whose prompts share prefixes: request ``i`` is turn ``turns[i][1]`` of
    chat ``turns[i][0]``; its prompt is the chat's system prompt, then for each earlier turn
    the user's text and the reply, then this turn's user text."""

    system_lens: tuple[int, ...] = ()
    chats: tuple[Chat, ...] = ()
    turns: tuple[tuple[int, int], ...] = ()

    def prompt_ids(self, i: int, vocab_size: int) -> list[int]:
        """Request ``i``'s prompt, ids in ``[3, vocab_size)``: system prompt ``s`` is
        ``default_rng([seed, 10, s])``'s draw, user turn ``k`` of chat ``c`` ``[seed, 11, c,
        k]``'s, its reply ``[seed, 12, c, k]``'s (a stand-in for what the model said: the
        engine caches its own reply under other ids, so only earlier *prompts* can hit)."""
        if vocab_size < 4:
            raise ValueError(f"vocab_size must be >= 4, got {vocab_size}")
        c, k = self.turns[i]
        chat = self.chats[c]

        def ids(n: int, *stream: int) -> list[int]:
            return np.random.default_rng([self.seed, *stream]).integers(3, vocab_size, n).tolist()

        out = ids(self.system_lens[chat.system], 10, chat.system)
        for j in range(k):
            out += ids(chat.user_lens[j], 11, c, j) + ids(chat.output_lens[j], 12, c, j)
        return out + ids(chat.user_lens[k], 11, c, k)


def make_shared_prefix_trace(n: int, rate_rps: float, seed: int = 0, max_len: int = 2048, *,
                             num_systems: int = 4, system_len: tuple[int, int] = (200, 800),
                             max_turns: int = 4, user_mean: float = 64.0,
                             output_mean: float = 128.0,
                             think_gaps: float = 10.0) -> SharedPrefixTrace:
    """``n`` requests of multi-turn chats over ``num_systems`` system prompts, ~``rate_rps``
    requests/s (the ``n`` earliest arrivals of the chats drawn).

    Args:
        n: requests (>= 1).
        rate_rps: mean request rate, requests/s (> 0): chats start as a Poisson process of
            rate ``rate_rps / mean turns``.
        seed: draws everything (lengths, arrivals, ids).
        max_len: prompt + output <= max_len tokens (a chat ends at the turn that would not fit).
        num_systems: system prompts, each of a length uniform in ``system_len`` (tokens); a
            chat's is drawn uniformly among them.
        max_turns: a chat's turns are uniform in ``1 .. max_turns``.
        user_mean, output_mean: mean tokens of a user turn and a reply (lognormal,
            :data:`CHAT_SIGMA`).
        think_gaps: a user's mean pause between turns (exponential), in mean request gaps
            (``think_gaps / rate_rps`` s), so :meth:`Trace.at_rate` scales it with the rest.

    Raises:
        ValueError: ``n < 1``, a rate not > 0, sizes out of range (a system prompt of
            ``system_len[1]`` plus a one-token turn and reply must fit ``max_len``).
    """
    rate = check_rate(rate_rps)
    lo, hi = system_len
    if n < 1 or num_systems < 1 or max_turns < 1 or not 1 <= lo <= hi or hi + 2 > max_len:
        raise ValueError(f"need n, num_systems, max_turns >= 1 and 1 <= system_len[0] <= "
                         f"system_len[1] <= max_len - 2; got n={n}, num_systems={num_systems}, "
                         f"max_turns={max_turns}, system_len={system_len}, max_len={max_len}")
    rng = np.random.default_rng([seed, 20])
    systems = tuple(int(x) for x in rng.integers(lo, hi + 1, num_systems))
    chat_rate = rate / ((1 + max_turns) / 2)

    def draw(mean: float) -> int:
        return max(1, int(round(rng.lognormal(math.log(mean) - CHAT_SIGMA**2 / 2, CHAT_SIGMA))))

    chats, rows, start = [], [], 0.0  # rows: (arrival, prompt, output, chat, turn)
    while True:
        start += rng.exponential(1.0) / chat_rate
        if len(rows) >= n and start > rows[n - 1][0]:  # (no later chat arrives earlier)
            break
        system, t, users, outs = int(rng.integers(num_systems)), start, [], []
        used = systems[system]
        for k in range(int(rng.integers(1, max_turns + 1))):
            user, out = draw(user_mean), draw(output_mean)
            if used + user + out > max_len:
                break
            users.append(user)
            outs.append(out)
            rows.append((t, used + user, out, len(chats), k))
            used += user + out
            t += rng.exponential(think_gaps) / rate
        chats.append(Chat(system, tuple(users), tuple(outs)))
        rows.sort()
    rows = rows[:n]
    return SharedPrefixTrace(tuple(TraceRequest(float(t), p, o) for t, p, o, _, _ in rows),
                             SHARED_PREFIX, rate, int(seed), int(max_len), systems,
                             tuple(chats), tuple((c, k) for *_, c, k in rows))
