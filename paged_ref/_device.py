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
    H200 machine's host (``docs/lab_notes.md``)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:  # (a torch built without CUDA; nothing is launched there)
        return torch.cuda.current_stream(device_index).cuda_stream
    return raw(device_index)


def triton_device() -> str:
    """The torch device Triton kernels take tensors on here: ``"cuda"`` or ``"cpu"``."""
    return "cpu" if INTERPRET or not HAS_CUDA else "cuda"


def describe() -> str:
    """One line saying where kernels run on this machine."""
    if HAS_CUDA and not INTERPRET:
        return f"GPU: {torch.cuda.get_device_name()} (Triton kernels are compiled)"
    if not HAS_TRITON:
        return "CPU, no Triton installed: only backend='torch' is available"
    return "CPU: Triton kernels run in Triton's interpreter (slow, for learning; small sizes)"
