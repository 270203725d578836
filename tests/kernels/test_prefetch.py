"""``KernelConfig(prefetch=True)``: the decode kernels load tile i + 1 before they use tile i.

Measured slower on an H200 (results/h200/fp8_triton_study.json, part prefetch), but it is a launch
option, so it must give the same answers: every format, one pass and split, ragged lengths
that end inside a tile, NaN in unused slots. Planted mistakes in the prefetch (the next tile
not advanced, the first tile skipped, in the FP8/plain loop and in the INT4 loop) are caught.
"""

from __future__ import annotations

import functools
import sys
import zlib

import pytest
import torch

from paged_course import testing
from paged_course.checks import assert_close
from paged_ref.kernels.triton import decode as triton_decode
from paged_ref.kernels.triton import kv_formats
from paged_ref.kernels.triton import split as triton_split
from paged_ref.kernels.triton.decode import KernelConfig
from tests.conftest import KERNEL_DEVICE
from tests.mutations.mutate import mutant_of

#: Where the Triton kernels take tensors here: CUDA on a GPU (compiled), the CPU otherwise.
DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)
make_paged_inputs = functools.partial(testing.make_paged_inputs, device=DEVICE)
PREFETCH = KernelConfig(tile=16, num_warps=4, num_stages=1, prefetch=True)

# (id, format or None, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, q dtype)
CASES = [
    ("plain_f32", None, [20, 49, 0, 16], 4, 2, 64, 16, torch.float32),
    ("plain_bf16_bs8", None, [9, 33], 8, 2, 64, 8, torch.bfloat16),
    ("fp8_gqa4", "fp8", [1, 15, 33], 8, 2, 64, 16, torch.float32),
    ("fp8th_f16", "fp8_token_head", [17, 40], 8, 1, 64, 16, torch.float16),
    ("int4_gqa4", "int4", [31, 16, 0], 8, 2, 64, 16, torch.float32),
    ("int4g128_d128", "int4_g128", [20, 49], 4, 2, 128, 16, torch.float32),
]


def inputs(case_id, fmt, lens, hq, hkv, d, bs, dtype):
    inp = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                            dtype=dtype, poison="nan", seed=zlib.crc32(case_id.encode()))
    return inp.quantized(fmt) if fmt else inp


def check_both(inp, decode=triton_decode.paged_attention_triton,
               split=triton_split.paged_attention_split, name=""):
    """One pass and split (chunks of 32 tokens: two tiles each) against float64."""
    want = inp.reference()
    assert_close(decode(*inp.args(), config=PREFETCH), want, name=f"{name} one pass")
    plan = triton_split.SplitPlan(chunk_size=32, num_chunks=2)
    assert_close(split(*inp.args(), plan=plan, config=PREFETCH), want, name=f"{name} split")


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_prefetch_matches_float64(case):
    check_both(inputs(*case), name=case[0])


PLANTED = [  # (module, old, new, case id)
    ("triton_decode", "kv_head, t0 + AHEAD, end,", "kv_head, t0, end,", "fp8_gqa4"),
    ("triton_decode", "kv_head, t0 + AHEAD, end,", "kv_head, t0, end,", "plain_f32"),
    ("triton_decode", "k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, start, end,\n",
     "k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, start + TILE, end,\n", "fp8th_f16"),
    ("kv_formats", "kv_head, t0 + AHEAD, end,", "kv_head, t0, end,", "int4_gqa4"),
    ("kv_formats", "k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, start, end,\n",
     "k_cache_ptr, v_cache_ptr, table_row_ptr, kv_head, start + TILE, end,\n", "int4_gqa4"),
]


@pytest.mark.parametrize("module, old, new, case_id", PLANTED,
                         ids=[f"{m[0]}: {m[2].strip()} ({m[3]})" for m in PLANTED])
def test_planted_prefetch_mistakes_are_caught(module, old, new, case_id, tmp_path, monkeypatch):
    if module == "kv_formats":  # the INT4 loop: the decode and split modules must import it
        formats = mutant_of(kv_formats, [(old, new)], tmp_path, monkeypatch)
        monkeypatch.setitem(sys.modules, "paged_ref.kernels.triton.kv_formats", formats)
        decode = mutant_of(triton_decode, [], tmp_path, monkeypatch)
        assert decode.attend_tokens_int4 is formats.attend_tokens_int4
    else:
        decode = mutant_of(triton_decode, [(old, new)], tmp_path, monkeypatch)
    monkeypatch.setitem(sys.modules, "paged_ref.kernels.triton.decode", decode)
    split = mutant_of(triton_split, [], tmp_path, monkeypatch)
    assert split.paged_attention_triton is decode.paged_attention_triton  # (one chunk: one pass)
    case = next(c for c in CASES if c[0] == case_id)
    with pytest.raises(AssertionError):
        check_both(inputs(*case), decode.paged_attention_triton, split.paged_attention_split)
