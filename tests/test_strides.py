"""Any strides give the right answer, on every backend, and outputs are allocated contiguous.

Each case draws fresh random inputs (ragged lengths, shuffled tables, garbage past the used
entries, GQA, block sizes and head dims that are not powers of two: ``make_paged_inputs``),
then lays ``q``, ``block_tables``, ``seq_lens`` and ``out`` out in random memory layouts:
dimensions permuted in memory, gaps (holding garbage) between elements, an offset into a
larger buffer. The answer must be the float64 reference's. Includes the layout of issue 36's
scenario 8, ``q.transpose(1, 2).contiguous().transpose(1, 2)`` (strides ``(Hq*D, 1, Hq)``),
which the Triton backends once answered with the output in q's strides, read as if contiguous.
"""

from __future__ import annotations

import pytest
import torch

from paged_course.checks import assert_close
from paged_course.testing import make_paged_inputs, make_prefill_inputs
from paged_ref import attention, paged_attention, paged_prefill, plan_decode, planned
from paged_ref.kernels.triton import decode as triton_decode
from paged_ref.kernels.triton import split as triton_split
from tests.conftest import COMPILED, KERNEL_DEVICE
from tests.mutations.mutate import mutant_of

DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)
BACKENDS = ["torch", "triton", "triton_split", "auto"]
SEEDS = range(3)
CONTIGUOUS, EMPTY = "if out is None:", "torch.empty(q.shape, dtype=q.dtype, device=q.device)"


def random_layout(t: torch.Tensor, gen: torch.Generator, unit_last: bool = False) -> torch.Tensor:
    """``t``'s values in a random memory layout: its dims permuted in memory, a random step
    (1 to 3, garbage in the gaps) in each, at a random offset in a larger buffer. With
    ``unit_last`` the last dim keeps stride 1 (what an ``out=`` must have)."""
    dims = t.dim()
    order = torch.randperm(dims, generator=gen).tolist()  # memory order, outermost first
    if unit_last:
        order = [d for d in order if d != dims - 1] + [dims - 1]
    steps = [int(s) for s in torch.randint(1, 4, (dims,), generator=gen)]
    if unit_last:
        steps[order.index(dims - 1)] = 1
    shape = [t.shape[d] * steps[i] for i, d in enumerate(order)]
    offset = int(torch.randint(0, 7, (), generator=gen))
    numel = max(1, torch.Size(shape).numel())
    buffer = (torch.rand(offset + numel, generator=gen) * 1e4 - 5e3).to(t.dtype).to(t.device)
    view = buffer[offset:].view(shape)[tuple(slice(None, None, s) for s in steps)]
    view = view.permute([order.index(d) for d in range(dims)])
    view.copy_(t)
    assert view.shape == t.shape and torch.equal(view, t)
    return view


def scenario_8(q: torch.Tensor) -> torch.Tensor:
    """Issue 36's layout: strides (Hq * D, 1, Hq)."""
    return q.transpose(1, 2).contiguous().transpose(1, 2)


def random_case(seed: int, dtype=torch.float32):
    """Fresh random decode inputs of a random shape (small: the interpreter runs them)."""
    gen = torch.Generator().manual_seed(1000 + seed)
    pick = lambda options: options[int(torch.randint(0, len(options), (), generator=gen))]  # noqa: E731
    num_kv_heads, group = pick([1, 2, 3]), pick([1, 2, 4, 5])
    block_size, head_dim = pick([1, 3, 5, 8, 16]), pick([16, 24, 40, 64])
    batch = int(torch.randint(1, 5, (), generator=gen))
    lens = torch.randint(0, 40, (batch,), generator=gen).tolist()
    inp = make_paged_inputs(lens, num_q_heads=num_kv_heads * group, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, block_size=block_size, dtype=dtype,
                            device=DEVICE, seed=seed, spare_columns=2)
    return inp, gen


@pytest.fixture
def split_in_chunks_of_8(monkeypatch):
    """``"triton_split"`` cuts sequences into chunks of 8 tokens (the real plan splits only
    long ones), so the split kernel and its merge run on these short sequences."""
    def plan_split(*, max_len, **_):
        if max_len <= 8:
            return triton_split.SplitPlan(max(max_len, 1), 1)
        return triton_split.SplitPlan(8, -(-max_len // 8))

    monkeypatch.setattr(triton_split, "plan_split", plan_split)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_random_layouts_give_the_reference(backend, seed, split_in_chunks_of_8):
    inp, gen = random_case(seed)
    want = inp.reference()
    q, tables, lens = (random_layout(t, gen) for t in (inp.q, inp.block_tables, inp.seq_lens))
    out = paged_attention(q, inp.k_cache, inp.v_cache, tables, lens, backend=backend)
    assert out.is_contiguous(), f"{backend}: output strides {out.stride()}"
    assert_close(out, want, name=f"{backend}, q strides {q.stride()}")
    given = random_layout(torch.zeros_like(inp.q), gen, unit_last=True)
    assert paged_attention(q, inp.k_cache, inp.v_cache, tables, lens, backend=backend,
                           out=given) is given
    assert_close(given, want, name=f"{backend}, out strides {given.stride()}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("backend", BACKENDS)
def test_scenario_8_q_with_non_unit_head_dim_stride(backend, dtype, split_in_chunks_of_8):
    inp, _ = random_case(7, dtype)
    q = scenario_8(inp.q)
    assert q.stride() == (q.shape[1] * q.shape[2], 1, q.shape[1])
    out = paged_attention(q, inp.k_cache, inp.v_cache, inp.block_tables, inp.seq_lens,
                          backend=backend)
    assert out.is_contiguous(), f"{backend}: output strides {out.stride()}"
    assert_close(out, inp.reference(), name=backend)


@pytest.mark.parametrize("backend", ["torch", "triton", "triton_split"])
def test_planned_call_with_random_layouts(backend, split_in_chunks_of_8):
    inp, gen = random_case(3)
    plan = plan_decode(inp.seq_lens.tolist(), num_q_heads=inp.q.shape[1],
                       num_kv_heads=inp.k_cache.shape[2], head_dim=inp.q.shape[2],
                       block_size=inp.k_cache.shape[1], dtype=inp.q.dtype, device=DEVICE,
                       backend=backend)
    q, tables, lens = (random_layout(t, gen) for t in (inp.q, inp.block_tables, inp.seq_lens))
    out = paged_attention(q, inp.k_cache, inp.v_cache, tables, lens, plan=plan)
    assert out.is_contiguous()
    assert_close(out, inp.reference(), name=f"planned {backend}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_with_non_unit_head_dim_stride_is_refused(backend):
    inp, _ = random_case(4)
    out = scenario_8(torch.zeros_like(inp.q))
    before = out.clone()
    with pytest.raises(ValueError, match="out must have stride 1 in its last dimension"):
        paged_attention(*inp.args(), backend=backend, out=out)
    assert torch.equal(out, before), "out was written"


@pytest.mark.parametrize("runner", ["one pass", "split"])
def test_kernel_wrappers_allocate_a_contiguous_output(runner):
    """Called directly (as the benchmarks do), the wrappers take any q too."""
    inp, _ = random_case(5)
    q = scenario_8(inp.q)
    args = (q, inp.k_cache, inp.v_cache, inp.block_tables, inp.seq_lens)
    if runner == "one pass":
        out = triton_decode.paged_attention_triton(*args)
    else:
        out = triton_split.paged_attention_split(*args, plan=triton_split.SplitPlan(8, 5))
    assert out.is_contiguous()
    assert_close(out, inp.reference(), name=runner)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("backend", ["torch", "triton", "auto"])
def test_prefill_random_layouts_give_the_reference(backend, seed):
    gen = torch.Generator().manual_seed(2000 + seed)
    lens = torch.randint(1, 30, (3,), generator=gen)
    query_lens = [int(torch.randint(1, int(n) + 1, (), generator=gen)) for n in lens]
    inp = make_prefill_inputs(lens.tolist(), query_lens, seed=seed, num_q_heads=6,
                              num_kv_heads=2, head_dim=24, block_size=5, device=DEVICE)
    want = inp.reference()
    q = random_layout(inp.q, gen) if seed else scenario_8(inp.q)
    tables, seq_lens, starts = (random_layout(t, gen) for t in (
        inp.block_tables, inp.seq_lens, inp.query_start_loc))
    out = paged_prefill(q, inp.k_cache, inp.v_cache, tables, seq_lens, starts, backend=backend)
    assert out.is_contiguous(), f"{backend}: output strides {out.stride()}"
    assert_close(out, want, name=f"{backend}, q strides {q.stride()}")


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_cuda_kernels_take_any_q_layout(fmt):
    """The hand-written CUDA kernels read head_dim with stride 1: the call hands them a
    contiguous q (and allocates a contiguous output)."""
    from paged_ref.kernels.cuda import cuda_kernels_available

    if not cuda_kernels_available():
        pytest.skip("needs nvcc and compute capability >= 8.9")
    inp = make_paged_inputs([37, 5, 64], num_q_heads=8, num_kv_heads=2, head_dim=128,
                            block_size=16, dtype=torch.bfloat16, device=DEVICE,
                            seed=9).quantized(fmt)
    out = paged_attention(scenario_8(inp.q), *inp.args()[1:], backend="cuda")
    assert out.is_contiguous()
    assert_close(out, inp.reference(), name=f"cuda {fmt}")


# The mistake of scenario 8, planted back: the output allocated like q (q's strides), where
# the unplanned Triton call allocates it: in run_plan where the interpreter runs (it checks
# on the host and runs the plan), in the bound path of planned.py where Triton compiles (it
# checks on the device and calls the plan's bound launches).
LIKE_Q = "out = torch.empty_like(q)"
PLANTED = [
    pytest.param(attention, [(f"{CONTIGUOUS}  # NOTE: always contiguous, whatever q's strides"
                              f"\n        out = {EMPTY}", f"{CONTIGUOUS}\n        {LIKE_Q}")],
                 "triton", marks=pytest.mark.skipif(COMPILED, reason=(
                     "where Triton compiles, the unplanned call's output comes from planned.py "
                     "(the 'bound' case)")), id="triton"),
    pytest.param(planned, [(f"{CONTIGUOUS}  # NOTE: always contiguous (the signature says q's "
                            f"shape, dtype, device)\n        out = {EMPTY}",
                            f"{CONTIGUOUS}\n        {LIKE_Q}"),
                           (f"if made_out:\n        out = {EMPTY}",
                            f"if made_out:\n        {LIKE_Q}")],
                 "triton", marks=pytest.mark.skipif(not COMPILED, reason=(
                     "the interpreter's unplanned call runs run_plan (the 'triton' case)")),
                 id="bound"),
    pytest.param(triton_decode, [(f"out = {EMPTY}", LIKE_Q)], "one pass", id="one pass"),
]


@pytest.mark.parametrize("module, edits, where", PLANTED)
def test_planted_output_in_q_strides_is_caught(module, edits, where, tmp_path, monkeypatch,
                                                split_in_chunks_of_8):
    mutant = mutant_of(module, edits, tmp_path, monkeypatch)
    with pytest.raises(AssertionError):
        if module is attention:
            monkeypatch.setitem(globals(), "paged_attention", mutant.paged_attention)
            test_scenario_8_q_with_non_unit_head_dim_stride("triton", torch.float32, None)
        elif module is planned:  # (a fresh remembered-plan table: the first call binds)
            for name in ("call_planned", "call_unplanned"):
                monkeypatch.setattr(attention, name, getattr(mutant, name))
            test_scenario_8_q_with_non_unit_head_dim_stride("triton", torch.float32, None)
        else:
            monkeypatch.setattr(triton_decode, "paged_attention_triton",
                                mutant.paged_attention_triton)
            test_kernel_wrappers_allocate_a_contiguous_output("one pass")
