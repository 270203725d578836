"""``paged_ref.engine``: a small serving engine on a real LLM (lesson 09, ``docs/engine.md``).

    model, tokenizer = load_smollm2()                 # SmolLM2-135M-Instruct, float32, CPU
    engine = Engine(model, num_blocks=256, block_size=16)
    engine.generate([tokenizer.encode("Hi")], max_new_tokens=16)        # -> [[token ids]]
    engine.generate([ids], params=SamplingParams(max_tokens=16, temperature=0.8, n=4))  # 4 each
    engine.beam_search([ids], beam_width=4, max_tokens=16)   # [RequestOutput]: .outputs, scores
    rid = engine.add_request(tokenizer.encode("Hi"), SamplingParams(max_tokens=16))
    while engine.has_unfinished_requests():
        outputs = engine.step()                       # -> [RequestOutput]

``python -m paged_ref.chat --prompt "..."`` chats with SmolLM2 through the engine.
transformers is imported only when an engine is built or a model loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from paged_ref.models.loader import load_smollm2
from paged_ref.outputs import CompletionOutput, RequestMetrics, RequestOutput, RunStats, StepEvent
from paged_ref.sampling.params import SamplingParams

if TYPE_CHECKING:
    from paged_ref.engine.engine import Engine

__all__ = ["CompletionOutput", "Engine", "RequestMetrics", "RequestOutput", "RunStats",
           "SamplingParams", "StepEvent", "load_smollm2"]


def __getattr__(name: str):
    if name == "Engine":
        from paged_ref.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'paged_ref.engine' has no attribute {name!r}")
