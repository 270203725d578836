"""A serving step's cost in seconds, from what the step computed: the simulated clock's model.

    seconds = a + b * tokens + c * seqs + d * kv_tokens

``tokens``: tokens run through the model this step (prompt chunks + one per decoding request);
``seqs``: requests in the step; ``kv_tokens``: the cached tokens their attention reads (the sum
of their lengths after the step). ``a`` is the fixed cost of a step (launches, the host's
scheduling, the weights read once), ``b`` the matmul cost of a token, ``c`` the host and
sampling cost of a request, ``d`` the cost of reading one token's K/V. All four are >= 0:
:func:`fit` is a non-negative least-squares fit to steps measured on a GPU
(``python -m paged_bench serving`` records every step's shape and time).

:data:`PRIOR_H200` is what the lessons use until a fitted model is committed: derived by hand
from the committed decode-step timings of ``results/h200/engine.json`` (stated there).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class StepShape:
    """What one step computed: ``tokens``, ``seqs`` (requests), ``kv_tokens`` (cached tokens
    attended, summed over its requests)."""

    tokens: int = 0
    seqs: int = 0
    kv_tokens: int = 0


@dataclass(frozen=True)
class CostModel:
    """``seconds = a + b * tokens + c * seqs + d * kv_tokens`` (coefficients in s, s/token,
    s/request, s/KV token; all >= 0)."""

    a: float
    b: float = 0.0
    c: float = 0.0
    d: float = 0.0

    def __post_init__(self) -> None:
        for name in "abcd":
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (
                    v >= 0 and math.isfinite(v)):
                raise ValueError(f"CostModel.{name} must be a finite number >= 0, got {v!r}")

    def seconds(self, shape: StepShape) -> float:
        """The step's predicted seconds."""
        return self.a + self.b * shape.tokens + self.c * shape.seqs + self.d * shape.kv_tokens

    __call__ = seconds

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> CostModel:
        return cls(*(float(d[k]) for k in "abcd"))


#: Until ``results/h200/serving.json`` holds a fitted model: the Llama-3.2-1B-like shape's
#: decode steps in ``results/h200/engine.json`` (CUDA graphs, 284 cached tokens a request):
#: 1.94 ms at batch 64 and 3.17 ms at batch 256. ``d`` = one token's K/V (32 KiB) at the
#: measured copy bandwidth (4.27 TB/s), ``b`` = a token's matmuls (2 x 1.24 G multiply-adds)
#: at ~800 TFLOP/s; ``a`` and ``c`` solve the two decode steps for what is left.
PRIOR_H200 = CostModel(a=1.53e-3, b=3.0e-6, c=1.2e-6, d=7.7e-9)


def _design(rows: np.ndarray) -> np.ndarray:
    return np.column_stack([np.ones(len(rows)), rows[:, 0], rows[:, 1], rows[:, 2]])


def fit(rows: Iterable) -> CostModel:
    """The non-negative least-squares :class:`CostModel` of measured steps.

    Args:
        rows: ``(tokens, seqs, kv_tokens, seconds)`` per step (at least one).

    Returns:
        The coefficients ``(a, b, c, d) >= 0`` minimising the squared error of the predicted
        seconds. Exact: every subset of the four terms is fitted unconstrained and the best fit
        whose coefficients are all >= 0 wins (the NNLS optimum is one of them).

    Raises:
        ValueError: no rows, a row without four numbers, or a negative or non-finite value.
    """
    data = np.asarray([list(r) for r in rows], dtype=np.float64)
    if data.ndim != 2 or data.shape[0] == 0 or data.shape[1] != 4:
        raise ValueError(f"rows must be (tokens, seqs, kv_tokens, seconds) tuples, at least "
                         f"one; got an array of shape {data.shape}")
    if not np.isfinite(data).all() or (data < 0).any():
        raise ValueError("rows must hold finite numbers >= 0")
    x, y = _design(data[:, :3]), data[:, 3]
    scale = np.maximum(np.abs(x).max(axis=0), 1e-30)  # NOTE: columns differ by 1e5 in size
    xs = x / scale
    best, best_err = np.zeros(4), float(np.sum(y**2))
    for k in range(1, 5):
        for cols in itertools.combinations(range(4), k):
            coef, *_ = np.linalg.lstsq(xs[:, cols], y, rcond=None)
            if (coef < 0).any():
                continue
            full = np.zeros(4)
            full[list(cols)] = coef
            err = float(np.sum((xs @ full - y) ** 2))
            if err < best_err - 1e-18 * max(1.0, best_err):
                best, best_err = full, err
    return CostModel(*(float(v) for v in best / scale))


def fit_error(model: CostModel, rows: Iterable) -> dict:
    """How well ``model`` predicts ``rows`` (as :func:`fit`'s): ``r2`` and the median and
    total relative error (predicted total seconds / measured total - 1)."""
    data = np.asarray([list(r) for r in rows], dtype=np.float64)
    pred = np.array([model(StepShape(*map(int, r[:3]))) for r in data])
    y = data[:, 3]
    ss = float(np.sum((y - y.mean()) ** 2))
    return {"r2": 1 - float(np.sum((y - pred) ** 2)) / ss if ss else float("nan"),
            "median_rel_error": float(np.median(np.abs(pred - y) / np.maximum(y, 1e-12))),
            "total_rel_error": float(pred.sum() / max(y.sum(), 1e-12) - 1), "steps": len(y)}


def committed(model: str = "smollm2-135m-real") -> tuple[CostModel, str]:
    """The per-step cost model of the committed GPU run (``results/h200/serving.json``, the
    ``"wall"`` fit of ``model``'s steps) and a line that says where it comes from; without a
    committed run, :data:`PRIOR_H200` and a line that says so."""
    from paged_course.results import result_path

    path = result_path("serving")
    if path.exists():
        import json

        data = json.loads(path.read_text())
        fitted = data.get("cost_models", {}).get(model)
        if fitted:
            return (CostModel.from_dict(fitted["wall"]), f"fitted to {fitted['wall']['steps']} "
                    f"steps of {model} on the {data['gpu']}, {data['date']} ({path.name})")
    return PRIOR_H200, ("PRIOR_H200: no committed serving run yet; derived from the committed "
                        "decode steps of results/h200/engine.json")
