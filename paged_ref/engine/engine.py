"""``Engine``: continuous-batching greedy generation over the paged KV cache.

    from paged_ref.engine import Engine, load_smollm2
    model, tokenizer = load_smollm2()
    engine = Engine(model, num_blocks=256, block_size=16)
    outputs = engine.generate([tokenizer.encode("Hello"), ...], max_new_tokens=32)

Each call of :meth:`Engine.generate` queues the prompts and runs steps until every request is
done. A step is: the scheduler picks chunks (:mod:`paged_ref.engine.scheduler`), the engine
lays them out as one flat batch, the runner computes them (:mod:`paged_ref.engine.runner`),
the sampled tokens go back to the scheduler. ``on_step`` sees a :class:`StepEvent` after each
step (which requests ran, their block tables, free blocks): the lesson's explorer follows it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from paged_ref.cache_math import blocks_needed
from paged_ref.engine import ops
from paged_ref.engine.request import Request
from paged_ref.engine.runner import ModelRunner, StepInputs
from paged_ref.engine.scheduler import Scheduler, SchedulerOutput
from paged_ref.memory.allocator import check_int

#: Show a progress bar when a call generates at least this many tokens (``progress=None``).
PROGRESS_MIN_TOKENS = 4096


@dataclass(frozen=True)
class StepEvent:
    """What one step did. Requests are named by their index in ``generate``'s ``prompts``.

    ran: ``(request, first token, tokens computed)`` per chunk; admitted / preempted /
    finished: request indices; new_tokens: request -> token sampled this step;
    block_tables / seq_lens: every running request's blocks and length after the step
    (only when someone listens); num_free_blocks: free (or evictable) blocks after the step.
    """

    step: int
    ran: list[tuple[int, int, int]]
    admitted: list[int]
    preempted: list[int]
    finished: list[int]
    new_tokens: dict[int, int]
    block_tables: dict[int, list[int]]
    seq_lens: dict[int, int]
    num_free_blocks: int
    num_blocks: int
    block_size: int
    cached_tokens: int
    seconds: float

    @property
    def num_tokens(self) -> int:
        """Tokens computed this step (the batch size in tokens)."""
        return sum(n for _, _, n in self.ran)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for _, _, n in self.ran)


@dataclass
class RunStats:
    """Totals of the last ``generate`` call."""

    steps: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0  #: prompt + recomputed + decode tokens run through the model
    cached_tokens: int = 0  #: prompt tokens served by the prefix cache instead
    output_tokens: int = 0
    preemptions: int = 0
    max_running: int = 0  #: most requests holding blocks at once
    seconds: float = 0.0
    ttft_s: list[float] = field(default_factory=list)  #: time to first token per request

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds else 0.0


class Engine:
    """Greedy generation for many prompts at once over a paged KV cache.

    Args:
        model: a transformers Llama-family causal LM (``LlamaForCausalLM``); its modules are
            used as they are, so one model may back several engines (each keeps a fused copy
            of the q/k/v and gate/up weights: see :class:`~paged_ref.engine.runner.ModelRunner`).
        num_blocks: blocks in the KV pool (each ``block_size`` tokens of every layer's K and V).
        block_size: tokens per block.
        enable_prefix_caching: requests whose prompts start alike share those blocks.
        max_num_seqs: most requests running at once.
        max_num_batched_tokens: most tokens computed in one step (prefill chunks + decodes).
        preemption_mode: ``"recompute"`` (free the victim's blocks) or ``"swap"``.
        attention_backend: ``"auto"``, ``"torch"`` or ``"triton"``.
        cuda_graphs: capture decode steps in CUDA graphs (default: on a GPU).
        max_model_len: longest request (prompt + output); default the model's context or
            the pool, whichever is smaller.
        eos_token_id: stop token(s); default the model's ``generation_config``.
        kv_format: a quantised KV cache format (see ``paged_ref.QuantizedKV``), None for plain.
        fused_backend: the runner's fused layer ops, ``"auto"`` (Triton on a GPU, torch
            elsewhere), ``"torch"`` or ``"triton"``.
    """

    def __init__(self, model, num_blocks: int, block_size: int = 16,
                 enable_prefix_caching: bool = True, *, max_num_seqs: int = 256,
                 max_num_batched_tokens: int = 2048, preemption_mode: str = "recompute",
                 attention_backend: str = "auto", cuda_graphs: bool | None = None,
                 max_model_len: int | None = None,
                 eos_token_id: int | Sequence[int] | None = None,
                 kv_format: str | None = None, fused_backend: str = "auto") -> None:
        if not hasattr(getattr(model, "model", None), "layers") or not hasattr(model, "lm_head"):
            raise TypeError("model must be a transformers Llama-family causal LM (with "
                            f".model.layers and .lm_head), got {type(model).__name__}")
        num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        block_size = check_int("block_size", block_size, minimum=1)
        self.model = model
        self.vocab_size = model.config.vocab_size
        context = getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.max_model_len = check_int(
            "max_model_len", max_model_len or min(context, num_blocks * block_size), minimum=1)
        self.scheduler_args = dict(max_num_seqs=max_num_seqs,
                                   max_num_batched_tokens=max_num_batched_tokens,
                                   enable_prefix_caching=enable_prefix_caching,
                                   preemption_mode=preemption_mode)
        self.scheduler = Scheduler(num_blocks, block_size, **self.scheduler_args)
        self.runner = ModelRunner(model, num_blocks, block_size,
                                  num_host_blocks=self.scheduler.num_host_blocks,
                                  attention_backend=attention_backend, cuda_graphs=cuda_graphs,
                                  max_num_seqs=max_num_seqs, max_model_len=self.max_model_len,
                                  kv_format=kv_format, fused_backend=fused_backend)
        self.num_blocks, self.block_size = num_blocks, block_size
        self.eos_ids = self._eos_ids(model, eos_token_id)
        self.stats = RunStats()
        self._next_id = 0

    # ---- the public call --------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]],
                 max_new_tokens: int | Sequence[int], *, ignore_eos: bool = False,
                 on_step: Callable[[StepEvent], None] | None = None,
                 progress: bool | None = None) -> list[list[int]]:
        """Greedy continuations of ``prompts`` (token ids), in prompt order.

        Each request stops after ``max_new_tokens`` tokens (an int, or one per prompt), or
        right after it emits EOS (the EOS id is included) unless ``ignore_eos``. Identical to
        transformers' ``model.generate(ids, do_sample=False, max_new_tokens=n)`` run on each
        prompt alone (float32).

        Raises ``ValueError`` (before any work) for an empty prompt list or prompt, a token id
        outside ``[0, vocab_size)``, ``max_new_tokens < 0``, or a request that can never fit
        in the pool (``ceil((len(prompt) + max_new_tokens - 1) / block_size) > num_blocks``).
        """
        requests = self._make_requests(prompts, max_new_tokens)
        first_id = requests[0].req_id
        stop_ids = frozenset() if ignore_eos else self.eos_ids
        self.stats = stats = RunStats(prompt_tokens=sum(len(r.prompt) for r in requests))
        for r in requests:
            if r.max_new_tokens > 0:
                self.scheduler.add(r)
        total = sum(r.max_new_tokens for r in requests)
        show = total >= PROGRESS_MIN_TOKENS if progress is None else progress
        bar = tqdm(total=total, desc="generate", unit="tok", disable=not show, leave=False)
        start = time.perf_counter()
        first_token: dict[int, float] = {}
        try:
            while self.scheduler.has_work():
                event = self._step(stop_ids, first_id, listen=on_step is not None)
                stats.steps += 1
                stats.computed_tokens += event.num_tokens
                stats.cached_tokens += event.cached_tokens
                stats.preemptions += len(event.preempted)
                stats.max_running = max(stats.max_running, len(self.scheduler.running)
                                        + len(event.finished))
                now = time.perf_counter() - start
                for i in event.new_tokens:
                    first_token.setdefault(i, now)
                bar.update(len(event.new_tokens))
                if on_step is not None:
                    on_step(event)
        finally:
            bar.close()
        stats.seconds = time.perf_counter() - start
        stats.output_tokens = sum(len(r.output) for r in requests)
        stats.ttft_s = [first_token.get(i, 0.0) for i in range(len(requests))]
        return [list(r.output) for r in requests]

    # ---- one step ---------------------------------------------------------------------------

    def _step(self, stop_ids: frozenset[int], first_id: int, *, listen: bool) -> StepEvent:
        t0 = time.perf_counter()
        sched = self.scheduler
        out = sched.schedule()
        ops.apply_block_ops(self.runner.cache, out.block_ops)
        step = self._layout(out)
        tokens = self.runner.execute(step)
        new_tokens = {out.chunks[b].request.req_id: t
                      for b, t in zip(step.sample_rows, tokens, strict=True)}
        finished = sched.update(out, new_tokens, stop_ids)
        m = sched.manager
        running = sched.running if listen else []
        return StepEvent(
            step=self.stats.steps,
            ran=[(c.request.req_id - first_id, c.start, c.num_tokens) for c in out.chunks],
            admitted=[r.req_id - first_id for r in out.admitted],
            preempted=[r.req_id - first_id for r in out.preempted],
            finished=[r.req_id - first_id for r in finished],
            new_tokens={i - first_id: t for i, t in new_tokens.items()},
            block_tables={r.req_id - first_id: m.block_table(r.req_id) for r in running},
            seq_lens={r.req_id - first_id: m.seq_len(r.req_id) for r in running},
            num_free_blocks=m.num_free_blocks, num_blocks=self.num_blocks,
            block_size=self.block_size, cached_tokens=out.cached_tokens,
            seconds=time.perf_counter() - t0)

    def _layout(self, out: SchedulerOutput) -> StepInputs:
        """The scheduled chunks as one flat batch (host lists) for the runner."""
        m = self.scheduler.manager
        step = StepInputs([], [], [], [0], [], [], [])
        for b, chunk in enumerate(out.chunks):
            req = chunk.request
            if chunk.num_tokens == 1:  # decode: the token sampled last step
                step.input_ids.append(req.token_at(chunk.start))
            else:
                step.input_ids.extend(req.tokens[chunk.start:chunk.end])
            step.positions.extend(range(chunk.start, chunk.end))
            step.slot_mapping.extend(m.slot_mapping(req.req_id, chunk.start, chunk.end))
            step.query_start_loc.append(len(step.input_ids))
            step.seq_lens.append(chunk.end)
            step.block_tables.append(m.block_table(req.req_id))
            if chunk.samples:
                step.sample_rows.append(b)
        return step

    # ---- input checks -----------------------------------------------------------------------

    def _make_requests(self, prompts, max_new_tokens) -> list[Request]:
        """Checked requests, or ``TypeError``/``ValueError`` before anything is queued."""
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
        checked = []
        for i, (p, max_new_tokens) in enumerate(zip(prompts, limits, strict=False)):
            if isinstance(p, torch.Tensor):
                p = p.tolist() if p.dim() == 1 else p
            if isinstance(p, (str, bytes)) or not isinstance(p, Sequence):
                raise TypeError(f"prompts[{i}] must be a list of token ids, got "
                                f"{type(p).__name__} (encode text with the tokenizer first)")
            ids = [check_int(f"prompts[{i}][{j}]", t, minimum=None) for j, t in enumerate(p)]
            if not ids:
                raise ValueError(f"prompts[{i}] is empty: a prompt needs at least one token")
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise ValueError(f"prompts[{i}] has token id {bad[0]} outside the vocabulary "
                                 f"[0, {self.vocab_size})")
            longest = len(ids) + max(max_new_tokens, 1) - 1
            if blocks_needed(longest, self.block_size) > self.num_blocks:
                raise ValueError(
                    f"prompts[{i}] can never fit: {len(ids)} prompt tokens + max_new_tokens="
                    f"{max_new_tokens} need {blocks_needed(longest, self.block_size)} blocks "
                    f"of {self.block_size} tokens but the pool has num_blocks={self.num_blocks}")
            if longest > self.max_model_len:
                raise ValueError(f"prompts[{i}]: {len(ids)} tokens + max_new_tokens="
                                 f"{max_new_tokens} exceed max_model_len={self.max_model_len}")
            checked.append(ids)
        requests = [Request(self._next_id + i, ids, n)
                    for i, (ids, n) in enumerate(zip(checked, limits, strict=False))]
        self._next_id += len(requests)
        return requests

    @staticmethod
    def _eos_ids(model, eos_token_id) -> frozenset[int]:
        if eos_token_id is None:
            gen = getattr(model, "generation_config", None)
            eos_token_id = getattr(gen, "eos_token_id", None)
            if eos_token_id is None:
                eos_token_id = getattr(model.config, "eos_token_id", None)
        if eos_token_id is None:
            return frozenset()
        if isinstance(eos_token_id, int):
            return frozenset([eos_token_id])
        return frozenset(int(t) for t in eos_token_id)

    def __repr__(self) -> str:
        return (f"Engine({type(self.model).__name__}, num_blocks={self.num_blocks}, "
                f"block_size={self.block_size}, {self.scheduler_args})")
