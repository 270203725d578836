"""What the compiler made of the decode kernels for an H100/H200 (sm_90), on a machine with no GPU.

This compiles ``paged_decode_kernel`` for a few cache formats and launch configs
(:mod:`paged_course.sm90`), specialised as a launch on the standard shape would be (32
query / 8 KV heads, head_dim 128, blocks of 16, bf16 q; pointers and strides divisible by 16),
and reads the machine code (SASS): registers a thread, shared memory, and how many
instructions of each kind the kernel holds (static counts; the token loop is most of the
kernel). Lesson 10 prints them next to the H200 times:

* ``LDSM`` (``ldmatrix``) loads a tensor-core operand from shared memory 16 bytes a thread at
  a time; it moves 16-bit elements, and transposes them if asked. ``LDS`` loads 1-16 bytes.
* ``F2FP`` converts e4m3 pairs to float16 pairs; ``HMMA`` is a float16 tensor-core product;
  ``LDGSTS`` an asynchronous copy global -> shared (``cp.async``).

    python tools/sass_mix.py            # writes results/cpu/sm90_sass_mix.json
    python tools/sass_mix.py --only bf16 --out /tmp/mix.json

Takes about 10 s on a CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # compile for real (set before triton is imported)

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from paged_course.results import environment, write_result  # noqa: E402
from paged_course.sm90 import compile_sm90, paged_kernel_values, sass_report  # noqa: E402
from paged_ref.kernels.triton import decode as triton_decode  # noqa: E402

#: Instruction kinds reported (the rest are counted in ``total``).
KINDS = ("LDS", "LDSM", "LDGSTS", "LDG", "STS", "HMMA", "F2FP", "IMAD", "MUFU", "SHFL")
#: (label, cache format, tile, warps, stages, prefetch): the defaults before and after this
#: round's sweeps.
KERNELS = [
    ("bf16, 64 tokens, 4 warps (default)", "bf16", 64, 4, 3, False),
    ("fp8, 128 tokens, 4 warps (default until 2026-11-30)", "fp8", 128, 4, 3, False),
    ("fp8, 64 tokens, 2 warps (default)", "fp8", 64, 2, 3, False),
    ("int4, 32 tokens, 4 warps (default until 2026-11-30)", "int4", 32, 4, 4, False),
    ("int4, 64 tokens, 2 warps, prefetch (default)", "int4", 64, 2, 1, True),
]
CACHE_DTYPES = {"bf16": torch.bfloat16, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}
FORMAT_CODES = {"bf16": 0, "fp8": 1, "int4": 3}
SHAPE = dict(BLOCK_SIZE=16, GROUP=4, GROUP_PAD=16, HEAD_DIM=128, HEAD_DIM_PAD=128)
#: Scale strides that a launch on the standard shape passes (block, token, head): fp8 per
#: tensor has none (0); int4's float16 [blocks, 16, 8, 2] scales.
SCALE_STRIDES = {"bf16": (0, 0, 0), "fp8": (0, 0, 0), "int4": (256, 16, 2)}


def compile_decode(fmt: str, tile: int, warps: int, stages: int, prefetch: bool = False):
    """``paged_decode_kernel`` compiled for sm_90 (Triton's CompiledKernel), as launched on the
    standard shape: every pointer aligned, every integer divisible by 16 but the scale strides."""
    kernel = triton_decode.paged_decode_kernel
    constexprs = dict(SHAPE, TILE=tile, DOT_PRECISION="tf32", DOT_UPCAST=False,
                      KV_FORMAT=FORMAT_CODES[fmt], INT4_GROUPS=2, PREFETCH=prefetch)
    values = paged_kernel_values(kernel, CACHE_DTYPES[fmt],
                                 torch.float16 if fmt == "int4" else torch.float32,
                                 SCALE_STRIDES[fmt])
    return compile_sm90(kernel, values, constexprs, dict(num_warps=warps, num_stages=stages))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="the kernels whose label contains this")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "cpu" / "sm90_sass_mix.json")
    args = parser.parse_args(argv)
    result = dict(environment(), target="sm_90 (compiled on a CPU, no GPU)",
                  shape=dict(SHAPE, num_q_heads=32, num_kv_heads=8, q="bfloat16"), rows=[])
    for label, fmt, tile, warps, stages, prefetch in KERNELS:
        if args.only not in label:
            continue
        row = dict(label=label, format=fmt, tile=tile, warps=warps, stages=stages,
                   prefetch=prefetch,
                   **sass_report(compile_decode(fmt, tile, warps, stages, prefetch), KINDS))
        row["programs_per_sm_by_registers"] = 65536 // (row["registers"] * 32 * warps)
        result["rows"].append(row)
        print(", ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    write_result(result, args.out)
    print("wrote", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
