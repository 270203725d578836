"""``Engine``: continuous batching over the paged KV cache, online (vLLM's ``LLMEngine``
calls: ``add_request``, ``step``, ``abort``, ``has_unfinished_requests``) and offline
(``generate``, ``beam_search``: loops over its steps, in :mod:`paged_ref.offline`). A step: the
scheduler picks chunks, the engine lays them out as one flat batch, the runner computes them and
picks the tokens, the scheduler records them. If anything raises inside a step, the requests it
scheduled are aborted (blocks freed, hashes of blocks never written dropped) and the exception
propagates; ``generate`` aborts all of its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from paged_ref import _device, offline
from paged_ref.engine.request import Request, Status, fork_samples
from paged_ref.engine.runner import ModelRunner, StepInputs
from paged_ref.engine.scheduler import Scheduler
from paged_ref.memory.allocator import check_int
from paged_ref.memory.tiers import host_tier_blocks, open_disk_tier
from paged_ref.models import warmup as warmup_module
from paged_ref.models.compat import kv_block_shape
from paged_ref.outputs import CompletionOutput, RequestMetrics, RequestOutput, RunStats
from paged_ref.sampling.params import SamplingParams, as_token_ids
from paged_ref.sampling.sampler import SamplingBatch


class Engine:
    """Generation for many requests at once over a paged KV cache.

    Args:
        model: a transformers Llama-family causal LM; its modules are used as they are (one
            model may back several engines).
        num_blocks, block_size: the KV pool: blocks of ``block_size`` tokens (every layer's K, V).
        enable_prefix_caching: requests whose prompts start alike share those blocks.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens computed in one step (prefill chunks + decodes).
        preemption_mode: ``"recompute"`` (free the victim's blocks) or ``"swap"``.
        num_host_blocks: a host tier (CPU memory) where evicted cached blocks spill, in blocks
            (None: as many as ``num_blocks`` with ``"swap"``, else none).
        disk_path, num_disk_blocks: a disk tier under it, ``num_disk_blocks`` blocks in a file
            made in the folder ``disk_path`` (``self.disk_tier``: removed with the engine or by
            its ``close()``); see :mod:`paged_ref.memory.tiers`.
        attention_backend, fused_backend: ``"auto"`` (Triton on a GPU), ``"torch"``, ``"triton"``
            (the attention kernels; the runner's fused layer ops).
        cuda_graphs: capture decode steps in CUDA graphs, and prefill / mixed steps of up to
            2,048 tokens piecewise (default: on a GPU; True needs one).
        max_model_len: longest request (prompt + output), >= 1; default the model's context or
            the pool, whichever is smaller.
        eos_token_id: stop token(s), ints; default the model's ``generation_config``'s.
        kv_format: a quantised KV cache format (see ``paged_ref.QuantizedKV``), None for plain.
        reservation: ``"paged"`` (blocks on demand) or an Orca baseline that reserves up front:
            ``"reserve_max"``, ``"reserve_pow2"``, ``"reserve_oracle"`` (``policy.py``).
        scheduling_policy: ``"fcfs"`` (arrival order) or ``"prefix"`` (longest cached prefix
            first; one overtaken by ``max_overtakes`` later arrivals goes first:
            ``policy.admission_order``).
        warmup: run :meth:`warmup` now, before any request (default: on a GPU, where Triton
            compiles; on a CPU the interpreter has nothing to compile).
        num_scheduler_steps: multi-step decoding (vLLM's option of that name): a step where
            every request decodes greedily runs up to this many decode passes back to back,
            reading the tokens back once (the host's work per step paid once for them); a
            request joins, and tokens come out, at those steps' ends. 1 (default): one pass.

    Raises:
        TypeError / ValueError: before any work, for an argument of the wrong type or value, or
            a backend or ``cuda_graphs`` that cannot run on the model's device here.
    """

    def __init__(self, model, num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, preemption_mode: str = "recompute",
                 attention_backend: str = "auto", cuda_graphs: bool | None = None,
                 max_model_len: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None,
                 kv_format: str | None = None, fused_backend: str = "auto",
                 reservation: str = "paged", scheduling_policy: str = "fcfs",
                 max_overtakes: int = 8, warmup: bool | None = None,
                 num_host_blocks: int | None = None, disk_path=None, num_disk_blocks: int = 0,
                 num_scheduler_steps: int = 1) -> None:
        if not hasattr(getattr(model, "model", None), "layers") or not hasattr(model, "lm_head"):
            raise TypeError("model must be a transformers Llama-family causal LM (with "
                            f".model.layers and .lm_head), got {type(model).__name__}")
        self.num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        self.block_size = check_int("block_size", block_size, minimum=1)
        self.num_scheduler_steps = check_int("num_scheduler_steps", num_scheduler_steps,
                                             minimum=1)
        _device.check_engine_backends(next(model.parameters()).device, attention_backend,
                                      fused_backend, cuda_graphs)
        self.model, self.vocab_size = model, model.config.vocab_size
        context = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.max_model_len = (min(context, num_blocks * block_size) if max_model_len is None
                              else check_int("max_model_len", max_model_len, minimum=1))
        if eos_token_id is None:
            eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id",
                                   None)
        if eos_token_id is None:
            eos_token_id = getattr(model.config, "eos_token_id", None)
        self.eos_ids = frozenset(() if eos_token_id is None else
                                 as_token_ids("eos_token_id", eos_token_id, scalar=True))
        host = host_tier_blocks(num_blocks, preemption_mode, num_host_blocks)
        self.disk_tier = open_disk_tier(  # (its arguments checked before its file is made)
            disk_path, num_disk_blocks, num_host_blocks=host, kv_format=kv_format,
            enable_prefix_caching=enable_prefix_caching, block_shape=kv_block_shape(
                model, block_size), dtype=next(model.parameters()).dtype)
        self.scheduler = Scheduler(num_blocks, block_size, max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   enable_prefix_caching=enable_prefix_caching,
                                   preemption_mode=preemption_mode, reservation=reservation,
                                   max_model_len=self.max_model_len, max_overtakes=max_overtakes,
                                   scheduling_policy=scheduling_policy, num_host_blocks=host,
                                   disk_tier=self.disk_tier)
        self.runner = ModelRunner(model, num_blocks, block_size, num_host_blocks=host,
                                  disk_tier=self.disk_tier,
                                  attention_backend=attention_backend, cuda_graphs=cuda_graphs,
                                  max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                  kv_format=kv_format, fused_backend=fused_backend,
                                  max_num_batched_tokens=max_num_batched_tokens)
        self.requests: dict[int, Request] = {}  #: the unfinished requests by id
        self.stats = RunStats()
        self._next_id = 0
        self._last: tuple = ()  # the last step's (SchedulerOutput, finished, tokens, seconds)
        self.warmup_seconds = 0.0  #: how long :meth:`warmup` took (0.0: it did not run)
        if warmup is not None and not isinstance(warmup, bool):
            raise TypeError(f"warmup must be a bool or None, got {warmup!r}")
        if (self.runner.device.type == "cuda") if warmup is None else warmup:
            self.warmup()

    # ---- the online calls (vLLM's LLMEngine) ------------------------------------------------

    def add_request(self, prompt_ids, params: SamplingParams | None = None, *,
                    arrival_time: float | None = None) -> int:
        """Queue a request; it joins the running batch at a later :meth:`step`.

        Args:
            prompt_ids: its token ids: a list of ints, or a 1-D integer tensor / NumPy array.
            params: how it samples and stops (default ``SamplingParams()``: greedy, 16 tokens).
            arrival_time: when it arrived (``time.perf_counter()`` s; default now).

        Returns:
            Its request id (ints in arrival order). TypeError / ValueError: as ``generate``'s.
        """
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = offline.check_prompt(self, "prompt_ids", prompt_ids, params.max_tokens)
        if arrival_time is not None and not isinstance(arrival_time, (int, float)):
            raise TypeError(f"arrival_time must be a float, got {arrival_time!r}")
        return self._add(ids, params, time.perf_counter() if arrival_time is None
                         else float(arrival_time))

    def step(self) -> list[RequestOutput]:
        """Run one step of the unfinished requests' work.

        Returns:
            A :class:`RequestOutput` per request that got a token (extended or finished); one
            for all the samples of a request with ``n > 1``.

        Raises:
            Whatever the step raised (the model, a kernel, a policy function, ``Ctrl-C``),
            after aborting the requests it had scheduled (see the module doc).
        """
        return [RequestOutput(head.req_id, new, list(head.output), self._done(head),
                              head.finish_reason, head.metrics,
                              [CompletionOutput(i, list(r.output), r.status is Status.FINISHED,
                                                r.finish_reason)
                               for i, r in enumerate(head.group)])
                for head, new in self._step_tokens().items()]

    def _step_tokens(self) -> dict[Request, list[int]]:
        """:meth:`step` without building its outputs (``generate`` runs this): each request (a
        head) that got a token -> its own new tokens (its samples': theirs); token times set."""
        reqs, tokens, now = self._step(fork_samples)
        own: dict[Request, list[int]] = {}
        for r, t in zip(reqs, tokens, strict=True):  # (t: a list in a multi-step decode)
            own.setdefault(r.parent or r, []).extend(() if r.parent else
                                                     t if isinstance(t, list) else (t,))
        for head, new in own.items():
            head.metrics.token_times += [now] * max(1, len(new))
        return own

    def _step(self, pick: Callable, logprobs: int = 0) -> tuple[list[Request], list, float]:
        """One step (:meth:`step`'s); ``pick(reqs, got)`` turns what the runner returned for
        the sampled requests ``reqs`` -- tokens, or with ``logprobs`` each one's likeliest
        ``(log-prob, token)`` pairs -- into ``Scheduler.update``'s ``new_tokens``. Returns
        ``(reqs, got, the time they came)``."""
        t0 = time.perf_counter()
        sched, cache, out, applied = self.scheduler, self.runner.cache, None, False
        passes = 1 if logprobs or pick is not fork_samples else self.num_scheduler_steps
        if passes > 1 and not all(r.params is None or r.params.greedy for r in sched.running):
            passes = 1  # (multi-step decoding is greedy only: sampling runs outside the graphs)
        try:
            out = sched.schedule(passes)
            cache.apply_block_ops(out.block_ops)  # before the step writes any K/V
            applied = True
            rows = [(b, r) for b, c in enumerate(out.chunks) if c.samples
                    for r in c.request.samplers(self._generator)]
            step, reqs = self._layout(out, [b for b, _ in rows]), [r for _, r in rows]
            if out.steps:  # (every request greedy, one token of its own each pass)
                got = self.runner.execute_steps(step)
                new = {r.req_id: t for r, t in zip(reqs, got, strict=True)}  # (update cuts
            else:                                                            # them at a stop)
                got = (self.runner.top_logprobs(step, logprobs) if logprobs else
                       self.runner.execute(step, SamplingBatch.of(
                           [r.params for r in reqs], [r.generator for r in reqs])))
                new = pick(reqs, got)
            now = time.perf_counter()
            finished = sched.update(out, new)
        except BaseException:
            if out is not None:  # (a failed schedule rolled itself back)
                if not applied:
                    cache.apply_block_ops(out.block_ops)
                sched.rollback(out)
            cache.apply_block_ops(sched.manager.take_block_ops())  # (moves the aborts owe)
            self._forget(list(self.requests.values()))
            raise
        for r in out.admitted:
            r.metrics.first_scheduled = r.metrics.first_scheduled or t0
        self._forget(finished, now)
        self._last = (out, finished, dict(zip(reqs, got, strict=True)), time.perf_counter() - t0)
        return reqs, got, now

    def abort(self, request_id: int) -> None:
        """Stop request ``request_id`` and free all it holds (waiting, mid-prefill or decoding);
        one that already finished holds nothing. ``ValueError``: an id this engine never gave."""
        req = self.requests.get(request_id) if isinstance(request_id, int) else None
        if req is None:
            if isinstance(request_id, int) and 0 <= request_id < self._next_id:
                return
            raise ValueError(f"unknown request id {request_id!r} (ids come from add_request)")
        for r in req.group:  # (n > 1: every sample)
            self.scheduler.abort(r)
        self._forget([req], time.perf_counter())

    def has_unfinished_requests(self) -> bool:
        """Whether any request is waiting or running."""
        return bool(self.requests)

    warmup = warmup_module.warmup

    # ---- the offline calls (vLLM's LLM: paged_ref.offline) ----------------------------------

    generate = offline.generate
    beam_search = offline.beam_search

    # ---- one step's pieces ------------------------------------------------------------------

    def _add(self, ids: list[int], params: SamplingParams, arrival: float) -> int:
        rid, self._next_id = self._next_id, self._next_id + params.n  # (samples: rid + i)
        stops = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos
                                                    else self.eos_ids)
        self.requests[rid] = req = Request(rid, ids, params.max_tokens, params, stops,
                                           metrics=RequestMetrics(arrival),
                                           generator=self._generator(params.seed))
        self.scheduler.add(req)
        return rid

    def _forget(self, finished: list[Request], now: float | None = None) -> None:
        """Drop the done requests among ``finished`` (a sample's head), ``metrics.finished=now``."""
        for head in dict.fromkeys(r.parent or r for r in finished):
            if self._done(head) and self.requests.pop(head.req_id, None) and now is not None:
                head.metrics.finished = now

    @staticmethod
    def _done(head: Request) -> bool:
        """Whether request ``head`` finished, every sample of it."""
        return all(r.status is Status.FINISHED for r in head.group)

    def _generator(self, seed: int | None) -> torch.Generator | None:  # (None: the global RNG)
        return None if seed is None else torch.Generator(self.runner.device).manual_seed(seed)

    def _layout(self, out, sample_rows: list[int]) -> StepInputs:
        """The scheduled chunks (a ``SchedulerOutput``) as one flat batch for the runner."""
        m = self.scheduler.manager
        step = StepInputs([], [], [], [0], [], [], sample_rows, out.steps or None)
        for chunk in out.chunks:
            req = chunk.request
            if chunk.num_tokens == 1:  # decode: the token sampled last step
                step.input_ids.append(req.token_at(chunk.start))
                step.positions.append(chunk.start)
            else:
                step.input_ids.extend(req.tokens[chunk.start:chunk.end])
                step.positions.extend(range(chunk.start, chunk.end))
            step.slot_mapping.extend(chunk.slots)
            step.query_start_loc.append(len(step.input_ids))
            step.seq_lens.append(chunk.end)
            step.block_tables.append(m.block_table(req.req_id))
        return step
