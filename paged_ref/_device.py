"""Where the kernels run: compiled on an NVIDIA GPU, or in Triton's interpreter on the CPU.

This module is imported first by ``paged_ref`` so that ``TRITON_INTERPRET=1`` is set *before*
anything imports triton (the interpreter is chosen at import time). A learner never has to set
it by hand. It never imports triton itself: on macOS there are no Triton wheels, and the
``torch`` backend must still work there.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import warnings

import torch

HAS_CUDA: bool = torch.cuda.is_available()

if not HAS_CUDA and "TRITON_INTERPRET" not in os.environ:
    if "triton" in sys.modules:
        warnings.warn(
            "triton was imported before paged_ref on a machine without a GPU, so Triton's "
            "interpreter is off and the Triton kernels cannot run. Import paged_ref first "
            "(or set TRITON_INTERPRET=1 before starting Python).",
            stacklevel=2,
        )
    else:
        os.environ["TRITON_INTERPRET"] = "1"

#: True when Triton kernels run in the interpreter (on CPU tensors) rather than compiled.
INTERPRET: bool = os.environ.get("TRITON_INTERPRET") == "1"

#: True when the ``triton`` package is installed (it has no wheels for macOS or Windows).
HAS_TRITON: bool = importlib.util.find_spec("triton") is not None


def current_stream_handle(device_index: int) -> int:
    """The handle (``cudaStream_t`` as an int) of ``device_index``'s current CUDA stream, to
    pass to a launch. Taken as Triton's launcher takes it (~0.3 us): ``torch.cuda.
    current_stream(i).cuda_stream`` builds a Stream object first, ~20 us of host time on the
    H200 machine's host."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:  # (a torch built without CUDA; nothing is launched there)
        return torch.cuda.current_stream(device_index).cuda_stream
    return raw(device_index)


def triton_device() -> str:
    """The torch device Triton kernels take tensors on here: ``"cuda"`` or ``"cpu"``."""
    return "cpu" if INTERPRET or not HAS_CUDA else "cuda"


def triton_runs_on(device: torch.device | str) -> bool:
    """Can a Triton kernel run on tensors on ``device`` here?

    The one place that decides. In Triton's interpreter (``INTERPRET``, set on machines
    without a GPU) kernels take CPU tensors only; compiled, CUDA tensors only. Never with
    the triton package missing.

    Args:
        device: a ``torch.device`` or its name (``"cpu"``, ``"cuda:1"``, ``"meta"``, ...).

    Returns:
        bool: True when a Triton backend may be handed tensors on ``device``.
    """
    if not HAS_TRITON:
        return False
    return torch.device(device).type == ("cpu" if INTERPRET else "cuda")


def check_triton_device(backend: str, name: str, device: torch.device | str) -> None:
    """Refuse, before any launch, a Triton backend asked to run on tensors it cannot read.

    Args:
        backend: what the caller asked for, for the message (``"triton"``, ``"triton_split"``,
            ``"fused_backend='triton'"``, ...).
        name: the argument whose device this is (``"q"``, ``"k"``, ``"h"``, ...).
        device: that argument's device.

    Raises:
        RuntimeError: triton is not installed here.
        ValueError: :func:`triton_runs_on` says no; the message says what to do.
    """
    label = backend if "=" in backend else f"backend={backend!r}"
    if not HAS_TRITON:
        raise RuntimeError(f"{label} needs the triton package, which is not installed here "
                           "(Triton has no wheels for macOS or Windows); use backend='torch'")
    if triton_runs_on(device):
        return
    if INTERPRET:
        raise ValueError(
            f"{label}: {name} is on {device}, but Triton runs in its interpreter here "
            "(TRITON_INTERPRET=1), which reads CPU tensors only: move the tensors to the CPU "
            "(.cpu()) or use backend='torch' (or 'auto')")
    raise ValueError(
        f"{label}: {name} is on {device}, but Triton kernels are compiled for the GPU here "
        "and read CUDA tensors only: move the tensors to the GPU (.cuda()) or use "
        "backend='torch' (or 'auto', which picks what runs on them)")


def compiled_triton_on(device: torch.device | str) -> bool:
    """Do compiled Triton kernels run on ``device`` (a CUDA GPU, not the interpreter)? What
    every ``backend="auto"`` asks: the interpreter is for learning, never picked for speed."""
    return torch.device(device).type == "cuda" and triton_runs_on(device)


def describe() -> str:
    """One line saying where kernels run on this machine."""
    if HAS_CUDA and not INTERPRET:
        return f"GPU: {torch.cuda.get_device_name()} (Triton kernels are compiled)"
    if not HAS_TRITON:
        return "CPU, no Triton installed: only backend='torch' is available"
    return "CPU: Triton kernels run in Triton's interpreter (slow, for learning; small sizes)"


#: ``Engine``'s ``attention_backend`` / ``fused_backend`` values.
ENGINE_BACKENDS = ("auto", "torch", "triton")


def check_engine_backends(device: torch.device, attention_backend, fused_backend,
                          cuda_graphs) -> None:
    """``Engine``'s check: ``ValueError`` / ``TypeError`` unless the backends and
    ``cuda_graphs`` can run on ``device`` here (Triton: in its interpreter on CPU tensors,
    compiled on CUDA ones)."""
    for name, value in (("attention_backend", attention_backend),
                        ("fused_backend", fused_backend)):
        if value not in ENGINE_BACKENDS:
            raise ValueError(f"{name} must be one of {ENGINE_BACKENDS}, got {value!r}")
        if value == "triton" and not triton_runs_on(device):
            raise ValueError(f"{name}='triton' cannot run on the model's device ({device}) "
                             f"here: {describe()}")
    if cuda_graphs is not None and not isinstance(cuda_graphs, bool):
        raise TypeError(f"cuda_graphs must be a bool or None, got {cuda_graphs!r}")
    if cuda_graphs and device.type != "cuda":
        raise ValueError(f"cuda_graphs=True needs the model on a CUDA GPU; it is on {device}")
