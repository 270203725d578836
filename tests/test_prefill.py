"""``paged_prefill``: every backend against the float64 reference, and its input checks.

Cases cover query lengths 0, 1, a block boundary +-1 and "long"; a cached prefix before the
queries (chunked prefill, prefix hits) and none (a fresh prompt); block sizes 1, 5, 8, 16;
head dims 64, 80, 128; GQA ratios 1-8 (3 included); float32 / float16 / bfloat16; causal and
not; NaN in unused slots. Tables are shuffled with garbage past the used entries
(``make_prefill_inputs``). Small sizes: the Triton backend runs in the interpreter on a CPU.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from paged_course.checks import assert_close
from paged_course.testing import make_prefill_inputs
from paged_ref import paged_prefill
from paged_ref.prefill import paged_prefill_reference
from tests.conftest import KERNEL_DEVICE

BACKENDS_UNDER_TEST = ["torch", "triton"]
#: Where the Triton kernels take tensors here: CUDA on a GPU (compiled), the CPU otherwise.
DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)
F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (id, seq_lens, query_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, causal)
CASES = [
    ("fresh_prompts", [16, 17, 15, 1], [16, 17, 15, 1], 8, 2, 64, 16, F32, True),
    ("prefix_then_chunk", [40, 33, 9], [8, 17, 1], 4, 4, 64, 8, F32, True),
    ("zero_query_rows", [20, 0, 31, 12], [0, 0, 31, 5], 8, 1, 64, 8, F32, True),
    ("decode_rows", [1, 37, 64], [1, 1, 1], 8, 2, 128, 16, F32, True),
    ("bs1", [9, 14], [9, 3], 4, 2, 64, 1, F32, True),
    ("bs5_gqa3", [23, 11], [12, 11], 6, 2, 80, 5, F32, True),
    ("bs16_long_f16", [150, 70], [100, 70], 8, 2, 64, 16, F16, True),
    ("bs8_bf16_gqa8", [47, 25], [33, 24], 8, 1, 64, 8, BF16, True),
    ("noncausal", [21, 40], [7, 40], 4, 2, 64, 8, F32, False),
    ("noncausal_bf16", [33, 16], [16, 1], 8, 4, 128, 16, BF16, False),
]


def _seed(case_id: str) -> int:
    return zlib.crc32(case_id.encode())


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize(
    "case_id, seq_lens, query_lens, hq, hkv, head_dim, block_size, dtype, causal", CASES,
    ids=[c[0] for c in CASES],
)
def test_matches_float64_reference(backend, case_id, seq_lens, query_lens, hq, hkv, head_dim,
                                   block_size, dtype, causal):
    inp = make_prefill_inputs(seq_lens, query_lens, num_q_heads=hq, num_kv_heads=hkv,
                              head_dim=head_dim, block_size=block_size, dtype=dtype,
                              seed=_seed(case_id), poison="nan" if hq == 8 else "large",
                              device=DEVICE)
    out = paged_prefill(*inp.args(), causal=causal, backend=backend)
    assert out.dtype == dtype and out.shape == inp.q.shape
    assert_close(out, inp.reference(causal=causal), name=f"{backend} {case_id}")


@pytest.mark.parametrize("backend", ["auto", *BACKENDS_UNDER_TEST])
@pytest.mark.parametrize("scale", [0.3, -0.2])
def test_scale(backend, scale):
    """A given scale, negative included (the kernel flips q's sign to keep its scale > 0)."""
    inp = make_prefill_inputs([30, 12], [10, 12], num_q_heads=4, num_kv_heads=2, seed=3,
                              device=DEVICE)
    out = paged_prefill(*inp.args(), scale=scale, backend=backend)
    assert_close(out, inp.reference(scale=scale))


def test_decode_is_one_query_row():
    """With one query row per sequence, prefill is paged decode attention."""
    from paged_course.testing import make_paged_inputs

    dec = make_paged_inputs([5, 33, 16], num_q_heads=8, num_kv_heads=2, seed=4, device=DEVICE)
    starts = torch.arange(4, dtype=torch.int32, device=DEVICE)
    out = paged_prefill(dec.q, dec.k_cache, dec.v_cache, dec.block_tables, dec.seq_lens, starts)
    assert_close(out, dec.reference())


def test_reference_causal_offset_by_hand():
    """The float64 reference itself: row i of a 2-query chunk after 3 cached tokens sees
    keys 0..3+i; check one row against a hand-written softmax."""
    inp = make_prefill_inputs([5], [2], num_q_heads=1, num_kv_heads=1, head_dim=16,
                              block_size=2, seed=5)
    ref = paged_prefill_reference(*inp.args())
    k, v = (c.double().flatten(0, 1) for c in (inp.k_cache, inp.v_cache))
    slots = [int(inp.block_tables[0, t // 2]) * 2 + t % 2 for t in range(4)]  # keys 0..3
    p = torch.softmax(k[slots, 0] @ inp.q[0, 0].double() / 4.0, dim=0)
    assert_close(ref[0, 0], p @ v[slots, 0], rel_tol=1e-12)


# ---- bad input ---------------------------------------------------------------------------


def _good():
    inp = make_prefill_inputs([10, 20], [4, 6], num_q_heads=4, num_kv_heads=2, seed=6)
    return dict(zip(["q", "k_cache", "v_cache", "block_tables", "seq_lens", "query_start_loc"],
                    inp.args(), strict=True))


def _starts(values):
    return torch.tensor(values, dtype=torch.int32)


@pytest.mark.parametrize(
    "change, error, words",
    [
        (dict(query_start_loc=_starts([0, 4, 10]).long()), TypeError, "query_start_loc"),
        (dict(query_start_loc=[0, 4, 10]), TypeError, "query_start_loc"),
        (dict(query_start_loc=_starts([0, 10])), ValueError, "query_start_loc"),
        (dict(query_start_loc=_starts([1, 4, 10])), ValueError, "query_start_loc[0]"),
        (dict(query_start_loc=_starts([0, 4, 9])), ValueError, "query_start_loc[-1]"),
        (dict(query_start_loc=_starts([0, 11, 10])), ValueError, "non-decreasing"),
        (dict(query_start_loc=_starts([0, 0, 10]), seq_lens=_starts([10, 9])), ValueError,
         "seq_lens[1]"),
        (dict(q=torch.randn(10, 4, 32)), ValueError, "head_dim"),
        (dict(q=torch.randn(10, 3, 64)), ValueError, "num_q_heads"),
        (dict(q=torch.randn(10, 4, 64, dtype=torch.float16)), TypeError, "q dtype"),
        (dict(q=torch.randn(10, 256)), ValueError, "q must have 3 dimensions"),
        (dict(seq_lens=_starts([10, 20, 5])), ValueError, "seq_lens"),
        (dict(seq_lens=_starts([10, -1])), ValueError, "seq_lens[1]"),
        (dict(seq_lens=_starts([10, 20]).long()), TypeError, "seq_lens"),
        (dict(scale="x"), TypeError, "scale"),
        (dict(causal=1), TypeError, "causal"),
        (dict(backend="cuda"), ValueError, "backend"),
    ],
)
def test_bad_input(change, error, words):
    kwargs = _good()
    kwargs.update(change)
    args = [kwargs.pop(n) for n in ["q", "k_cache", "v_cache", "block_tables", "seq_lens",
                                    "query_start_loc"]]
    with pytest.raises(error) as info:
        paged_prefill(*args, **kwargs)
    assert words in str(info.value)


def test_bad_table_entry_named():
    kwargs = _good()
    table = kwargs["block_tables"].clone()
    table[1, 0] = -1
    kwargs["block_tables"] = table
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\]"):
        paged_prefill(**kwargs)
