"""Compile a Triton kernel for an H100/H200 (sm_90) on a machine with no GPU, and read its code.

Triton compiles for a GPU it is not running on when given the target, and its wheel carries
NVIDIA's ``cuobjdump``. :func:`compile_sm90` specialises the kernel as a launch with the given
argument values would (a pointer is 16-byte aligned; an integer equal to 1 becomes a constant,
one divisible by 16 is marked so); :func:`sass_report` reads the machine code (SASS): registers
a thread, shared memory, instruction counts. Used by ``tools/sass_mix.py`` and
``tools/prefill_sm90.py``. Needs ``TRITON_INTERPRET=0`` (set before triton is
imported): the interpreter has no compiler.
"""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from pathlib import Path

import torch
import triton

#: Triton's names of the dtypes of kernel arguments.
TRITON_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32",
                 torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv", torch.int32: "i32"}


def compile_sm90(kernel, values: dict, constexprs: dict, options: dict):
    """``kernel`` (a ``@triton.jit`` function) compiled for sm_90, as launched with ``values``
    (argument name -> tensor, int or float; a tensor's dtype is all that is read) and
    ``constexprs`` (name -> value); ``options``: ``num_warps``, ``num_stages``, ...
    Returns Triton's CompiledKernel (``.asm`` holds ``ttgir``, ``ptx``, ``cubin``)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if not isinstance(kernel, triton.runtime.JITFunction):
        raise RuntimeError("compiling needs TRITON_INTERPRET=0 (set before importing triton)")
    constexprs = dict(constexprs)
    signature, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        value = values.get(name)
        if name in constexprs:
            signature[name] = "constexpr"
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + TRITON_DTYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, float):
            signature[name] = "fp32"
        elif value == 1:
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = "i32"
            if value % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constexprs, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def paged_kernel_values(kernel, cache_dtype: torch.dtype, scale_dtype: torch.dtype,
                        scale_strides: tuple[int, int, int]) -> dict:
    """Argument values for :func:`compile_sm90` of a paged attention kernel launched on the
    standard shape: K/V pointers of ``cache_dtype``, ``out`` / ``q`` bf16, scale and zero
    pointers of ``scale_dtype``, other pointers int32 (only their dtypes are read); the scales'
    ``(block, token, head)`` strides as given; the softmax scale a float; every other integer
    16 (aligned, as on the standard shape)."""
    values = dict(zip(("stride_sb", "stride_st", "stride_sh"), scale_strides, strict=True))
    for name in kernel.arg_names:
        if name.endswith("_ptr"):
            values[name] = torch.empty(0, dtype=(
                cache_dtype if name in ("k_cache_ptr", "v_cache_ptr")
                else torch.bfloat16 if name in ("out_ptr", "q_ptr")
                else scale_dtype if "scale" in name or "zero" in name else torch.int32))
        elif name == "qk_scale":
            values[name] = 0.125
        else:
            values.setdefault(name, 16)
    return values


def sass_report(compiled, kinds: tuple[str, ...]) -> dict:
    """Registers, shared memory, the total instruction count and the count of each of
    ``kinds`` (SASS opcodes such as ``"LDS"``, ``"HMMA"``) of a compiled kernel."""
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], check=True,
                               capture_output=True, text=True).stdout
        sass = subprocess.run([tools / "cuobjdump", "-sass", cubin], check=True,
                              capture_output=True, text=True).stdout
    counts = collections.Counter()
    for line in sass.splitlines():  # "  /*0120*/  @!P0 LDS.U8 R4, [R2+0x10] ;"
        m = re.match(r"\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            counts[m.group(1)] += 1
    return dict(registers=int(re.search(r"REG:(\d+)", usage).group(1)),
                shared_bytes=compiled.metadata.shared, total=sum(counts.values()),
                **{kind: counts[kind] for kind in kinds})


__all__ = ["TRITON_DTYPES", "compile_sm90", "paged_kernel_values", "sass_report"]
