"""Runner wrappers that report each step's shape: the driver's view into ``paged_ref.engine``.

The engine calls one method of its runner per step, ``runner.execute(step, sampling) -> token
ids`` (``step``: a :class:`paged_ref.engine.runner.StepInputs` of host lists), and reads
``runner.cache`` and ``runner.device``. A wrapper that keeps those and records the step's
:class:`~paged_course.serving.cost_model.StepShape` tells the driver what the step computed
without reaching into the scheduler:

* :class:`TimedRunner` runs the real model and times it (CUDA events on a GPU): the H200 runs;
* :class:`NullRunner` computes nothing and returns token 0 for every sampled row: the real
  scheduler and block manager at no model cost, for the simulated clock on a CPU (the requests
  run with ``ignore_eos`` and their true lengths, so which token comes out does not matter).

:func:`instrument` puts one in place of ``engine.runner``. :func:`simulation_engine` builds an
engine over a tiny random Llama with a :class:`NullRunner`: what lesson 12 serves on a CPU.
"""

from __future__ import annotations

import time

from paged_course.serving.cost_model import StepShape

#: The tiny random Llama behind :func:`simulation_engine` (its weights are never run).
TINY = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, vocab_size=512)


def shape_of(step) -> StepShape:
    """A ``StepInputs``' shape: tokens (``len(input_ids)``), requests (``len(seq_lens)``) and the
    cached tokens they attend (``sum(seq_lens)``)."""
    return StepShape(len(step.input_ids), len(step.seq_lens), int(sum(step.seq_lens)))


class _Wrapper:
    """Delegates everything but ``execute`` to the wrapped runner; keeps the last shape."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.last_shape: StepShape | None = None

    def __getattr__(self, name):  # cache, device, graphs, ... (only called when not found)
        return getattr(self.__dict__["inner"], name)

    def take_shape(self) -> StepShape | None:
        """The last step's shape, once (None: no step ran since the last call)."""
        shape, self.last_shape = self.last_shape, None
        return shape


class NullRunner(_Wrapper):
    """A runner that computes nothing: token 0 for each of ``step.sample_rows``."""

    def execute(self, step, sampling=None) -> list[int]:
        self.last_shape = shape_of(step)
        return [0] * len(step.sample_rows)


class TimedRunner(_Wrapper):
    """The real runner, timed: ``gpu_seconds`` of each call (CUDA events on a GPU, else the
    host's clock), appended to ``self.times`` with the step's shape."""

    def __init__(self, inner) -> None:
        super().__init__(inner)
        self.times: list[tuple[StepShape, float]] = []

    def execute(self, step, sampling=None) -> list[int]:
        import torch

        self.last_shape = shape = shape_of(step)
        if getattr(self.inner, "device", None) is not None and self.inner.device.type == "cuda":
            start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
            start.record()
            tokens = self.inner.execute(step, sampling)  # (reads the tokens back: a sync)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            tokens = self.inner.execute(step, sampling)
            seconds = time.perf_counter() - t0
        self.times.append((shape, seconds))
        return tokens


def instrument(engine, *, null: bool = False):
    """Put a :class:`NullRunner` (``null``) or a :class:`TimedRunner` in place of
    ``engine.runner`` (idempotent: a wrapped runner is unwrapped first). Returns ``engine``.

    NOTE: the engine has no runner argument; replacing its ``runner`` attribute is the least
    intrusive hook (the engine only calls ``execute`` and reads ``cache`` / ``device``).

    Raises:
        ValueError: an engine with ``num_scheduler_steps > 1``: its decode steps call
            ``execute_steps`` (several passes), which the wrappers neither time nor simulate.
    """
    steps = getattr(engine, "num_scheduler_steps", 1)
    if steps != 1:
        raise ValueError(f"engine.num_scheduler_steps must be 1 to instrument it, got {steps}: "
                         "the serving wrappers time and simulate one pass a step")
    inner = engine.runner
    while isinstance(inner, _Wrapper):
        inner = inner.inner
    engine.runner = (NullRunner if null else TimedRunner)(inner)
    return engine


def simulation_engine(reservation: str = "paged", *, num_blocks: int, block_size: int = 16,
                      max_model_len: int = 1024, max_num_seqs: int = 256,
                      max_num_batched_tokens: int = 2048, seed: int = 0, **options):
    """A :class:`paged_ref.engine.Engine` over a tiny random Llama (:data:`TINY`, float32, CPU,
    vocabulary 512) whose runner is a :class:`NullRunner`: the real scheduler and block manager
    with ``reservation``, ``num_blocks`` blocks of ``block_size`` and ``max_model_len``; no
    prefix caching (random prompts share nothing) unless ``options`` (more ``Engine``
    arguments: ``enable_prefix_caching=True, scheduling_policy="prefix"``, ...) say otherwise.
    Its steps cost only the host's bookkeeping.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged_ref.engine import Engine

    cfg = LlamaConfig(**TINY, max_position_embeddings=max(max_model_len, 2048),
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    options = {"enable_prefix_caching": False, **options}
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size, **options,
                    max_num_seqs=max_num_seqs,
                    max_num_batched_tokens=max_num_batched_tokens, attention_backend="torch",
                    fused_backend="torch", cuda_graphs=False, max_model_len=max_model_len,
                    reservation=reservation)
    return instrument(engine, null=True)
