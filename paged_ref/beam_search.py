"""``Engine.beam_search``: beam search over the engine's steps, the beams sharing their blocks.

Each prompt runs as a request; every step, its :class:`~paged_ref.sampling.beam.BeamSearch`
reads each beam's likeliest tokens (``ModelRunner.top_logprobs``) and keeps ``width`` beams: a
beam kept once goes on in its own sequence, one kept twice is forked (``Scheduler.fork``: the
block table shared, the last block copied when written), one not kept is dropped and freed.

A beam search step needs every beam of a prompt at once, so prompts start only while the worst
case of all that run fits -- ``width`` unshared copies of prompt + ``max_tokens - 1`` tokens, in
the pool, and ``width`` seats and tokens of the step's budget each: nothing is ever preempted,
every running beam decodes every step. (Running requests come first in a step, in the order
they started, forks right after their parent: no prompt mid-prefill takes a beam's token.)

It drives the engine from outside the engine package, as vLLM's ``LLM.beam_search`` does, with
three of its private parts: ``_check_prompts`` (the prompts checked before any work), ``_add``
(a request) and ``_step(pick, logprobs)`` (one step whose new tokens ``pick`` decides).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence

from paged_ref.cache_math import blocks_needed
from paged_ref.engine.request import Request
from paged_ref.memory.allocator import check_int
from paged_ref.outputs import CompletionOutput, RequestOutput
from paged_ref.sampling.beam import BeamSearch
from paged_ref.sampling.params import SamplingParams


def beam_search(engine, prompts, beam_width: int, max_tokens: int | Sequence[int], *,
                length_penalty: float = 1.0, early_stopping: bool | str = False,
                ignore_eos: bool = False) -> list[RequestOutput]:
    """Beam search over ``prompts`` in ``engine`` (``engine.beam_search(...)`` calls this):
    transformers' ``model.generate(ids, num_beams=beam_width, num_return_sequences=
    beam_width, do_sample=False, max_new_tokens=max_tokens, length_penalty=...,
    early_stopping=...)`` for each prompt -- its ``sequences`` and ``sequences_scores``.

    Args:
        engine: an :class:`~paged_ref.engine.Engine` with no request of its own unfinished.
        prompts: token ids, a list per prompt.
        beam_width: beams kept (``num_beams``).
        max_tokens: most tokens generated, an int or one per prompt (``max_new_tokens``).
        length_penalty, early_stopping: as transformers' (:class:`~paged_ref.sampling.beam.
            BeamSearch`): a hypothesis scores ``logprob / length ** length_penalty``;
            ``early_stopping`` is ``False``, ``True`` or ``"never"``.
        ignore_eos: no stop token (every hypothesis runs to ``max_tokens``).

    Returns:
        Per prompt, in order, a finished :class:`~paged_ref.outputs.RequestOutput` whose
        ``outputs`` are its ``beam_width`` hypotheses, best first, each with its ``score``.

    Raises:
        RuntimeError: ``engine`` has unfinished requests.
        ValueError / TypeError (before any work): as ``Engine.generate``'s for the prompts;
            ``max_tokens < 1``; beams that can never fit (``beam_width * ceil((len(prompt) +
            max_tokens - 1) / block_size) > num_blocks``, or more beams than
            ``max_num_seqs`` / ``max_num_batched_tokens``); a reservation policy; a bad
            ``beam_width``, ``length_penalty`` or ``early_stopping``.
        Whatever a step raised, after aborting every beam (the engine is as before).
    """
    sched = engine.scheduler
    if engine.has_unfinished_requests():
        raise RuntimeError("beam_search runs its own prompts only: finish (step) or abort the "
                           f"{len(engine.requests)} requests added with add_request first")
    if sched.reservation != "paged":
        raise ValueError(f"beam_search needs reservation='paged', not {sched.reservation!r}")
    width = check_int("beam_width", beam_width, minimum=1)
    stops = frozenset() if ignore_eos else engine.eos_ids
    k = BeamSearch(width, 1, stop_ids=stops, length_penalty=length_penalty,
                   early_stopping=early_stopping).num_candidates  # (checks them too)
    checked = engine._check_prompts(prompts, max_tokens)
    if min(n for _, n in checked) < 1:
        raise ValueError(f"max_tokens must be >= 1 (each prompt's), got {max_tokens}")
    worst = [width * blocks_needed(len(p) + n - 1, engine.block_size) for p, n in checked]
    seats = min(sched.max_num_seqs, sched.max_num_batched_tokens) // width
    if max(worst) > engine.num_blocks or not seats:
        raise ValueError(f"beam_width={width} beams need {max(worst)} blocks and {width} seats "
                         f"at most, but the pool has num_blocks={engine.num_blocks} and "
                         f"max_num_seqs / max_num_batched_tokens {sched.max_num_seqs} / "
                         f"{sched.max_num_batched_tokens}")
    pending, results = deque(range(len(checked))), [None] * len(checked)
    groups: dict[Request, tuple[int, BeamSearch, list[Request]]] = {}  # head: (i, search, beams)

    def pick(reqs: list[Request], top: list) -> dict:
        """Each prompt's beam search step, as ``Scheduler.update``'s ``new_tokens``."""
        rows, new = {r.req_id: row for r, row in zip(reqs, top, strict=True)}, {}
        for head in dict.fromkeys(r.parent or r for r in reqs):
            _, search, beams = groups[head]
            if any(b.req_id not in rows for b in beams):
                raise RuntimeError("a beam missed its step: the admission bound is wrong")
            went_on, kept = {b.req_id: [] for b in beams}, []
            for j, beam in zip(search.step([rows[b.req_id] for b in beams]), search.beams,
                               strict=False):  # (no beam once done: all dropped)
                b = beams[j]
                if went_on[b.req_id]:  # kept twice: a fork
                    engine._next_id += 1
                    b = Request(engine._next_id - 1, b.prompt, b.max_new_tokens, b.params,
                                b.stop_ids, list(b.output), parent=head)
                went_on[beams[j].req_id].append((b, beam.tokens[-1]))
                kept.append(b)
            beams[:] = kept
            new.update(went_on)
        return new

    try:
        while pending or groups:
            held = sum(worst[i] for i, _, _ in groups.values())
            while pending and held + worst[pending[0]] <= engine.num_blocks and \
                    len(groups) < seats:
                i = pending.popleft()
                prompt, n = checked[i]
                rid = engine._add(prompt, SamplingParams(max_tokens=n, ignore_eos=True),
                                  time.perf_counter())
                groups[engine.requests[rid]] = (i, BeamSearch(
                    width, n, stop_ids=stops, length_penalty=length_penalty,
                    early_stopping=early_stopping), [engine.requests[rid]])
                held += worst[i]
            engine._step(pick, logprobs=k)
            for head in [h for h, (_, search, _) in groups.items() if search.done]:
                i, search, _ = groups.pop(head)
                results[i] = _output(head, search.best(), stops)
    except BaseException:
        for r in [*sched.running, *sched.waiting]:  # (all of them are this call's)
            sched.abort(r)
        engine.runner.cache.apply_block_ops(sched.manager.take_block_ops())
        engine.requests.clear()
        raise
    return results


def _output(head: Request, best: list, stops: frozenset[int]) -> RequestOutput:
    """A prompt's answer: its ``width`` hypotheses, best first, each with its score."""
    head.metrics.finished = time.perf_counter()
    outs = [CompletionOutput(i, list(h.tokens), True, "stop" if h.tokens[-1] in stops
                             else "length", h.score) for i, h in enumerate(best)]
    return RequestOutput(head.req_id, [], outs[0].token_ids, True, outs[0].finish_reason,
                         head.metrics, outs)
