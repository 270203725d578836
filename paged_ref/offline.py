"""The offline calls of an :class:`~paged_ref.engine.Engine` (vLLM's ``LLM``): loops over its
steps, outside the engine package (``engine.generate(...)`` and ``engine.beam_search(...)`` are
these functions).

* :func:`generate` -- every prompt as a request (greedy, or sampled with ``SamplingParams``;
  ``n > 1``: forked samples), until all finished: their tokens, ``engine.stats``, ``on_step``
  events.
* :func:`beam_search` -- transformers' beam search, each prompt's beams forked and freed in the
  engine's pool; the bookkeeping is :class:`~paged_ref.sampling.beam.BeamSearch`.

Beam search. Each prompt runs as a request; every step, its ``BeamSearch`` reads each beam's
likeliest tokens (``ModelRunner.top_logprobs``) and keeps ``width`` beams: a beam kept once goes
on in its own sequence, one kept twice is forked (``Scheduler.fork``: the block table shared,
the last block copied when written), one not kept is dropped and freed. A step needs every beam
of a prompt at once, so prompts start only while the worst case of all that run fits --
``width`` unshared copies of prompt + ``max_tokens - 1`` tokens, in the pool, and ``width``
seats and tokens of the step's budget each: nothing is ever preempted, every running beam
decodes every step. (Running requests come first in a step, in the order they started, forks
right after their parent: no prompt mid-prefill takes a beam's token.)

Both check each prompt first (:func:`check_prompts`), then drive the engine through three of
its private parts: ``_add`` (a request), ``_step(pick, logprobs)`` (one step whose new tokens
``pick`` decides; :meth:`~paged_ref.engine.Engine.step` is ``_step`` with the sampled tokens)
and ``_last`` (what that step did).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence

from tqdm.auto import tqdm

from paged_ref.cache_math import blocks_needed
from paged_ref.engine.policy import reserved_tokens
from paged_ref.engine.request import Request
from paged_ref.memory.allocator import check_int
from paged_ref.outputs import CompletionOutput, RequestOutput, RunStats, StepEvent
from paged_ref.sampling.beam import BeamSearch
from paged_ref.sampling.params import SamplingParams, as_token_ids

#: Show a progress bar when a call generates at least this many tokens (``progress=None``).
PROGRESS_MIN_TOKENS = 4096


def generate(engine, prompts: Sequence[Sequence[int]],
             max_new_tokens: int | Sequence[int] | None = None, *,
             params: SamplingParams | Sequence[SamplingParams] | None = None,
             ignore_eos: bool = False, on_step: Callable[[StepEvent], None] | None = None,
             progress: bool | None = None) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (token ids), in prompt order -- or sampled ones.

    Each request stops after ``max_new_tokens`` tokens (an int, or one per prompt), or
    right after it emits EOS (the EOS id is included) unless ``ignore_eos``. Identical to
    transformers' ``model.generate(ids, do_sample=False, max_new_tokens=n)`` run on each
    prompt alone (float32). Instead of ``max_new_tokens`` and ``ignore_eos``, ``params``
    (one :class:`SamplingParams` for all prompts, or one per prompt) says how each samples
    and stops; a prompt with ``n > 1`` gives a list of its ``n`` completions (sample order).
    ``on_step`` gets a :class:`StepEvent` after each step, ``engine.stats`` the call's
    :class:`RunStats`.

    Raises:
        ValueError (before any work): an empty prompt list or prompt, a token id outside
            ``[0, vocab_size)``, ``max_new_tokens < 0``, a request that can never fit in
            the pool (``ceil((len(prompt) + max_new_tokens - 1) / block_size) >
            num_blocks``, or its reservation) or is longer than ``max_model_len``.
        TypeError: prompts that are not lists of int token ids; both or neither of
            ``max_new_tokens`` and ``params``, or ``params`` not SamplingParams.
        RuntimeError: requests added with ``engine.add_request`` are unfinished.
        Whatever a step or ``on_step`` raised, after aborting every request of the call.
    """
    if engine.has_unfinished_requests():
        raise RuntimeError("generate runs its own prompts only: finish (step) or abort the "
                           f"{len(engine.requests)} requests added with add_request first")
    if (max_new_tokens is None) == (params is None):
        raise TypeError("give max_new_tokens (greedy) or params (SamplingParams), not both")
    each = params if isinstance(params, Sequence) else None
    if params is not None and not all(isinstance(p, SamplingParams) for p in each or [params]):
        raise TypeError(f"params must be a SamplingParams or a list of them, got {params!r}")
    checked = check_prompts(engine, prompts, max_new_tokens if params is None else
                            [p.max_tokens for p in each] if each else params.max_tokens)
    start = time.perf_counter()
    engine.stats = stats = RunStats(prompt_tokens=sum(len(p) for p, _ in checked))
    total = sum(n for _, n in checked)
    show = total >= PROGRESS_MIN_TOKENS if progress is None else progress
    bar = tqdm(total=total, desc="generate", unit="tok", disable=not show, leave=False)
    reqs: dict[int, Request] = {}
    try:  # (adding too: a Ctrl-C half-way must not leave the first prompts queued)
        for i, (p, n) in enumerate(checked):
            if n:
                sp = (SamplingParams(max_tokens=n, ignore_eos=ignore_eos) if params is None
                      else each[i] if each else params)
                reqs[i] = engine.requests[engine._add(p, sp, start)]
        index = {r.req_id + j: i if r.params.n == 1 else (i, j)  # (sample j of n: id + j)
                 for i, r in reqs.items() for j in range(r.params.n)}
        while engine.has_unfinished_requests():
            engine._step_tokens()  # (step() without its outputs: generate returns tokens)
            out, finished, new_tokens, seconds = engine._last
            if on_step is not None:
                on_step(_event(engine, stats.steps, index))
            stats.steps += 1
            stats.computed_tokens += out.num_tokens
            stats.cached_tokens += out.cached_tokens
            stats.preemptions += len(out.preempted)
            stats.max_running = max(stats.max_running,
                                    len(engine.scheduler.running) + len(finished))
            bar.update(sum(len(t) if isinstance(t, list) else 1 for t in new_tokens.values()))
    except BaseException:
        for r in reqs.values():
            engine.abort(r.req_id)
        raise
    finally:
        bar.close()
    stats.seconds = time.perf_counter() - start
    stats.output_tokens = sum(len(s.output) for r in reqs.values() for s in r.group)
    stats.metrics = [reqs[i].metrics if i in reqs else None for i in range(len(checked))]
    stats.ttft_s = [(m.ttft or 0.0) if m else 0.0 for m in stats.metrics]
    return [[] if i not in reqs else list(reqs[i].output) if reqs[i].params.n == 1 else
            [list(s.output) for s in reqs[i].group] for i in range(len(checked))]


def _event(engine, step: int, index: dict) -> StepEvent:
    """The last step as a :class:`StepEvent`, requests named by ``index[req_id]``."""
    out, finished, new_tokens, seconds = engine._last
    m, running = engine.scheduler.manager, engine.scheduler.running
    return StepEvent(
        step=step, ran=[(index[c.request.req_id], c.start, n) for c, n in
                        zip(out.chunks, out.steps or [c.num_tokens for c in out.chunks],
                            strict=True)],
        admitted=[index[r.req_id] for r in out.admitted],
        preempted=[index[r.req_id] for r in out.preempted],
        finished=[index[r.req_id] for r in finished],
        new_tokens={index[r.req_id]: t for r, t in new_tokens.items()},
        block_tables={index[r.req_id]: m.block_table(r.req_id) for r in running},
        seq_lens={index[r.req_id]: m.seq_len(r.req_id) for r in running},
        num_free_blocks=m.num_free_blocks, num_blocks=engine.num_blocks,
        block_size=engine.block_size, cached_tokens=out.cached_tokens, seconds=seconds,
        passes=max(out.steps, default=1))


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
    checked = check_prompts(engine, prompts, max_tokens)
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


def check_prompts(engine, prompts, max_new_tokens) -> list[tuple[list[int], int]]:
    """``(token ids, max_new_tokens)`` per prompt (each checked by :func:`check_prompt`), or
    TypeError / ValueError before any work."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError("prompts must be a list of prompts, each a list of token ids, got "
                        f"{type(prompts).__name__}")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: give at least one prompt")
    if isinstance(max_new_tokens, Sequence):  # one per prompt
        if len(max_new_tokens) != len(prompts):
            raise ValueError(f"max_new_tokens has {len(max_new_tokens)} entries for "
                             f"{len(prompts)} prompts")
        limits = [check_int(f"max_new_tokens[{i}]", n) for i, n in enumerate(max_new_tokens)]
    else:
        limits = [check_int("max_new_tokens", max_new_tokens)] * len(prompts)
    return [(check_prompt(engine, f"prompts[{i}]", p, n), n)
            for i, (p, n) in enumerate(zip(prompts, limits, strict=True))]


def check_prompt(engine, name: str, prompt, max_tokens: int) -> list[int]:
    """Prompt ``name`` of ``engine`` as token ids, checked before any work (``add_request``'s
    and ``generate``'s): TypeError / ValueError for ids outside the vocabulary, an empty
    prompt, or one that can never fit the pool (or its reservation) or ``max_model_len``."""
    ids = as_token_ids(name, prompt, minimum=None)
    bad = [t for t in ids if not 0 <= t < engine.vocab_size]
    if not ids or bad:
        raise ValueError(f"{name} has token id {bad[0]} outside the vocabulary [0, "
                         f"{engine.vocab_size})" if ids else
                         f"{name} is empty: a prompt needs at least one token")
    longest = len(ids) + max(max_tokens, 1) - 1
    need = blocks_needed(max(longest, reserved_tokens(
        engine.scheduler.reservation, len(ids), max_tokens, engine.max_model_len)),
        engine.block_size)
    if need > engine.num_blocks:
        raise ValueError(f"{name} can never fit: {len(ids)} prompt tokens + max_new_tokens="
                         f"{max_tokens} need {need} blocks of {engine.block_size} tokens but "
                         f"the pool has num_blocks={engine.num_blocks}")
    if longest > engine.max_model_len:
        raise ValueError(f"{name}: {len(ids)} tokens + max_new_tokens={max_tokens} exceed "
                         f"max_model_len={engine.max_model_len}")
    return ids
