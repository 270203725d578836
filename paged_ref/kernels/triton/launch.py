"""Shorter launch paths for the Triton kernels (lesson 06: the cost around a kernel).

``kernel[grid](*args)`` cost 31.5 us of host time in Triton 3.6 for ``split_kv_kernel``'s ~40
arguments, measured on the host of a two-H200 machine:

* 9.7 us in the *binder*, which reads every argument's specialisation (dtype of each tensor,
  16-byte alignment of each pointer, integers equal to 1 or divisible by 16): the compiled
  kernel depends on these;
* 10.6 us in the compiled kernel's launcher (the C function that calls ``cuLaunchKernel``),
  which, for each tensor argument, calls its ``data_ptr()`` and asks the driver what the
  pointer is (``cuPointerGetAttribute``, to refuse a CPU tensor);
* the other ~11 us in the rest of ``JITFunction.run``: Triton's settings read from the
  environment, the cache-key string, the check that global values did not change, launch hooks.

Two paths cut it:

* :func:`launch` keeps the first two and skips the third after the first call: it runs Triton's
  own binder, looks the compiled kernel up by the specialisation in a dict of its own (filled by
  an ordinary ``kernel[grid](...)`` launch the first time each specialisation is seen, which
  compiles and checks as usual), and calls the launcher.
* :class:`BoundLaunch` (the planned call's path, :mod:`paged_ref.planned`) skips all three: a
  launch recorded once (:func:`recording`) is bound to its compiled kernel and every argument
  but the call's own tensors, which come as raw pointers (ints: the launcher neither calls
  ``data_ptr()`` nor asks the driver). It is only sound for calls whose specialisation is
  the recorded one, which its caller guarantees (same dtypes, shapes, strides, devices, and
  pointers 16-byte aligned, as when it was recorded).

What both leave out: Triton's launch hooks (profilers such as proton see these launches only
through CUPTI) and the re-check of global values (ours are constants). In Triton's interpreter
both are ``kernel[grid](...)``. Every launch ends in :func:`run_kernel` (a benchmark of the host
path replaces it with a no-op).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

from paged_ref import _device

_COMPILED: dict = {}  # (kernel, device, specialisation, options) -> CompiledKernel
#: The launches of the call being recorded: a list of (kernel, grid, args, kwargs), or None.
_RECORDING: contextvars.ContextVar[list | None] = contextvars.ContextVar("recording",
                                                                         default=None)


def run_kernel(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``: the last step of every launch (the one place a benchmark of
    the host path stubs out)."""
    return fn(*args, **kwargs)


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, with less host time on a GPU (see the module doc).

    Args:
        kernel: a ``@triton.jit`` function.
        grid: programs per axis (1 to 3 ints).
        args, kwargs: the kernel's arguments; ``args[0]`` is a tensor (its first output).
    """
    recorded = _RECORDING.get()
    if recorded is not None:
        recorded.append((kernel, grid, args, kwargs))
    device = None if _device.INTERPRET else torch.cuda.current_device()
    if device is None or args[0].device.index != device:
        # The interpreter; or tensors on another GPU than the current one (Triton's own path
        # copes with that, through peer access; this short one was measured only without it).
        run_kernel(kernel[grid], *args, **kwargs)
        return
    key, compiled, bound = _lookup(kernel, device, args, kwargs)
    if compiled is None:  # first time: Triton's own path (compile, checks, launch)
        _COMPILED[key] = run_kernel(kernel[grid], *args, **kwargs)
        return
    grid = tuple(grid) + (1,) * (3 - len(grid))
    stream = _device.current_stream_handle(device)
    run_kernel(compiled.run, *grid, stream, compiled.function, compiled.packed_metadata, None,
               None, None, *bound.values())


def _lookup(kernel, device: int, args, kwargs) -> tuple:
    """``(key, CompiledKernel or None, bound arguments)``: Triton's binder reads the
    arguments' specialisation; the compiled kernel is the one :func:`launch` stored for it."""
    binder = kernel.device_caches[device][4]
    bound, specialization, options = binder(*args, **kwargs)
    key = (kernel, device, tuple(specialization), tuple(options.items()))
    return key, _COMPILED.get(key), bound


@contextlib.contextmanager
def recording() -> Iterator[list]:
    """Inside, every :func:`launch` is also appended, as ``(kernel, grid, args, kwargs)``, to
    the list this yields (the launches still run). Per thread / async context."""
    launches: list = []
    token = _RECORDING.set(launches)
    try:
        yield launches
    finally:
        _RECORDING.reset(token)


class BoundLaunch:
    """One recorded launch, bound: call it with the new call's tensors (see the module doc).

    ``template`` holds every argument the launcher takes, in order, with the slots of the
    call's tensors (``slots``: (position, index into the call's tensors)) to be filled.
    Compiled: the C launcher's arguments, pointers as ints; in the interpreter: the kernel's
    positional arguments (tensors), ``kwargs`` its keywords.
    """

    __slots__ = ("fn", "kwargs", "keep", "slots", "template")

    def __init__(self, fn, template: list, slots: tuple, kwargs: dict, keep: tuple) -> None:
        self.fn, self.template, self.slots, self.kwargs, self.keep = (fn, template, slots,
                                                                       kwargs, keep)

    @classmethod
    def bind(cls, record: tuple, tensors: tuple, owned: tuple = ()) -> BoundLaunch | None:
        """Bind a recorded launch ``(kernel, grid, args, kwargs)``.

        Args:
            record: from :func:`recording`.
            tensors: the call's own tensors, distinct objects: their slots are filled at each
                call (every argument that *is* one of them).
            owned: tensors the caller keeps alive and passes unchanged at every call (a plan's
                scratch buffers): bound as they are.

        Returns:
            BoundLaunch, or None when the launch cannot be bound: an argument is a tensor that
            is neither the call's nor owned (a copy made for this call), or the kernel was not
            compiled by :func:`launch` on the current device.
        """
        kernel, grid, args, kwargs = record
        ids = {id(t): j for j, t in enumerate(tensors)}
        kept = {id(t) for t in owned}
        if _device.INTERPRET:
            values, fn, keywords = list(args), kernel[grid], kwargs
        else:
            device = torch.cuda.current_device()
            if args[0].device.index != device:
                return None
            _, compiled, bound = _lookup(kernel, device, args, kwargs)
            if compiled is None:
                return None
            values, keywords = list(bound.values()), {}
            fn, head = _launcher(compiled, tuple(grid) + (1,) * (3 - len(grid)))
        slots = []
        for i, value in enumerate(values):
            if not isinstance(value, torch.Tensor):
                continue
            if id(value) in ids:
                slots.append((i, ids[id(value)]))
                values[i] = None  # (not kept alive by the binding)
            elif id(value) not in kept:
                return None
            elif not _device.INTERPRET:
                values[i] = value.data_ptr()
        if not _device.INTERPRET:
            slots = [(i + len(head), j) for i, j in slots]
            values = head + values
        return cls(fn, values, tuple(slots), keywords, tuple(owned))

    def __call__(self, args: tuple, stream: int | None = None) -> None:
        """Launch with ``args`` in the slots (one per tensor given to :meth:`bind`: data
        pointers, ints, when compiled; the tensors in the interpreter) on ``stream`` (the
        handle of the current stream of the kernel's device; unused in the interpreter)."""
        values = self.template.copy()
        for i, j in self.slots:
            values[i] = args[j]
        if stream is not None:
            values[_STREAM] = stream
        run_kernel(self.fn, *values, **self.kwargs)


_STREAM = 3  # position of the stream in a compiled launcher's arguments (after the grid)


def _launcher(compiled, grid: tuple) -> tuple:
    """``(fn, head)``: the function to call and the arguments before the kernel's own. The C
    launcher itself when the kernel needs no scratch memory that Triton allocates per launch
    (its Python wrapper then does nothing but pass its settings on), else that wrapper."""
    run = compiled.run  # (loads the binary: sets compiled.function)
    settings = ("launch", "launch_cooperative_grid", "launch_pdl")
    no_scratch = (getattr(run, "global_scratch_size", 1) == 0
                  and getattr(run, "profile_scratch_size", 1) == 0)
    if no_scratch and all(hasattr(run, name) for name in settings):  # (Triton 3.6's launcher)
        c_launch = run.launch
        return c_launch, [*grid, None, compiled.function, run.launch_cooperative_grid,
                          run.launch_pdl, None, None, compiled.packed_metadata, None, None, None]
    return run, [*grid, None, compiled.function, compiled.packed_metadata, None, None, None]


__all__ = ["BoundLaunch", "launch", "recording", "run_kernel"]
