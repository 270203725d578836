"""Beam search bookkeeping for one prompt: which beams survive a step, their scores, the finished
hypotheses -- transformers' ``generate(num_beams=k, do_sample=False)`` (its vectorised beam
search, 5.x), in plain Python and without a model.

A step, with ``cur`` tokens generated so far by every running beam (all beams are one length)::

    candidates = the K best (beam log-prob + log p(token | beam)) over all beams and tokens,
                 K = max(2, 1 + number of stop tokens) * width
    a candidate *finishes* if its token is a stop token or it is the max_tokens-th token
    finished   += the finishing candidates among the first ``width``, each scored
                  logprob / (cur + 1) ** length_penalty          (keep the ``width`` best)
    beams       = the first ``width`` candidates that do not finish

(K is enough for ``width`` survivors: each beam has at most one candidate per stop token.) The
search is done when a candidate reaches ``max_tokens``; or ``early_stopping=True`` and
``width`` hypotheses are finished; or none of the running beams can beat the worst of ``width``
finished ones: ``early_stopping=False`` guesses the best a beam can reach as its score now,
``logprob / (cur + 1) ** length_penalty``; ``"never"`` with ``length_penalty > 0`` as if it
grew to ``max_tokens`` at that log-prob. The answer is the ``width`` finished hypotheses, best
first (transformers' ``sequences`` and ``sequences_scores`` with ``num_return_sequences=k``).

    search = BeamSearch(width=2, max_tokens=8, stop_ids={2})
    while not search.done:
        top = [likeliest(beam.tokens, search.num_candidates) for beam in search.beams]
        parents = search.step(top)     # new beam i continues old beam parents[i]
    search.best()                      # [Hypothesis(tokens=(...), score=-0.41, ...), ...]

The engine keeps one sequence of blocks per running beam: a parent chosen twice is forked, a
parent not chosen is freed (:mod:`paged_ref.engine.beam_search`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from numbers import Real

from paged_ref.memory.allocator import check_int

#: ``early_stopping`` values, as transformers has them.
EARLY_STOPPING = (False, True, "never")


@dataclass(frozen=True)
class Beam:
    """A running beam: the tokens it generated (no prompt) and their summed log-probability."""

    tokens: tuple[int, ...]
    logprob: float


@dataclass(frozen=True)
class Hypothesis:
    """A finished beam: its tokens (a stop token included), their summed log-probability and its
    score, ``logprob / len(tokens) ** length_penalty``."""

    tokens: tuple[int, ...]
    logprob: float
    score: float


class BeamSearch:
    """One prompt's beam search (see the module doc).

    Args:
        width: beams kept (``num_beams``), >= 1.
        max_tokens: most tokens generated (``max_new_tokens``), >= 1.
        stop_ids: tokens that finish a beam (EOS); none: beams finish at ``max_tokens`` only.
        length_penalty: a finished beam's score is its log-prob over ``length ** length_penalty``
            (0: the plain sum; > 0 favours longer ones).
        early_stopping: ``False``, ``True`` or ``"never"`` (see the module doc).

    Raises:
        TypeError / ValueError: an argument of the wrong type or value.
    """

    def __init__(self, width: int, max_tokens: int, *, stop_ids: Iterable[int] = (),
                 length_penalty: float = 1.0, early_stopping: bool | str = False) -> None:
        self.width = check_int("width", width, minimum=1)
        self.max_tokens = check_int("max_tokens", max_tokens, minimum=1)
        self.stop_ids = frozenset(check_int("stop_ids[]", t) for t in stop_ids)
        if isinstance(length_penalty, bool) or not isinstance(length_penalty, Real):
            raise TypeError(f"length_penalty must be a float, got {length_penalty!r}")
        if not math.isfinite(length_penalty):
            raise ValueError(f"length_penalty must be finite, got {length_penalty}")
        if not (isinstance(early_stopping, bool) or early_stopping == "never"):
            raise ValueError(f"early_stopping must be one of {EARLY_STOPPING}, got "
                             f"{early_stopping!r}")
        self.length_penalty, self.early_stopping = float(length_penalty), early_stopping
        #: K: candidates a step needs of each beam (and keeps in all).
        self.num_candidates = max(2, 1 + len(self.stop_ids)) * self.width
        self.beams: list[Beam] = [Beam((), 0.0)]  #: running, best first (the prompt at first)
        self.finished: list[Hypothesis] = []  #: at most ``width``, best first
        self.done = False

    def score(self, logprob: float, length: int) -> float:
        """The length-penalised score of ``length`` tokens of summed log-prob ``logprob``."""
        return logprob / length ** self.length_penalty

    def step(self, top: Sequence[Sequence[tuple[float, int]]]) -> list[int]:
        """Advance every running beam by one token.

        Args:
            top: per running beam (``self.beams`` order), its next tokens as ``(log-prob,
                token)`` pairs: at least its :attr:`num_candidates` likeliest (any order).

        Returns:
            ``parents``: the new ``self.beams[i]`` continues the old ``beams[parents[i]]`` with
            one token (empty once the search is done: no beam runs on).

        Raises:
            RuntimeError: the search is done. ValueError: ``top`` has another number of rows.
        """
        if self.done:
            raise RuntimeError("the beam search is done: read best()")
        if len(top) != len(self.beams):
            raise ValueError(f"top has {len(top)} rows for {len(self.beams)} running beams")
        # NOTE: ties go to the lower (beam, token), as torch.topk over beam * vocab + token tends to
        ranked = sorted(((beam.logprob + lp, j, t) for j, beam in enumerate(self.beams)
                         for lp, t in top[j]), key=lambda c: (-c[0], c[1], c[2]))
        ranked = ranked[:self.num_candidates]
        length = len(self.beams[0].tokens) + 1
        at_max = length >= self.max_tokens
        ends = [at_max or t in self.stop_ids for _, _, t in ranked]
        # finished hypotheses: only a candidate that would have made the top ``width`` counts
        new = [Hypothesis((*self.beams[j].tokens, t), lp, self.score(lp, length))
               for (lp, j, t), end in zip(ranked[:self.width], ends, strict=False) if end]
        self.finished = sorted(self.finished + new, key=lambda h: -h.score)[:self.width]
        going = [c for c, end in zip(ranked, ends, strict=True) if not end][:self.width]
        self.beams = [Beam((*self.beams[j].tokens, t), lp) for lp, j, t in going]
        self.done = at_max or all(ends) or not self._can_improve(length)
        return [] if self.done else [j for _, j, _ in going]

    def best(self) -> list[Hypothesis]:
        """The ``width`` finished hypotheses, best first (once :attr:`done`).

        Raises:
            RuntimeError: the search is still running."""
        if not self.done:
            raise RuntimeError("the beam search is still running: step() until done")
        return list(self.finished)

    def _can_improve(self, length: int) -> bool:
        """Whether a running beam may still beat a finished hypothesis (``length``: tokens
        generated now). Until ``width`` are finished, always (early_stopping=True: never)."""
        if len(self.finished) < self.width:
            return True
        if self.early_stopping is True:
            return False
        longest = (self.max_tokens if self.early_stopping == "never" and self.length_penalty > 0
                   else length)
        return self.score(self.beams[0].logprob, longest) > self.finished[-1].score
