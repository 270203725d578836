"""``SamplingParams``: how one request picks its tokens and when it stops (vLLM's shape), and
``as_token_ids``: token ids from the lists, tensors and arrays callers pass."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np
import torch

from paged_ref.memory.allocator import check_int


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling and stopping rules, checked at construction.

    Args:
        max_tokens: stop after this many generated tokens (>= 1).
        temperature: 0: greedy, the argmax (transformers' ``do_sample=False``, exactly).
            > 0: sample from ``softmax(logits / temperature)``.
        top_p: keep the likeliest tokens until their probability reaches it (1: off).
        top_k: keep the ``top_k`` likeliest tokens (0: off).
        seed: draw from a ``torch.Generator`` of the request's own, seeded with it: the same
            tokens on every run on one device. None: torch's default generator. Sample ``i``
            of ``n`` has a generator of its own, seeded with :meth:`sample_seed` ``(i)``.
        n: completions of the prompt (parallel sampling): its prompt is computed once and the
            ``n`` samples share its blocks (forked at the first token, copied on write).
        stop_token_ids: stop right after emitting one of these (it is kept in the output).
        ignore_eos: do not stop at the model's EOS token(s).

    Raises:
        TypeError: a field of the wrong type. ValueError: one out of range.
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
        check_int("n", self.n, minimum=1)
        for name, ok, expected in (("temperature", lambda t: 0 <= t < math.inf, "finite, >= 0"),
                                   ("top_p", lambda p: 0 < p <= 1, "in (0, 1]")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real):
                raise TypeError(f"{name} must be a float, got {type(value).__name__}")
            if not ok(value):
                raise ValueError(f"{name} must be {expected}, got {value}")
        stops = tuple(as_token_ids("stop_token_ids", self.stop_token_ids))
        object.__setattr__(self, "stop_token_ids", stops)  # (frozen: a list becomes a tuple)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool, got {type(self.ignore_eos).__name__}")

    @property
    def greedy(self) -> bool:
        """Whether the request takes the argmax (temperature 0)."""
        return self.temperature == 0

    def sample_seed(self, i: int) -> int | None:
        """The seed of sample ``i``'s generator: ``seed`` for sample 0 (so ``n = 1`` is as it
        always was), the first 64-bit word of ``numpy.random.SeedSequence([seed, i])`` for the
        others (independent streams, the same on every run); None without a seed."""
        if self.seed is None or i == 0:
            return self.seed
        return int(np.random.SeedSequence([self.seed, i]).generate_state(1, np.uint64)[0])


def as_token_ids(name: str, value, *, scalar: bool = False, minimum: int | None = 0) -> list[int]:
    """``value`` as a list of token ids.

    Args:
        name: the argument, for messages.
        value: a list / tuple of ints (NumPy ints too), a 1-D integer tensor or NumPy array;
            with ``scalar``, also one int, NumPy int or 0-d integer tensor / array.
        minimum: the smallest id allowed (None: no bound).

    Raises:
        TypeError: a string, floats (a float tensor too), a tensor of another rank.
        ValueError: an id below ``minimum``.
    """
    if isinstance(value, (torch.Tensor, np.ndarray)):
        dtype = value.dtype
        if (dtype in (torch.bool, np.bool_) or dtype.is_floating_point or dtype.is_complex
                if isinstance(value, torch.Tensor) else not np.issubdtype(dtype, np.integer)):
            raise TypeError(f"{name} must hold integer token ids, got dtype {dtype}")
        if value.ndim not in ((0, 1) if scalar else (1,)):
            raise TypeError(f"{name} must be 1-D, got shape {tuple(value.shape)}")
        value = value.tolist()
    if scalar and isinstance(value, Integral) and not isinstance(value, bool):
        value = [value]
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        hint = " (encode text with the tokenizer first)" if isinstance(value, str) else ""
        raise TypeError(f"{name} must be a list of token ids, got {type(value).__name__}{hint}")
    ids = list(value)
    if all(type(t) is int for t in ids) and (minimum is None or min(ids, default=0) >= minimum):
        return ids  # (most calls: plain ints, checked at C speed; else the one at fault named)
    return [check_int(f"{name}[{j}]", t, minimum=minimum) for j, t in enumerate(ids)]
