"""Comparisons that explain themselves: used by the tests and by the notebooks' check cells.

A bare ``assert torch.allclose(...)`` tells a learner nothing. These raise ``AssertionError``
with what differs: the relative error, how many entries are off, and the first positions with
expected vs got.
"""

from __future__ import annotations

import torch

#: Largest accepted ``‖out − ref‖ / ‖ref‖`` against a float64 reference, per output dtype.
REL_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2, torch.float64: 1e-12}


def tolerance(dtype: torch.dtype, rel_tol: float | None = None) -> float:
    """``rel_tol``, or the accepted relative error for an output of ``dtype`` (:data:`REL_TOL`;
    1e-2 for other dtypes)."""
    return REL_TOL.get(dtype, 1e-2) if rel_tol is None else rel_tol


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """``‖got − expected‖ / ‖expected‖`` in float64 (0 when both are all zeros)."""
    g = got.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    denom = e.norm().item()
    diff = (g - e).norm().item()
    return diff if denom == 0 else diff / denom


def _positions(mask: torch.Tensor, limit: int) -> list[tuple[int, ...]]:
    return [tuple(int(i) for i in idx) for idx in mask.nonzero()[:limit]]


def assert_close(
    got: torch.Tensor,
    expected: torch.Tensor,
    *,
    rel_tol: float | None = None,
    name: str = "output",
    show: int = 5,
) -> float:
    """Check ``got`` against ``expected`` (usually a float64 reference); return the relative error.

    ``rel_tol`` defaults to :data:`REL_TOL` for ``got``'s dtype. On failure the message lists the
    relative error, the count of entries off by more than the tolerance, and the first ``show``
    positions as ``expected vs got``.
    """
    if not isinstance(got, torch.Tensor):
        raise AssertionError(f"{name}: expected a torch.Tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        raise AssertionError(
            f"{name}: shape {tuple(got.shape)} but expected {tuple(expected.shape)}"
        )
    tol = tolerance(got.dtype, rel_tol)
    g = got.detach().to("cpu", torch.float64)
    e = expected.detach().to("cpu", torch.float64)
    bad_nan = torch.isnan(g) & ~torch.isnan(e)
    if bad_nan.any():
        raise AssertionError(
            f"{name}: {int(bad_nan.sum())} NaN entries where the reference is finite, first at "
            f"{_positions(bad_nan, show)}"
        )
    err = relative_error(g, e)
    if err <= tol:
        return err
    # Entries off by more than the tolerance, scaled by the reference's typical magnitude.
    scale = e.abs().max().item() or 1.0
    off = (g - e).abs() > tol * scale
    lines = [
        f"{name}: relative error {err:.3e} > tolerance {tol:.0e} "
        f"({int(off.sum())} of {off.numel()} entries differ by more than {tol * scale:.2e})"
    ]
    for pos in _positions(off, show):
        lines.append(f"  at {pos}: expected {e[pos].item():+.6f}, got {g[pos].item():+.6f}")
    raise AssertionError("\n".join(lines))


def assert_equal(got, expected, *, name: str = "value") -> None:
    """Exact comparison for integers, lists and integer tensors, with the first differences."""
    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        g = torch.as_tensor(got).cpu()
        e = torch.as_tensor(expected).cpu()
        if g.shape != e.shape:
            raise AssertionError(f"{name}: shape {tuple(g.shape)} but expected {tuple(e.shape)}")
        diff = g != e
        if diff.any():
            lines = [f"{name}: {int(diff.sum())} of {diff.numel()} entries differ"]
            for pos in _positions(diff, 5):
                lines.append(f"  at {pos}: expected {e[pos].item()}, got {g[pos].item()}")
            raise AssertionError("\n".join(lines))
        return
    if got != expected:
        if isinstance(got, list) and isinstance(expected, list):
            for i, (a, b) in enumerate(zip(got, expected, strict=False)):
                if a != b:
                    raise AssertionError(
                        f"{name}: first difference at index {i}: expected {b!r}, got {a!r}\n"
                        f"  expected {expected!r}\n  got      {got!r}"
                    )
            raise AssertionError(
                f"{name}: length {len(got)} but expected {len(expected)}\n"
                f"  expected {expected!r}\n  got      {got!r}"
            )
        raise AssertionError(f"{name}: expected {expected!r}, got {got!r}")
