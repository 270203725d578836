"""``SamplingParams``: how one request picks its tokens and when it stops (vLLM's shape)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Real

from paged_ref.memory.allocator import check_int


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling and stopping rules, checked at construction.

    Args:
        max_tokens: stop after this many generated tokens (>= 1).
        temperature: 0 (default): greedy, the argmax, exactly transformers'
            ``do_sample=False``. > 0: sample from ``softmax(logits / temperature)``.
        top_p: keep the most likely tokens until their probability reaches ``top_p``
            (``0 < top_p <= 1``; 1: off).
        top_k: keep the ``top_k`` most likely tokens (0: off).
        seed: draw from the request's own ``torch.Generator`` seeded with it: the same tokens
            on every run on one device. None: torch's default generator.
        n: completions of the prompt; only 1 for now.
        stop_token_ids: stop right after emitting one of these (it is kept in the output).
        ignore_eos: do not stop at the model's EOS token(s).

    Raises:
        TypeError: a field of the wrong type (the message names it).
        ValueError: a value out of range, or ``n != 1``.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    n: int = 1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        check_int("max_tokens", self.max_tokens, minimum=1)
        check_int("top_k", self.top_k)
        if self.seed is not None:
            check_int("seed", self.seed)
        if check_int("n", self.n, minimum=1) != 1:
            raise ValueError("n > 1 is not supported yet (parallel sampling)")
        temperature, top_p = _real("temperature", self.temperature), _real("top_p", self.top_p)
        if not 0 <= temperature < math.inf:
            raise ValueError(f"temperature must be a finite float >= 0, got {temperature}")
        if not 0 < top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not hasattr(self.stop_token_ids,
                                                                        "__iter__"):
            raise TypeError("stop_token_ids must be a sequence of token ids, got "
                            f"{type(self.stop_token_ids).__name__}")
        stops = tuple(check_int(f"stop_token_ids[{i}]", t)
                      for i, t in enumerate(self.stop_token_ids))
        object.__setattr__(self, "stop_token_ids", stops)  # (frozen: a list becomes a tuple)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

    @property
    def greedy(self) -> bool:
        """Whether the request takes the argmax (temperature 0)."""
        return self.temperature == 0


def _real(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a float, got {type(value).__name__} ({value!r})")
    return float(value)
