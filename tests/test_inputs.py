"""Every input that passes the checks gives the right answer, whatever its strides, on every
backend; the rest is a clear error. (In Triton's interpreter on a CPU; tests/test_gpu.py runs
the same cases compiled.)

* ``q``, ``block_tables``, ``seq_lens`` with a strided last dimension, transposed, stride-0
  expanded, ``seq_lens[::2]``;
* ``-inf`` in used keys (a whole tile, a whole chunk, a whole sequence);
* ``num_blocks == 0``; scales that overflow (``10**400``, ``1e38``).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from paged_course.checks import assert_close
from paged_course.testing import make_paged_inputs
from paged_ref import paged_attention
from paged_ref.cache_math import cdiv, token_slots
from paged_ref.kernels.triton.decode import KernelConfig, paged_attention_triton
from paged_ref.kernels.triton.split import SplitPlan, paged_attention_split
from tests.conftest import KERNEL_DEVICE

DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)
SMALL = KernelConfig(tile=16)


def run(runner: str, q, k, v, tables, lens, *, max_len: int, scale=None):
    """One backend on these inputs: the public call, or a kernel with a forced split."""
    if runner in ("torch", "triton", "triton_split"):
        return paged_attention(q, k, v, tables, lens, scale=scale, backend=runner)
    if runner == "kernel":
        return paged_attention_triton(q, k, v, tables, lens, scale=scale, config=SMALL)
    plan = SplitPlan(8, cdiv(max(max_len, 1), 8), fused_merge=runner == "split_fused")
    return paged_attention_split(q, k, v, tables, lens, scale=scale, plan=plan, config=SMALL)


RUNNERS = ["torch", "triton", "triton_split", "kernel", "split_merge", "split_fused"]


def _inputs(lens, seed, **kw):
    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=8) | kw
    return make_paged_inputs(lens, device=DEVICE, seed=seed, **kw)


def _strided_last(t: torch.Tensor) -> torch.Tensor:
    """Same values, stride 2 in the last dimension (garbage in between)."""
    wide = torch.full((*t.shape[:-1], 2 * t.shape[-1]), -12345, dtype=t.dtype, device=t.device)
    wide[..., ::2] = t
    return wide[..., ::2]


def _transposed(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(0, 1).contiguous().transpose(0, 1)


LAYOUTS = {
    "q_strided_last": lambda a: {**a, "q": _strided_last(a["q"])},
    "q_transposed": lambda a: {**a, "q": _transposed(a["q"])},
    "tables_strided_last": lambda a: {**a, "tables": _strided_last(a["tables"])},
    "tables_transposed": lambda a: {**a, "tables": _transposed(a["tables"])},
    "lens_every_other": lambda a: {**a, "lens": torch.stack(
        [a["lens"], torch.full_like(a["lens"], 10**6)], 1).flatten()[::2]},
    "out_of_everything": lambda a: {"q": _transposed(_strided_last(a["q"])),
                                    "tables": _strided_last(_transposed(a["tables"])),
                                    "lens": _strided_last(a["lens"][None])[0]},
}


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_any_strides_give_the_right_answer(runner, layout):
    inp = _inputs([19, 3, 33], seed=zlib.crc32(layout.encode()))
    a = LAYOUTS[layout]({"q": inp.q, "tables": inp.block_tables, "lens": inp.seq_lens})
    assert torch.equal(a["lens"], inp.seq_lens) and torch.equal(a["tables"], inp.block_tables)
    out = run(runner, a["q"], inp.k_cache, inp.v_cache, a["tables"], a["lens"], max_len=33)
    assert_close(out, inp.reference(), name=f"{runner} with {layout}")


@pytest.mark.parametrize("runner", RUNNERS)
def test_stride_zero_expanded_inputs(runner):
    """One sequence's q, table row and length broadcast to a batch of 3 (stride 0)."""
    inp = _inputs([21], seed=5)
    q, tables, lens = inp.q.expand(3, -1, -1), inp.block_tables.expand(3, -1), \
        inp.seq_lens.expand(3)
    out = run(runner, q, inp.k_cache, inp.v_cache, tables, lens, max_len=21)
    for b in range(3):
        assert_close(out[b:b + 1], inp.reference(), name=f"{runner} row {b}")


def _minus_inf_keys(inp, seq: int, tokens: range) -> None:
    """K of these tokens scores -inf for every query head: -inf in dim 0, q[..., 0] > 0."""
    bs = inp.k_cache.shape[1]
    slots = token_slots(inp.block_tables[seq].tolist(), tokens.stop, bs, start=tokens.start)
    inp.k_cache.view(-1, *inp.k_cache.shape[2:])[slots, :, 0] = float("-inf")
    inp.q[seq, :, 0] = inp.q[seq, :, 0].abs() + 0.5


@pytest.mark.parametrize("runner", RUNNERS)
def test_minus_inf_keys_agree_with_torch(runner):
    """Sequence 0: its first 16 tokens (a whole tile, two whole chunks) score -inf; sequence 1:
    one token in the middle; sequence 2: every token (zeros, like an empty row)."""
    inp = _inputs([40, 20, 11], seed=6)
    _minus_inf_keys(inp, 0, range(0, 16))
    _minus_inf_keys(inp, 1, range(9, 10))
    _minus_inf_keys(inp, 2, range(0, 11))
    ref = inp.reference()
    assert not ref.isnan().any() and (ref[2] == 0).all()
    out = run(runner, *inp.args(), max_len=40)
    assert not out.isnan().any(), f"{runner}: NaN"
    assert_close(out, ref, name=f"{runner} with -inf keys")


@pytest.mark.parametrize("backend", ["torch", "triton", "triton_split"])
def test_no_blocks_at_all(backend):
    """num_blocks == 0: a used entry (even -1) is an error; empty rows are fine."""
    k = torch.randn(0, 8, 2, 32, device=DEVICE)
    q = torch.randn(2, 4, 32, device=DEVICE)
    tables = torch.full((2, 1), -1, dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([0, 0], dtype=torch.int32, device=DEVICE)
    out = paged_attention(q, k, k, tables, lens, backend=backend)
    assert (out == 0).all()
    with pytest.raises(ValueError, match=r"block_tables\[1, 0\] = -1 is outside \[0, num_blocks=0"):
        paged_attention(q, k, k, tables, lens + torch.tensor([0, 1], dtype=torch.int32,
                                                             device=DEVICE), backend=backend)


@pytest.mark.parametrize("scale", [10**400, -(10**400), 1e38, -2e4], ids=str)
def test_huge_scale_is_a_value_error(scale):
    inp = _inputs([5], seed=7)
    with pytest.raises(ValueError, match="scale"):
        paged_attention(*inp.args(), scale=scale, backend="torch")


@pytest.mark.parametrize("runner", ["torch", "triton", "split_fused"])
def test_largest_scale_is_computed_right(runner):
    """abs(scale) == 1e4 is accepted and right (softmax close to a one-hot argmax)."""
    inp = _inputs([17, 9], seed=8)
    for scale in (1e4, -1e4):
        out = run(runner, *inp.args(), max_len=17, scale=scale)
        assert not out.isnan().any()
        assert_close(out, inp.reference(scale=scale), name=f"{runner} scale={scale}")
