"""Every attention backend against the float64 reference, on fresh random paged inputs.

The cases are a covering set, not a cartesian product: together they hit block sizes 1, 8,
16, 32; head dims 64, 80, 128; GQA ratios 1, 4, 8; lengths 0, 1, exact multiples of the block
size and one token short of one; float32 / float16 / bfloat16; NaN in unused cache slots; a
custom scale. Every case has shuffled block tables and garbage (-1, huge, random) in unused
table entries (``make_paged_inputs`` builds them that way). Sizes stay small because the Triton
backends run in Triton's interpreter on a CPU.
"""

from __future__ import annotations

import zlib

import pytest
import torch

from paged_course.checks import assert_close, assert_equal
from paged_course.testing import make_paged_inputs
from paged_ref import paged_attention
from tests.conftest import KERNEL_DEVICE

#: Where the Triton kernels take tensors here: CUDA on a GPU (compiled), the CPU otherwise.
DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)

#: Backends checked here. On a CPU the Triton ones run in Triton's interpreter, which is why
#: every case below is small. (Their split into several chunks is in test_triton_split.py.)
BACKENDS_UNDER_TEST = ["torch", "triton", "triton_split"]

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16

# (id, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, poison, scale)
CASES = [
    # block_size 1: every token is its own block
    ("bs1_mha_d64", [1, 7, 13], 4, 4, 64, 1, F32, "large", None),
    ("bs1_gqa4_d80_nan", [0, 5, 9], 8, 2, 80, 1, F32, "nan", None),
    ("bs1_gqa8_bf16", [3, 16], 8, 1, 64, 1, BF16, "large", None),
    # block_size 8: exact multiples, one short, one over
    ("bs8_multiples", [8, 16, 24], 4, 4, 64, 8, F32, "large", None),
    ("bs8_one_short", [7, 15, 31, 1], 8, 2, 128, 8, F32, "large", None),
    ("bs8_gqa8_d80_f16", [9, 40, 23], 16, 2, 80, 8, F16, "large", None),
    ("bs8_nan_f16", [8, 17, 0], 8, 8, 64, 8, F16, "nan", None),
    ("bs8_scale", [12, 33], 4, 1, 64, 8, F32, "large", 0.3),
    # block_size 16: the default in serving engines
    ("bs16_ragged", [1, 15, 16, 17], 8, 2, 64, 16, F32, "large", None),
    ("bs16_d128_gqa4", [48, 63, 80], 8, 2, 128, 16, F32, "large", None),
    ("bs16_d80_mha_bf16", [31, 32, 5], 4, 4, 80, 16, BF16, "nan", None),
    ("bs16_gqa8_f16", [64, 2], 16, 2, 64, 16, F16, "large", None),
    ("bs16_zero_rows", [0, 33, 0, 16], 4, 2, 64, 16, F32, "nan", None),
    ("bs16_scale_f16", [20, 47], 8, 2, 128, 16, F16, "large", 1.7),
    ("bs16_long_nan", [79, 80], 4, 1, 64, 16, F32, "nan", None),
    # block_size 32: a sequence shorter than one block, and several blocks
    ("bs32_short", [1, 3, 31], 4, 4, 64, 32, F32, "large", None),
    ("bs32_multiples_gqa8", [32, 64], 8, 1, 128, 32, F32, "large", None),
    ("bs32_bf16_d80", [33, 63, 0], 16, 4, 80, 32, BF16, "large", None),
    ("bs32_nan_scale", [70, 12], 4, 2, 64, 32, F32, "nan", 0.05),
    # odd corners
    ("single_token", [1], 1, 1, 64, 16, F32, "large", None),
    ("all_zero_lengths", [0, 0], 4, 2, 64, 8, F32, "nan", None),
    ("batch4_mixed_bf16", [16, 1, 40, 7], 8, 8, 64, 8, BF16, "nan", 0.2),
]


def _seed(case_id: str) -> int:
    return zlib.crc32(case_id.encode())


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize(
    "case_id, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, poison, scale",
    CASES,
    ids=[c[0] for c in CASES],
)
def test_matches_float64_reference(
    backend, case_id, seq_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, poison,
    scale,
):
    inp = make_paged_inputs(
        seq_lens, device=DEVICE, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, block_size=block_size, dtype=dtype, seed=_seed(case_id),
        poison=poison,
    )
    out = paged_attention(*inp.args(), scale=scale, backend=backend)
    assert out.dtype == dtype, f"output dtype {out.dtype}, expected q's dtype {dtype}"
    assert out.shape == (len(seq_lens), num_q_heads, head_dim)
    assert_close(out, inp.reference(scale=scale), name=f"{backend} output")
    for b, n in enumerate(seq_lens):
        if n == 0:
            assert_equal(out[b].float().cpu(), torch.zeros(num_q_heads, head_dim),
                         name=f"row {b}")


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
def test_default_scale_is_inverse_sqrt_head_dim(backend):
    inp = make_paged_inputs([21, 9], device=DEVICE, head_dim=80, block_size=8, seed=11)
    default = paged_attention(*inp.args(), backend=backend)
    explicit = paged_attention(*inp.args(), scale=80**-0.5, backend=backend)
    assert_close(default, explicit.double(), name="scale=None vs scale=head_dim**-0.5")
    other = paged_attention(*inp.args(), scale=1.0, backend=backend)
    assert (other - default).abs().max() > 1e-3, "scale is ignored"


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
def test_unused_table_entries_are_never_read(backend):
    """Rewriting every unused table entry (to -1, to a huge id, to another sequence's block)
    leaves the output bit-for-bit unchanged."""
    inp = make_paged_inputs([5, 16, 30], device=DEVICE, block_size=8, seed=12, spare_columns=3)
    before = paged_attention(*inp.args(), backend=backend)
    used = (inp.seq_lens.long() + 7) // 8
    unused = torch.arange(inp.block_tables.shape[1], device=DEVICE)[None, :] >= used[:, None]
    for fill in (-1, 2**31 - 1, int(inp.block_tables[1, 0])):
        tables = torch.where(unused, torch.tensor(fill, dtype=torch.int32, device=DEVICE),
                             inp.block_tables)
        after = paged_attention(
            inp.q, inp.k_cache, inp.v_cache, tables.contiguous(), inp.seq_lens, backend=backend
        )
        assert torch.equal(before, after), f"output changed when unused entries became {fill}"


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
def test_physical_placement_does_not_matter(backend):
    """Moving blocks to other physical ids (and fixing the tables) gives the same output."""
    inp = make_paged_inputs([13, 40, 8], device=DEVICE, block_size=8, seed=13)
    before = paged_attention(*inp.args(), backend=backend)
    num_blocks = inp.k_cache.shape[0]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(13)).to(DEVICE)
    # block old -> new id perm[old]; new cache row perm[old] holds old row old.
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(num_blocks, device=DEVICE)
    k, v = inp.k_cache[inverse].contiguous(), inp.v_cache[inverse].contiguous()
    first_token = torch.arange(inp.block_tables.shape[1], device=DEVICE) * 8
    used = first_token[None, :] < inp.seq_lens.long()[:, None]
    tables = torch.where(used, perm[inp.block_tables.long().clamp(0, num_blocks - 1)], -1)
    after = paged_attention(inp.q, k, v, tables.to(torch.int32), inp.seq_lens, backend=backend)
    assert_close(after, before.double(), name="after moving blocks")


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
def test_empty_batch(backend):
    inp = make_paged_inputs([], device=DEVICE, num_q_heads=4, num_kv_heads=2, head_dim=64, seed=14)
    out = paged_attention(*inp.args(), backend=backend)
    assert out.shape == (0, 4, 64) and out.dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
@pytest.mark.parametrize("dtype", [F32, F16, BF16], ids=str)
def test_zero_length_rows_are_zero_never_nan(backend, dtype):
    inp = make_paged_inputs([0, 3, 0], device=DEVICE, block_size=4, dtype=dtype, seed=15,
                            poison="nan")
    out = paged_attention(*inp.args(), backend=backend)
    assert not out.isnan().any(), "NaN in the output"
    assert (out[0] == 0).all() and (out[2] == 0).all(), "rows with seq_len 0 must be zeros"


@pytest.mark.parametrize("backend", BACKENDS_UNDER_TEST)
def test_does_not_modify_inputs(backend):
    inp = make_paged_inputs([9, 20], device=DEVICE, block_size=8, seed=16)
    copies = [t.clone() for t in inp.args()]
    paged_attention(*inp.args(), backend=backend)
    for name, before, after in zip(("q", "k_cache", "v_cache", "block_tables", "seq_lens"),
                                   copies, inp.args(), strict=True):
        assert torch.equal(before, after), f"{name} was modified"


def test_auto_backend_matches_reference():
    inp = make_paged_inputs([17, 4, 32], device=DEVICE, num_q_heads=8, num_kv_heads=2,
                            block_size=16, seed=17)
    out = paged_attention(*inp.args(), backend="auto")
    assert_close(out, inp.reference(), name="auto output")
    if not torch.cuda.is_available():
        torch_out = paged_attention(*inp.args(), backend="torch")
        assert torch.equal(out, torch_out), "on a CPU, 'auto' should run the torch backend"


@pytest.mark.parametrize("backend", ["flash", "Torch", "", None])
def test_unknown_backend_is_a_value_error(backend):
    inp = make_paged_inputs([3], device=DEVICE, seed=18)
    with pytest.raises(ValueError, match="backend"):
        paged_attention(*inp.args(), backend=backend)
