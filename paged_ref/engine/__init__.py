"""``paged_ref.engine``: a small serving engine on a real LLM (lesson 09).

    from paged_ref.engine import Engine, load_smollm2
    model, tokenizer = load_smollm2()                 # SmolLM2-135M-Instruct, float32, CPU
    engine = Engine(model, num_blocks=256, block_size=16, enable_prefix_caching=True)
    engine.generate([tokenizer.encode("Hi")], max_new_tokens=16)   # -> [[token ids]]

Modules, one job each: :mod:`~paged_ref.engine.request` (a request's state),
:mod:`~paged_ref.engine.policy` (admission and preemption choices),
:mod:`~paged_ref.engine.scheduler` (continuous batching, chunked prefill, preemption),
:mod:`~paged_ref.engine.runner` (the model over the paged cache, CUDA graphs),
:mod:`~paged_ref.engine.engine` (``Engine.generate``, step events),
:mod:`~paged_ref.engine.ops` (every call into the rest of ``paged_ref``),
:mod:`~paged_ref.engine.loader` (``load_smollm2``). ``python -m paged_ref.engine --prompt "..."``
chats with SmolLM2 through the engine.

transformers is imported only when an engine is built or a model loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_ref.engine.loader import load_smollm2

if TYPE_CHECKING:
    from paged_ref.engine.engine import Engine, RunStats, StepEvent

__all__ = ["Engine", "RunStats", "StepEvent", "load_smollm2"]


def __getattr__(name: str):
    if name in ("Engine", "RunStats", "StepEvent"):
        from paged_ref.engine import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'paged_ref.engine' has no attribute {name!r}")
