"""The CUDA FP8 kernel's host side, without a GPU: the checks that refuse what it does not
read, the chunking, and (where nvcc is installed) that the source compiles for sm_90 into the
instructions it was written for and that the ctypes argument struct matches the C one."""

from __future__ import annotations

import ctypes
import re
import subprocess
from pathlib import Path

import pytest
import torch
import triton

from paged_ref.course.testing import make_paged_inputs
from paged_ref.kernels import cuda_fp8

needs_nvcc = pytest.mark.skipif(cuda_fp8.nvcc_path() is None, reason="needs nvcc")


@pytest.mark.parametrize("what, error", [
    ("int4", "reads fp8 QuantizedKV"), ("bf16", "reads fp8 QuantizedKV"),
    ("float32 q", "float16 / bfloat16 q"), ("cpu", "runs on a CUDA GPU"),
])
def test_refuses_what_it_does_not_read(what, error):
    inp = make_paged_inputs([20, 5], num_q_heads=8, num_kv_heads=2, head_dim=64,
                            dtype=torch.float32 if what == "float32 q" else torch.bfloat16)
    if what != "bf16":
        inp = inp.quantized("int4" if what == "int4" else "fp8")
    with pytest.raises((TypeError, ValueError), match=error):
        cuda_fp8.paged_attention_cuda_fp8(*inp.args())


@pytest.mark.parametrize("what, error", [
    ("int4_g64", "a \\(scale, zero\\) pair per nibble half"),
    ("block 12", "power-of-two block_size"), ("group 16", "up to 8 query heads"),
    ("head_dim 96", "head_dim in"), ("cpu int4", "runs on a CUDA GPU"),
    ("fp8 k, int4 v", "v_cache is int4"),
])
def test_cuda_kernels_refuse_what_they_do_not_read(what, error):
    """The format and shape checks come before the device check, so they run here too."""
    inp = make_paged_inputs([20, 5], num_q_heads=32 if what == "group 16" else 8,
                            num_kv_heads=2, head_dim=96 if what == "head_dim 96" else 64,
                            block_size=12 if what == "block 12" else 16, dtype=torch.bfloat16)
    fmt = "int4_g64" if what == "int4_g64" else "fp8" if what in ("block 12", "head_dim 96",
                                                                    "group 16") else "int4"
    q, k, v, tables, lens = inp.quantized(fmt).args()
    if what == "fp8 k, int4 v":
        k = inp.quantized("fp8").k_cache
    with pytest.raises((TypeError, ValueError), match=error):
        cuda_fp8.check_cuda_inputs(q, k, v, k.format.kind)



def test_unavailable_without_a_gpu():
    if not torch.cuda.is_available():
        assert not cuda_fp8.cuda_fp8_available()


@pytest.mark.parametrize("batch, heads, max_len, total, want", [
    (64, 8, 4096, None, (4096, 4)),         # whole sequences, 4 warps a head: 256 CTAs
    (256, 8, 1024, None, (1024, 1)),        # whole sequences, 8 heads a CTA: 256 CTAs
    (8, 8, 32768, 8 * 32768, (2048, 1)),    # 16 chunks x 8 sequences: one CTA per SM
    (1, 8, 131072, None, (1008, 1)),        # 131 chunks
    (32, 8, 16137, 258483, (1056, 1)),      # ragged (B32_ragged): about 2 CTAs per SM
    (4, 8, 2048, None, (256, 1)),           # chunks of at least 256 tokens
    (4, 8, 200, None, (200, 1)),            # short: never cut
    (512, 8, 1024, None, (1024, 1)),        # many sequences: several CTAs per SM
])
def test_default_launch(batch, heads, max_len, total, want):
    assert cuda_fp8.default_launch(batch, heads, max_len, sms=132, total_tokens=total) == want


@needs_nvcc
def test_compiles_to_mma_and_async_copies(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_REF_CACHE", str(tmp_path))
    cubin = cuda_fp8.compile_cubin("sm_90")
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    sass = subprocess.run([tools / "cuobjdump", "-sass", "-fun", "fp8_decode_bf16_d128", cubin],
                          check=True, capture_output=True, text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)
    assert any(op.startswith("HMMA.16816.F32") for op in ops)  # tensor cores, float32 accum
    assert "LDGSTS.E.BYPASS.128" in ops or any(op.startswith("LDGSTS") for op in ops)
    assert not any(op.startswith(("LDS.U8", "LDS.S8")) for op in ops)  # no byte-wide reads
    assert not any(op.startswith(("STL", "LDL")) for op in ops)  # no register spills
    usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], check=True,
                           capture_output=True, text=True).stdout
    assert "fp8_decode_f16_d64_token" in usage and "int4_decode_f16_d256" in usage
    # INT4: nibbles reach the tensor cores by bit masks (LOP3), never a byte-wide load
    sass = subprocess.run([tools / "cuobjdump", "-sass", "-fun", "int4_decode_bf16_d128", cubin],
                          check=True, capture_output=True, text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)
    assert any(op.startswith("HMMA.16816.F32") for op in ops) and "LOP3.LUT" in ops
    assert not any(op.startswith(("LDS.U8", "LDS.S8", "STL", "LDL")) for op in ops)


@needs_nvcc
def test_ctypes_struct_matches_the_c_struct(tmp_path):
    fields = [name for name, _ in cuda_fp8._Args._fields_]
    probe = tmp_path / "args.cu"
    probe.write_text(
        f'#include "{cuda_fp8.SOURCE}"\n#include <cstdio>\n#include <cstddef>\n'
        "int main() {\n  printf(\"%zu\", sizeof(Args));\n"
        + "".join(f'  printf(" %zu", offsetof(Args, {f}));\n' for f in fields) + "}\n")
    exe = tmp_path / "args"
    subprocess.run([cuda_fp8.nvcc_path(), "-std=c++17", "-arch=sm_90", "-o", exe, probe],
                   check=True, capture_output=True)
    size, *offsets = map(int, subprocess.run([exe], check=True, capture_output=True,
                                             text=True).stdout.split())
    assert size == ctypes.sizeof(cuda_fp8._Args)
    assert offsets == [getattr(cuda_fp8._Args, f).offset for f in fields]
