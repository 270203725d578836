"""A shorter launch path for the decode kernels' hot calls (lesson 06: the cost around a kernel).

``kernel[grid](*args)`` cost 31.5 us of host time in Triton 3.6 for ``split_kv_kernel``'s ~40
arguments on the host of a two-H200 machine (tools/gpu/launch_probe.py,
results/h200/launch_path.json):

* 9.7 us in the *binder*, which reads every argument's specialisation (dtype of each tensor,
  16-byte alignment of each pointer, integers equal to 1 or divisible by 16): the compiled
  kernel depends on these, so they must be read on every call;
* 10.6 us in the compiled kernel's launcher (the C function that calls ``cuLaunchKernel``);
* the other ~11 us in the rest of ``JITFunction.run``: Triton's settings read from the
  environment, the cache-key string, the check that global values did not change, launch hooks.

:func:`launch` keeps the first two and skips the third after the first call: it runs Triton's
own binder, looks the compiled kernel up by the specialisation in a dict of its own (filled by
an ordinary ``kernel[grid](...)`` launch the first time each specialisation is seen, which
compiles and checks as usual), and calls the launcher. So a different dtype, alignment or
size still gets its own compiled kernel. What it leaves out: Triton's launch hooks (profilers
such as proton see these launches only through CUPTI) and the re-check of global values (ours
are constants). In Triton's interpreter it is ``kernel[grid](...)``.
"""

from __future__ import annotations

import torch

from paged_ref import _device

_COMPILED: dict = {}  # (kernel, device, specialisation, options) -> CompiledKernel


def launch(kernel, grid: tuple[int, ...], *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``, with less host time on a GPU (see the module doc).
    ``args[0]`` is a tensor (the kernel's first output)."""
    device = None if _device.INTERPRET else torch.cuda.current_device()
    if device is None or args[0].device.index != device:
        # The interpreter; or tensors on another GPU than the current one (Triton's own path
        # copes with that, through peer access; this short one was measured only without it).
        kernel[grid](*args, **kwargs)
        return
    binder = kernel.device_caches[device][4]
    bound, specialization, options = binder(*args, **kwargs)
    key = (kernel, device, tuple(specialization), tuple(options.items()))
    compiled = _COMPILED.get(key)
    if compiled is None:  # first time: Triton's own path (compile, checks, launch)
        _COMPILED[key] = kernel[grid](*args, **kwargs)
        return
    grid = tuple(grid) + (1,) * (3 - len(grid))
    stream = _device.current_stream_handle(device)
    compiled.run(*grid, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *bound.values())


__all__ = ["launch"]
