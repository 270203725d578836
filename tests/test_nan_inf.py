"""NaN and inf in ``q`` or in used cache entries propagate as in the float64 reference, on
every backend (docs/contract.md): the same output entries are NaN, the same are +-inf, the
rest agree. (NaN in *unused* slots never shows: tests/test_attention.py poisons them.)

Each case writes one special value into fresh random inputs: a q entry, one channel of one
used K (or V) token, or whole K rows. Scores over a NaN are NaN, so every query head of that
KV head gets NaN; a +inf score meets itself in the softmax (inf - inf) and gives NaN too; a
-inf score is a weight of 0; an inf in V is carried into the output where its weight is not 0.
"""

from __future__ import annotations

import pytest
import torch

from paged_course.testing import make_paged_inputs, make_prefill_inputs
from paged_ref import paged_attention, paged_prefill, reference
from paged_ref.cache_math import token_slots
from paged_ref.kernels.triton import decode as triton_decode
from paged_ref.kernels.triton import split as triton_split
from tests.conftest import KERNEL_DEVICE
from tests.mutations.mutate import mutant_of

DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)
SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)
NAN, INF = float("nan"), float("inf")
CASES = ["q_nan", "q_inf", "k_nan", "k_inf", "k_minus_inf", "v_nan", "v_inf", "k_rows_inf"]


def plant(inp, case: str, seq: int) -> None:
    """Write ``case``'s special value into sequence ``seq`` of ``inp`` (in place)."""
    lens = inp.seq_lens.tolist()
    slots = token_slots(inp.block_tables[seq].tolist(), lens[seq], SHAPE["block_size"])
    k, v = (c.view(-1, *c.shape[2:]) for c in (inp.k_cache, inp.v_cache))
    token = slots[len(slots) // 2]
    if case.startswith("q"):
        inp.q[-1 if inp.q.shape[0] > len(lens) else seq, 1, 3] = NAN if case == "q_nan" else INF
    elif case == "k_rows_inf":
        k[slots[0], 0] = INF
        k[slots[-1], 0] = INF
    else:
        value = {"nan": NAN, "inf": INF, "minus_inf": -INF}[case[2:]]
        (k if case[0] == "k" else v)[token, int(case[0] == "v"), 2] = value


def assert_same_specials(out: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    out = out.double().cpu()
    assert torch.equal(out.isnan(), ref.isnan()), f"{name}: NaN where the reference is not"
    inf = ref.isinf()
    assert torch.equal(out.isinf(), inf) and torch.equal(out[inf], ref[inf]), f"{name}: inf"
    finite = ~(ref.isnan() | inf)
    torch.testing.assert_close(out[finite], ref[finite], atol=2e-5, rtol=2e-5, msg=name)


@pytest.fixture
def split_in_chunks_of_8(monkeypatch):
    """``"triton_split"`` cuts these short sequences into chunks of 8 (and merges them)."""
    monkeypatch.setattr(triton_split, "plan_split", lambda *, max_len, **_: (
        triton_split.SplitPlan(8, -(-max_len // 8)) if max_len > 8
        else triton_split.SplitPlan(max(max_len, 1), 1)))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["torch", "triton", "triton_split", "auto"])
def test_decode_specials_propagate_as_in_the_reference(backend, case, split_in_chunks_of_8):
    inp = make_paged_inputs([20, 13, 9], device=DEVICE, seed=CASES.index(case), **SHAPE)
    plant(inp, case, seq=1)
    ref = inp.reference()
    assert ref.isnan().any() or ref.isinf().any() or case.endswith("minus_inf"), case
    assert_same_specials(paged_attention(*inp.args(), backend=backend), ref, backend)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_specials_propagate_as_in_the_reference(backend, case):
    inp = make_prefill_inputs([20, 13, 9], [4, 13, 1], device=DEVICE,
                              seed=10 + CASES.index(case), **SHAPE)
    plant(inp, case, seq=2 if case.startswith("q") else 1)
    assert_same_specials(paged_prefill(*inp.args(), backend=backend), inp.reference(), backend)


PLANTED = [  # a NaN score treated as masked (-inf): its key silently dropped
    (reference, "probs = torch.softmax(scores, dim=-1)\n",
     "probs = torch.softmax(scores.nan_to_num(nan=float('-inf')), dim=-1)\n", "torch"),
    (triton_decode, "scores = tl.where(t_mask[None, :], scores, float(\"-inf\"))",
     "scores = tl.where(t_mask[None, :] & (scores == scores), scores, float(\"-inf\"))",
     "triton"),
]


@pytest.mark.parametrize("module, old, new, backend", PLANTED, ids=[p[3] for p in PLANTED])
def test_planted_nan_dropping_is_caught(module, old, new, backend, tmp_path, monkeypatch):
    mutant = mutant_of(module, [(old, new)], tmp_path, monkeypatch)
    inp = make_paged_inputs([20, 13, 9], device=DEVICE, seed=30, **SHAPE)
    plant(inp, "k_nan", seq=1)
    if module is reference:
        out = mutant.paged_attention_torch(*inp.args())
    else:
        out = mutant.paged_attention_triton(*inp.args())
    with pytest.raises(AssertionError):
        assert_same_specials(out, inp.reference(), backend)
