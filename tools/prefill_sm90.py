"""Compile the Triton prefill kernel for an H100/H200 (sm_90) on a machine with no GPU, for every
cache format (plain, FP8 per tensor, FP8 per token-head, INT4) and both default tile shapes.

Triton's interpreter runs a kernel but never compiles it: a kernel the compiler rejects (two
``return`` statements of different types, say, in branches the interpreter never takes) passes
every CPU test. This catches that, and prints what each build costs: registers a thread and
shared memory (the standard shape: bf16 q, 32 query / 8 KV heads, head_dim 128, blocks of 16).

    python tools/prefill_sm90.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile for real (set before triton is imported)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from paged_course.sm90 import compile_sm90, paged_kernel_values, sass_report  # noqa: E402
from paged_ref.kernels.triton import prefill as triton_prefill  # noqa: E402

#: format -> (KV_FORMAT, cache dtype, scale dtype, scale strides (block, token, head))
FORMATS = {
    "bf16": (0, torch.bfloat16, torch.float32, (0, 0, 0)),
    "fp8": (1, torch.float8_e4m3fn, torch.float32, (0, 0, 0)),
    "fp8_token_head": (2, torch.float8_e4m3fn, torch.float32, (128, 8, 1)),
    "int4": (3, torch.uint8, torch.float16, (256, 16, 2)),
}


def compile_prefill(fmt: str, config: triton_prefill.PrefillConfig):
    """``paged_prefill_kernel`` for sm_90 as launched on the standard shape (GQA 4)."""
    code, cache_dtype, scale_dtype, scale_strides = FORMATS[fmt]
    kernel = triton_prefill.paged_prefill_kernel
    values = paged_kernel_values(kernel, cache_dtype, scale_dtype, scale_strides)
    constexprs = dict(BLOCK_SIZE=16, GROUP=4, HEAD_DIM=128, HEAD_DIM_PAD=128,
                      BLOCK_M=config.block_m, BLOCK_Q=config.block_m // 4,
                      BLOCK_N=config.block_n, CAUSAL=True, DOT_PRECISION="tf32",
                      DOT_UPCAST=False, USE_SEQ_IDS=False, KV_FORMAT=code, INT4_GROUPS=2)
    return compile_sm90(kernel, values, constexprs,
                        dict(num_warps=config.num_warps, num_stages=config.num_stages))


def main() -> int:
    configs = {"default": triton_prefill.default_config(128, torch.bfloat16, interpret=False),
               "short": triton_prefill.SHORT_CONFIG}
    for fmt in FORMATS:
        for label, config in configs.items():
            report = sass_report(compile_prefill(fmt, config), ())
            print(f"{fmt:15s} {label:8s} {report['registers']:3d} registers, "
                  f"{report['shared_bytes']:6d} B shared, {report['total']} instructions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
