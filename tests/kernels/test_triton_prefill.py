"""The Triton prefill kernel over its launch shapes and head sizes, against float64.

``tests/test_prefill.py`` checks the public call on covering cases; here the kernel is driven
directly with several tile shapes, so that tile edges fall everywhere: query tiles that end
one token before / after a sequence's end, key tiles smaller and larger than a cache block,
block sizes that are not powers of two, head dims that need padding, GQA groups that do not
divide the tile.
"""

from __future__ import annotations

import functools

import pytest
import torch

from paged_course import testing
from paged_course.checks import assert_close
from paged_ref.kernels.triton.prefill import PrefillConfig, paged_prefill_triton
from tests.conftest import KERNEL_DEVICE

#: Where the Triton kernels take tensors here: CUDA on a GPU (compiled), the CPU otherwise.
DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)
make_prefill_inputs = functools.partial(testing.make_prefill_inputs, device=DEVICE)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


@pytest.mark.parametrize(
    "block_m, block_n, block_size",
    [(16, 16, 1), (32, 16, 5), (32, 16, 32), (16, 32, 3), (64, 16, 16)],
)
def test_tile_shapes(block_m, block_n, block_size):
    # GQA 2: a tile of block_m rows holds block_m // 2 query tokens; lengths straddle it.
    bq = block_m // 2
    query_lens = [bq - 1, bq, bq + 1, 1, 0]
    seq_lens = [bq - 1 + 7, bq, bq + 1 + 2 * block_n + 3, 2 * block_n + 1, 5]
    inp = make_prefill_inputs(seq_lens, query_lens, num_q_heads=4, num_kv_heads=2,
                              head_dim=32, block_size=block_size, seed=block_m + block_size,
                              poison="nan")
    out = paged_prefill_triton(*inp.args(), config=PrefillConfig(block_m, block_n, 4, 1))
    assert_close(out, inp.reference(), name=f"tile {block_m}x{block_n}, block {block_size}")


@pytest.mark.parametrize("head_dim", [64, 80, 96, 128, 256])
def test_head_dims(head_dim):
    inp = make_prefill_inputs([19, 9], [11, 9], num_q_heads=2, num_kv_heads=1,
                              head_dim=head_dim, block_size=8, seed=head_dim)
    assert_close(paged_prefill_triton(*inp.args()), inp.reference(), name=f"d={head_dim}")


@pytest.mark.parametrize("group", [1, 3, 5, 8])
def test_gqa_groups(group):
    inp = make_prefill_inputs([23, 6], [17, 6], num_q_heads=2 * group, num_kv_heads=2,
                              head_dim=32, block_size=4, seed=group)
    out = paged_prefill_triton(*inp.args(), config=PrefillConfig(32, 16, 4, 1))
    assert_close(out, inp.reference(), name=f"group {group}")


@pytest.mark.parametrize("dtype", [F32, F16, BF16])
@pytest.mark.parametrize("causal", [True, False])
def test_dtypes_causal(dtype, causal):
    inp = make_prefill_inputs([45, 12, 30], [20, 1, 30], num_q_heads=4, num_kv_heads=1,
                              head_dim=64, block_size=16, dtype=dtype, seed=7)
    out = paged_prefill_triton(*inp.args(), causal=causal)
    assert out.dtype == dtype
    assert_close(out, inp.reference(causal=causal), name=f"{dtype} causal={causal}")


def test_strided_q_and_given_out():
    """q may be a view with a token stride wider than heads x dim (e.g. a slice of a fused
    qkv projection); the result lands in ``out``."""
    inp = make_prefill_inputs([14, 20], [14, 3], num_q_heads=4, num_kv_heads=2, head_dim=32,
                              block_size=4, seed=9)
    wide = torch.randn(inp.q.shape[0], 6, 32, device=DEVICE)
    wide[:, 1:5] = inp.q
    out = torch.empty_like(inp.q)
    got = paged_prefill_triton(wide[:, 1:5], *inp.args()[1:], out=out)
    assert got is out
    assert_close(out, inp.reference())


def test_every_diagonal_offset():
    """Cached prefixes of 0 .. BLOCK_N tokens put the causal diagonal at every offset inside a
    key tile (where the unmasked range must end exactly at the tile's first query)."""
    block_n = 16
    prefixes = list(range(block_n + 1))
    query_lens = [block_n + 1 + p % 3 for p in prefixes]  # two query tiles of 16 tokens
    inp = make_prefill_inputs([p + n for p, n in zip(prefixes, query_lens, strict=True)],
                              query_lens, num_q_heads=2, num_kv_heads=2, head_dim=16,
                              block_size=3, seed=11)
    out = paged_prefill_triton(*inp.args(), config=PrefillConfig(16, block_n, 4, 1))
    assert_close(out, inp.reference(), name="diagonal offsets")


def test_mixed_batch_two_launches():
    """Given the host query lengths, decode-like rows go to a second launch with small tiles;
    both launches write their own rows of one output."""
    query_lens = [1, 40, 0, 2, 1, 23]
    inp = make_prefill_inputs([30, 45, 9, 2, 1, 23], query_lens, num_q_heads=8,
                              num_kv_heads=2, head_dim=32, block_size=8, seed=12, poison="nan")
    out = paged_prefill_triton(*inp.args(), query_lens=query_lens)
    assert_close(out, inp.reference(), name="mixed batch")
