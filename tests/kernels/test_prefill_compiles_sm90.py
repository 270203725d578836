"""The prefill kernel compiles for sm_90 in every cache format, on a machine with no GPU.

The interpreter never compiles a kernel, so a kernel the compiler rejects passes every other
CPU test (it happened: two ``return`` statements of different types in branches of a
compile-time ``if``). Run in a subprocess: it compiles for real, so Triton must not be in
interpreter mode.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from paged_course import ROOT

ENV = {**os.environ, "TRITON_INTERPRET": "0"}


def test_every_format_compiles_for_sm90():
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "prefill_sm90.py")], env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    built = [line.split()[:2] for line in done.stdout.splitlines()]
    assert built == [[fmt, shape] for fmt in ("bf16", "fp8", "fp8_token_head", "int4")
                     for shape in ("default", "short")]


def test_a_kernel_the_compiler_rejects_is_caught(tmp_path):
    """The planted mistake: returns of two types, one in a branch the launch never takes."""
    script = tmp_path / "bad_kernel.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        import torch
        import triton
        import triton.language as tl
        sys.path.insert(0, {str(ROOT)!r})
        from paged_course.sm90 import compile_sm90

        @triton.jit
        def load(ptr, INT: tl.constexpr):
            if INT:
                return tl.load(ptr + tl.arange(0, 16)).to(tl.float32)
            return tl.load(ptr + tl.arange(0, 16))

        @triton.jit
        def kernel(x_ptr, out_ptr, INT: tl.constexpr):
            tl.store(out_ptr + tl.arange(0, 16), load(x_ptr, INT).to(tl.float32))

        x = torch.empty(0, dtype=torch.uint8)
        try:
            compile_sm90(kernel, dict(x_ptr=x, out_ptr=torch.empty(0)), dict(INT=True), {{}})
        except triton.compiler.errors.CompilationError as err:
            print("rejected:", "Inconsistent return types" in str(err.__cause__))
    """))
    done = subprocess.run([sys.executable, str(script)], env=ENV, capture_output=True,
                          text=True, timeout=300)
    assert done.stdout.strip() == "rejected: True", done.stdout + done.stderr[-2000:]
