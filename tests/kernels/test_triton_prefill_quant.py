"""Prefill over quantised caches: the Triton kernel de-quantises FP8 / INT4 tiles in registers.

Every case runs both backends of ``paged_prefill`` against the float64 reference of the
de-quantised cache: each format and scale granularity, block sizes that do and do not divide a
key tile, GQA, q in float32 / float16 / bfloat16, causal and not, a cached prefix long enough
that the kernel's unmasked key loop runs (keys every query row sees) as well as the masked one,
NaN or large garbage in unused slots. Then the likely mistakes, planted one at a time into the
kernel's source, must each make a case fail.
"""

from __future__ import annotations

import functools
import sys
import zlib

import pytest
import torch

from paged_course import testing
from paged_course.checks import assert_close
from paged_ref import paged_prefill
from paged_ref.kernels.triton import prefill as triton_prefill
from tests.conftest import KERNEL_DEVICE
from tests.mutations.mutate import mutant_of

#: Where the Triton kernels take tensors here: CUDA on a GPU (compiled), the CPU otherwise.
DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)
make_prefill_inputs = functools.partial(testing.make_prefill_inputs, device=DEVICE)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (id, format, seq_lens, query_lens, num_q_heads, num_kv_heads, head_dim, block_size, q dtype,
#  causal, poison)
CASES = [
    ("fp8_prefix_gqa4", "fp8", [72, 33, 9], [8, 17, 9], 8, 2, 64, 16, F32, True, "nan"),
    ("fp8_bs5_bf16", "fp8", [45, 20], [12, 20], 4, 4, 64, 5, BF16, True, "large"),
    ("fp8th_prefix_f16", "fp8_token_head", [70, 26], [6, 26], 8, 1, 64, 8, F16, True, "nan"),
    ("fp8th_noncausal_d128", "fp8_token_head", [40, 17], [9, 17], 4, 2, 128, 16, F32, False,
     "large"),
    ("int4_prefix_gqa4", "int4", [75, 31, 0], [10, 31, 0], 8, 2, 64, 16, F32, True, "nan"),
    ("int4_bs8_bf16", "int4", [50, 14], [20, 1], 4, 1, 64, 8, BF16, True, "large"),
    ("int4g64_bs32_f16", "int4_g64", [66, 9], [3, 9], 8, 8, 64, 32, F16, True, "nan"),
    ("int4g128_noncausal", "int4_g128", [38, 49], [5, 49], 4, 2, 128, 16, F32, False, "nan"),
]


def _inputs(case_id, fmt, seq_lens, query_lens, hq, hkv, d, bs, dtype, causal, poison):
    return make_prefill_inputs(seq_lens, query_lens, num_q_heads=hq, num_kv_heads=hkv,
                               head_dim=d, block_size=bs, dtype=dtype, poison=poison,
                               seed=zlib.crc32(case_id.encode())).quantized(fmt)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_float64_of_dequantised_cache(backend, case):
    inp, causal = _inputs(*case), case[9]
    out = paged_prefill(*inp.args(), causal=causal, backend=backend)
    assert out.dtype == inp.q.dtype and out.shape == inp.q.shape
    assert_close(out, inp.reference(causal=causal), name=f"{backend} {case[1]} prefill")


def test_auto_reads_int4_the_kernel_cannot_with_torch():
    """An INT4 head_dim the Triton kernels do not read (not a power of two): ``"auto"`` falls
    back to the torch backend, ``"triton"`` says why."""
    inp = make_prefill_inputs([20, 7], [5, 7], num_q_heads=4, num_kv_heads=2, head_dim=48,
                              block_size=8, seed=3).quantized("int4")
    assert_close(paged_prefill(*inp.args()), inp.reference(), name="auto int4 d=48")
    with pytest.raises(ValueError, match="power of two"):
        paged_prefill(*inp.args(), backend="triton")


# Each (description, old, new, case id): a mistake in the kernel's de-quantising load that the
# case must catch.
PLANTED = [
    ("per-tensor K scale left out of the score scale",
     "qk_scale = qk_scale * tl.load(k_scale_ptr)", "qk_scale = qk_scale", "fp8_prefix_gqa4"),
    ("per-tensor V scale never applied", "out = out * tl.load(v_scale_ptr)", "out = out",
     "fp8_bs5_bf16"),
    ("per-token-head scale forgotten", "x = x.to(dot_type) * s[:, None]",
     "x = x.to(dot_type)", "fp8th_prefix_f16"),
    ("INT4 zero point forgotten", "low = z_lo.to(low.dtype)[:, None] + s_lo",
     "low = 0 * z_lo.to(low.dtype)[:, None] + s_lo", "int4_prefix_gqa4"),
    ("INT4 nibble halves swapped", "tl.join(low, high)", "tl.join(high, low)", "int4_bs8_bf16"),
    ("INT4 high half scaled with the low half's pair", "srow, INT4_GROUPS - 1, key_ok",
     "srow, 0, key_ok", "int4_prefix_gqa4"),
    ("scales of the token in the next slot", "(key % BLOCK_SIZE) * stride_st",
     "((key + 1) % BLOCK_SIZE) * stride_st", "fp8th_noncausal_d128"),
]


@pytest.mark.parametrize("what, old, new, case_id", PLANTED, ids=[p[0] for p in PLANTED])
def test_planted_mistakes_are_caught(what, old, new, case_id, tmp_path, monkeypatch):
    mutant = mutant_of(triton_prefill, [(old, new)], tmp_path, monkeypatch)
    monkeypatch.setitem(sys.modules, "paged_ref.kernels.triton.prefill", mutant)
    case = next(c for c in CASES if c[0] == case_id)
    inp, causal = _inputs(*case), case[9]
    out = paged_prefill(*inp.args(), causal=causal, backend="triton")
    with pytest.raises(AssertionError):
        assert_close(out, inp.reference(causal=causal), name=what)
