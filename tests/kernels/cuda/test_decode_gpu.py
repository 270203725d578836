"""The hand-written CUDA FP8 and INT4 decode kernels (paged_ref.kernels.cuda) on a GPU with
FP8 conversions and nvcc (skipped elsewhere): against the float64 answer for the de-quantised
cache on ragged lengths, shuffled tables, garbage in unused table entries and NaN in unused
slots, every head_dim / group / block size they take, split into chunks and not; each planted
mistake of the sources (MUTANTS) caught."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from paged_course.checks import assert_close
from paged_course.testing import make_paged_inputs, ragged_lengths
from paged_ref.kernels.cuda import (
    CudaDecodePlan,
    build,
    cuda_kernels_available,
    paged_attention_cuda,
    paged_attention_cuda_fp8,
    plan_cuda,
)
from tests.mutations.mutate import cuda_mutant

pytestmark = pytest.mark.skipif(not cuda_kernels_available(),
                                reason="needs an sm_89+ GPU and nvcc")

CASES = [
    # lengths, block_size, head_dim, num_q_heads, num_kv_heads, q dtype
    ([0, 1, 15, 16, 17, 63, 64, 65, 300], 16, 128, 32, 8, torch.bfloat16),
    (ragged_lengths(9, 1, 3000, seed=1), 16, 128, 32, 8, torch.float16),
    ([1, 2, 33, 64, 65, 129], 1, 128, 8, 8, torch.bfloat16),
    ([5, 700, 1000], 32, 64, 9, 3, torch.bfloat16),
    ([40000], 16, 64, 8, 1, torch.bfloat16),
    ([77, 1500], 8, 256, 16, 2, torch.float16),
]


@pytest.mark.parametrize("chunk_len", [None, 64, 320])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("fmt", ["fp8", "fp8_token_head", "int4"])
def test_cuda_matches_float64(fmt, case, chunk_len):
    lens, bs, d, hq, hkv, dtype = CASES[case]
    inp = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                            dtype=dtype, device="cuda", seed=case, poison="nan").quantized(fmt)
    out = paged_attention_cuda(*inp.args(), chunk_len=chunk_len)
    assert_close(out, inp.reference(), name=f"cuda {fmt} case {case} chunk {chunk_len}")


@pytest.mark.parametrize("case", [0, 1, 3])
@pytest.mark.parametrize("fmt", ["fp8", "fp8_token_head", "int4"])
def test_cuda_warps_sharing_a_head(fmt, case):
    """warps_per_head=2: two warps split each head's tiles and merge in shared memory."""
    lens, bs, d, hq, hkv, dtype = CASES[case]
    inp = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d, block_size=bs,
                            dtype=dtype, device="cuda", seed=case, poison="nan").quantized(fmt)
    for chunk_len in (None, 320):
        out = paged_attention_cuda(*inp.args(), chunk_len=chunk_len, warps_per_head=2)
        assert_close(out, inp.reference(), name=f"2 warps a head, {fmt} case {case}")


@pytest.mark.parametrize("fmt", ["fp8", "fp8_token_head", "int4"])
def test_cuda_two_stage_ring(fmt):
    """A ring of 2 tiles (one in flight while one is used), which plans pick for FP8 batches
    of about two CTAs per SM or more, on the ragged cases and on such a batch."""
    for case in (0, 1, 3):
        lens, bs, d, hq, hkv, dtype = CASES[case]
        inp = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                                block_size=bs, dtype=dtype, device="cuda", seed=case,
                                poison="nan").quantized(fmt)
        for chunk_len in (None, 320):
            out = paged_attention_cuda(*inp.args(), chunk_len=chunk_len, stages=2)
            assert_close(out, inp.reference(), name=f"2 stages, {fmt} case {case}")
    many = make_paged_inputs(ragged_lengths(264, 1, 200, seed=4), num_q_heads=32,
                             num_kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda",
                             seed=4, poison="nan").quantized(fmt)
    plan = plan_cuda(*many.args())
    # (INT4 on sm_90+: the TMA-fed kernel, whose plans take 4)
    assert plan.tma == (fmt == "int4" and torch.cuda.get_device_capability() >= (9, 0))
    assert plan.stages == (2 if fmt.startswith("fp8") else 4 if plan.tma else 3)
    assert_close(plan.run(*many.args()), many.reference(), name=f"default ring, {fmt}")


TMA_CASES = [
    # lengths, block_size, num_q_heads, num_kv_heads (head_dim 128: what int4_decode_tma reads)
    ([0, 1, 15, 16, 17, 63, 64, 65, 300], 16, 32, 8),
    (ragged_lengths(9, 1, 3000, seed=1), 32, 64, 16),  # two CTA columns: heads 8..15 too
    ([5, 700, 1000, 2047], 64, 8, 8),  # tiles at rows 16, 32, 48 of a block
    ([1100, 300], 16, 48, 8),  # a group of 6
]


@pytest.mark.parametrize("case", range(len(TMA_CASES)))
def test_cuda_int4_tma_ring_matches_the_per_warp_ring(case):
    """On sm_90+ INT4 launches of head_dim 128, one warp per head and 8 heads a CTA run
    int4_decode_tma (the TMA unit fills one ring per CTA); the per-warp kernel
    (``tma=False``) and it both match the float64 answer, chunked and not, with NaN in unused
    slots (the TMA copies whole blocks' scales: those past the end must be zeroed)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the TMA unit is sm_90+")
    lens, bs, hq, hkv = TMA_CASES[case]
    inp = make_paged_inputs(lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=128,
                            block_size=bs, dtype=torch.bfloat16, device="cuda", seed=20 + case,
                            poison="nan").quantized("int4")
    for chunk_len in (None, 64, 320):
        for tma in (None, False):
            plan = plan_cuda(*inp.args(), chunk_len=chunk_len, tma=tma)
            assert plan.tma == (tma is None)
            assert_close(plan.run(*inp.args()), inp.reference(),
                         name=f"int4 {'per-warp' if tma is False else 'TMA'} case {case} "
                              f"{chunk_len}")


def test_cuda_int4_tma_ring_reads_odd_layouts_through_copies():
    """A cache the TMA unit cannot read as described (a view 16 bytes off an aligned start,
    scales strided) goes through aligned copies; the same cache twice reuses its tensor maps."""
    from paged_ref.quant import QuantizedKV

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("the TMA unit is sm_90+")
    inp = make_paged_inputs([700, 33], num_q_heads=32, num_kv_heads=8, head_dim=128,
                            dtype=torch.bfloat16, device="cuda", seed=31,
                            poison="nan").quantized("int4")
    plan = plan_cuda(*inp.args())
    assert plan.tma
    args = inp.args()
    assert_close(plan.run(*args), inp.reference(), name="int4 TMA plain")
    plan.run(*args)
    assert len(plan.tensor_maps) == 1

    def shifted(c):  # the same values, 16 bytes into a larger buffer, scales strided by 2
        data = torch.empty(c.data.numel() + 16, dtype=torch.uint8, device="cuda")
        data = data[16:].view(c.data.shape)
        data.copy_(c.data)
        wide = [torch.empty(*t.shape[:-1], 4, dtype=t.dtype, device="cuda")
                for t in (c.scale, c.zero)]
        for w, t in zip(wide, (c.scale, c.zero), strict=True):
            w[..., :2] = t
        return QuantizedKV(data, wide[0][..., :2], wide[1][..., :2], c.format)

    odd = (args[0], shifted(args[1]), shifted(args[2]), *args[3:])
    assert_close(plan.run(*odd), inp.reference(), name="int4 TMA odd layout")


def outlier_inputs(fmt: str):
    """Two sequences; in the first, tokens 700 and 701 have K 40x the others', so their scores
    sit far above the running max of every tile before them (the softmax's reference max must
    move there, or the weights overflow float16)."""
    inp = make_paged_inputs([1100, 300], num_q_heads=32, num_kv_heads=8, head_dim=128,
                            dtype=torch.bfloat16, device="cuda", seed=12)
    block_size = inp.k_cache.shape[1]
    for tok in (700, 701):
        inp.k_cache[int(inp.block_tables[0, tok // block_size]), tok % block_size] *= 40
    return inp.quantized(fmt)


@pytest.mark.parametrize("fmt", ["fp8", "fp8_token_head", "int4"])
def test_cuda_kernels_follow_a_score_far_above_the_running_max(fmt):
    inp = outlier_inputs(fmt)
    for chunk_len in (None, 320):
        out = paged_attention_cuda(*inp.args(), chunk_len=chunk_len)
        assert_close(out, inp.reference(), name=f"outlier scores, {fmt}, chunk {chunk_len}")


def test_cuda_fp8_out_with_odd_strides():
    """An out (and a q) whose rows are not 4-element aligned go through temporaries."""
    inp = make_paged_inputs([100, 700], num_q_heads=8, num_kv_heads=2, head_dim=64,
                            dtype=torch.float16, device="cuda", seed=6).quantized("fp8")
    out = torch.zeros(2, 8, 66, dtype=torch.float16, device="cuda")[..., 1:65]
    q = torch.zeros(2, 8, 66, dtype=torch.float16, device="cuda")[..., 1:65]  # (and q)
    q.copy_(inp.q)
    got = paged_attention_cuda_fp8(q, *inp.args()[1:], out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, inp.reference(), name="odd out strides")


def test_cuda_fp8_strided_q_and_out_and_scale():
    inp = make_paged_inputs([100, 2000], num_q_heads=32, num_kv_heads=8, head_dim=128,
                            dtype=torch.bfloat16, device="cuda", seed=5).quantized("fp8")
    q = torch.empty(2, 64, 128, dtype=torch.bfloat16, device="cuda")[:, ::2]
    q.copy_(inp.q)
    out = torch.zeros(2, 32, 256, dtype=torch.bfloat16, device="cuda")[..., :128]
    got = paged_attention_cuda_fp8(q, inp.k_cache, inp.v_cache, inp.block_tables,
                                   inp.seq_lens, scale=0.3, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_close(out, inp.reference(scale=0.3), name="strided q/out, scale 0.3")


@pytest.mark.parametrize("what", ["int4", "bf16", "float32 q", "block 12", "group 16",
                                  "int4_g128"])
def test_cuda_refuses_what_it_does_not_read(what):
    hq, bs = (64 if what == "group 16" else 32), (12 if what == "block 12" else 16)
    inp = make_paged_inputs([50], num_q_heads=hq, num_kv_heads=4, head_dim=128, block_size=bs,
                            dtype=torch.bfloat16, device="cuda")
    if what != "bf16":
        inp = inp.quantized(what if what.startswith("int4") else "fp8")
    q = inp.q.float() if what == "float32 q" else inp.q
    run = paged_attention_cuda if what == "int4_g128" else paged_attention_cuda_fp8
    with pytest.raises((TypeError, ValueError), match="CUDA (FP8|INT4) kernel"):
        run(q, inp.k_cache, inp.v_cache, inp.block_tables, inp.seq_lens)


# Planted mistakes: each mutant of the CUDA sources (old: exactly once in one file of
# paged_ref/kernels/cuda) must fail the float64 check.
FP8_RESCALE = "o[j][0] *= alpha[0]; o[j][1] *= alpha[1]; o[j][2] *= alpha[0]; o[j][3] *= alpha[1];"
MUTANTS = {
    "no mask past the end": ("x[i] = t0 + tk < end ? (c[0][i] + c[1][i]) * sc : -INFINITY;",
                             "x[i] = (c[0][i] + c[1][i]) * sc;"),
    "V channels paired wrongly": ("prmt(vw[0][w], vw[1][w], 0x5140)",
                                  "prmt(vw[0][w], vw[1][w], 0x4150)"),
    "no rescale of O (outlier scores)": (FP8_RESCALE, ""),
    "rescale only when the second query's max grew (outlier scores)": (
        "grew |= m_new > m[u];", "grew = m_new > m[u];"),
    "weights' alpha left unset when no max moves": ("  alpha[0] = alpha[1] = 1.f;\n", ""),
    "slack past float16's range (an outlier score overflows)": (
        "#define RESCALE_SLACK 8.f", "#define RESCALE_SLACK 64.f"),
    "alphas of the wrong queries (outlier scores)": (
        FP8_RESCALE,
        "o[j][0] *= alpha[1]; o[j][1] *= alpha[0]; o[j][2] *= alpha[1]; o[j][3] *= alpha[0];"),
    "max over half of a query's tokens": (
        "for (int d = 4; d < 32; d *= 2) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, d));",
        "for (int d = 4; d < 16; d *= 2) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, d));"),
    "P^T not transposed into the B operand": (
        "const uint32_t pb0 = transpose8x8(pack_f16x2(p[0], p[1]));",
        "const uint32_t pb0 = pack_f16x2(p[0], p[1]);"),
    "table entries one batch late": ("      now = next;\n", ""),
    "int4: K's zeros ignored": ("(kz.x * qz[0][u] + kz.y * qz[1][u])", "0.f"),
    "int4: V's zeros ignored": ("zs[h][u] = zs[h][u] * alpha[u] + (p[u] * z0 + p[2 + u] * z1);",
                                "zs[h][u] = zs[h][u] * alpha[u];"),
    "int4: halves' scales swapped": ("mma_16816(o[1][2 * k + e], hi, pb[1][0], pb[1][1]);",
                                     "mma_16816(o[1][2 * k + e], hi, pb[0][0], pb[0][1]);"),
    "int4: P^T of one half not transposed": (
        "pb[h][1] = transpose8x8(*reinterpret_cast<const uint32_t*>(&r1));",
        "pb[h][1] = *reinterpret_cast<const uint32_t*>(&r1);"),
    "copies not swizzled as the reads are": ("dst[i] = swizzled<ROW>(row * ROW + piece * 16);",
                                             "dst[i] = row * ROW + piece * 16;"),
    "int4 per-warp ring: copies not swizzled as the reads are": (
        ": base + swizzled<ROW>((row0 + i * STEP_ROWS) * ROW + piece * 16);",
        ": base + (row0 + i * STEP_ROWS) * ROW + piece * 16;"),
    "int4 per-warp ring: K rows g + 8 read from rows g": ("st.k + k[0] + 8 * ROW * j",
                                                          "st.k + k[0]"),
    "int4 per-warp ring: V rows 2t + 1 read 64 bytes on, not across bit 6": (
        "((j & 1) ? v[0] ^ 64 : v[0])", "((j & 1) ? v[0] + 64 : v[0])"),
    "int4 per-warp ring: scales past the end not masked (NaN in unused slots)": (
        "const bool ok = t0 + lane % TILE < end;\n    cp_async_4_to(",
        "const bool ok = true;\n    cp_async_4_to("),
    "int4: bytes 1 and 3 shifted one byte too far": (
        'asm("mul.hi.u32 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(1u << 24));',
        'asm("mul.hi.u32 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(1u << 16));'),
    "int4 TMA ring: V rows in plain token order, K's permuted": (
        "const int v_token = row_token(2 * t + e);", "const int v_token = 2 * t + e;"),
    "int4 TMA ring: V pairs past the end not zeroed (NaN in unused slots)": (
        "sc.vs[r] = real ? load_shared_4(pa + 8 * TILE * TMA_HEADS) : 0u;",
        "sc.vs[r] = load_shared_4(pa + 8 * TILE * TMA_HEADS);"),
    "int4 TMA ring: scale rows of tokens g, not of MMA rows g": (
        "4 * (k_token * TMA_HEADS + warp), lane);", "4 * (g * TMA_HEADS + warp), lane);"),
    "merge of warp 0 only": ("for (int w = 0; w < warps; ++w) {\n      const float f",
                             "for (int w = 0; w < 1; ++w) {\n      const float f"),
    "merge does not wait for the partials": ("  dependent_launch_wait();\n", ""),
}


def mutant_keywords(mutant: str) -> dict:
    """The per-warp INT4 ring's mistakes are planted in the kernel that sm_90+ runs on these
    inputs only when asked (``tma=False``)."""
    return {"tma": False} if mutant.startswith("int4 per-warp ring") else {}


def mutant_source(mutant: str, folder) -> Path:
    """The sources with ``MUTANTS[mutant]`` planted, in ``folder``: their ``decode.cu``
    (tools/gpu/precompile_cuda.py compiles the same copies)."""
    return cuda_mutant(build.SOURCE, [MUTANTS[mutant]], folder)


@pytest.mark.parametrize("mutant", MUTANTS)
def test_cuda_planted_mistakes_are_caught(mutant, tmp_path, monkeypatch):
    monkeypatch.setattr(build, "SOURCE", mutant_source(mutant, tmp_path / "mutant"))
    # (1100 tokens in 256-token chunks: 69 tiles, past the second batch of table entries)
    inp = make_paged_inputs([15, 300, 1100], num_q_heads=32, num_kv_heads=8, head_dim=128,
                            dtype=torch.bfloat16, device="cuda", seed=11,
                            poison="nan" if "NaN" in mutant else "large").quantized(
                                "int4" if mutant.startswith("int4") else "fp8")
    if "outlier" in mutant:  # (after the first tile the reference max rarely moves otherwise)
        inp = outlier_inputs("fp8")
    if "wait" in mutant:
        # 8 long chunks of one sequence: every decode CTA starts at once and runs ~1 ms, so a
        # merge that does not wait reads the partials while they are still NaN
        inp = make_paged_inputs([131072], num_q_heads=32, num_kv_heads=8, head_dim=128,
                                dtype=torch.bfloat16, device="cuda", seed=11).quantized("fp8")
        plan = plan_cuda(*inp.args(), chunk_len=16384)
        plan.part_o.fill_(float("nan"))
        plan.part_lse.fill_(float("nan"))
        out = plan.run(*inp.args())
    else:
        out = paged_attention_cuda(*inp.args(), chunk_len=1100 if "table" in mutant else None,
                                   **mutant_keywords(mutant))
    with pytest.raises(AssertionError):
        assert_close(out, inp.reference(), name=mutant)


def test_dependent_merge_launch_matches_a_plain_one():
    """The merge launched as a programmatic dependent of the decode kernel (Hopper+) gives
    the same bits as a plain launch after it, on chunks whose partials start as NaN."""
    import dataclasses

    inp = make_paged_inputs([40000, 3000, 17], num_q_heads=32, num_kv_heads=8, head_dim=128,
                            dtype=torch.bfloat16, device="cuda", seed=5).quantized("fp8")
    plan = plan_cuda(*inp.args(), chunk_len=512)
    assert plan.merge is not None
    assert plan.dependent_merge == (torch.cuda.get_device_capability() >= (9, 0))
    outs = []
    for p in (plan, dataclasses.replace(plan, dependent_merge=False)):
        p.part_o.fill_(float("nan"))
        p.part_lse.fill_(float("nan"))
        outs.append(p.run(*inp.args()))
    assert torch.equal(outs[0], outs[1])
    assert_close(outs[0], inp.reference(), name="dependent merge")


# --- the CUDA kernels behind paged_attention(backend="auto"), plans and the engine ---------

@pytest.mark.parametrize("fmt", ["fp8", "fp8_token_head", "int4"])
def test_auto_runs_the_cuda_kernels_on_quantised_caches(fmt):
    import paged_ref
    from paged_ref.attention import choose_backend
    from paged_ref.validation import Lengths

    lens = ragged_lengths(9, 1, 3000, seed=2)
    inp = make_paged_inputs(lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                            dtype=torch.bfloat16, device="cuda", seed=2,
                            poison="nan").quantized(fmt)
    assert choose_backend(inp.q, inp.k_cache, Lengths(max(lens), sum(lens))) == "cuda"
    assert_close(paged_ref.paged_attention(*inp.args()), inp.reference(), name=f"auto {fmt}")
    assert_close(paged_ref.paged_attention(*inp.args(), backend="cuda"), inp.reference(),
                 name=f"cuda {fmt}")
    # what the CUDA kernels do not read stays with Triton
    g128 = make_paged_inputs(lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                             dtype=torch.bfloat16, device="cuda", seed=2).quantized("int4_g128")
    assert choose_backend(g128.q, g128.k_cache, Lengths(max(lens), sum(lens))) != "cuda"
    with pytest.raises(ValueError, match="hand-written CUDA kernels, and they read"):
        paged_ref.paged_attention(*g128.args(), backend="cuda")


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_plans_for_quantised_formats_run_the_cuda_kernels(fmt):
    """(tests/test_gpu_quant.py replays such plans in CUDA graphs)"""
    import paged_ref

    lens = [300, 4000, 17]
    inp = make_paged_inputs(lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                            dtype=torch.bfloat16, device="cuda", seed=3).quantized(fmt)
    plan = paged_ref.plan_decode(lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                                 block_size=16, dtype=torch.bfloat16, device="cuda",
                                 kv_format=fmt)
    assert plan.backend == "cuda" and plan.cuda is not None
    assert_close(paged_ref.paged_attention(*inp.args(), plan=plan), inp.reference(),
                 name=f"{fmt} planned")
    plain = make_paged_inputs(lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                              dtype=torch.bfloat16, device="cuda", seed=3)
    with pytest.raises(ValueError, match="not a fp8 cache|not a int4 cache"):
        paged_ref.paged_attention(*plain.args(), plan=plan)


def test_engine_decodes_fp8_caches_with_the_cuda_kernels(monkeypatch):
    """The engine's decode steps (CUDA graphs) run the CUDA kernels on an FP8 cache, and give
    the tokens the Triton kernels give."""
    pytest.importorskip("transformers")
    from paged_bench.engine import build_model, workload
    from paged_ref.engine import Engine

    model = build_model("smollm2-135m", dtype=torch.bfloat16)
    prompts, outputs = workload(6, model.config.vocab_size, seed=4, prompt_mean=40,
                                output_mean=24, max_len=120)
    calls = []
    run = CudaDecodePlan.run
    monkeypatch.setattr(CudaDecodePlan, "run",
                        lambda self, *a, **k: calls.append(1) or run(self, *a, **k))
    ours = Engine(model, num_blocks=256, kv_format="fp8").generate(prompts, outputs,
                                                                  ignore_eos=True)
    assert calls, "the engine did not run the CUDA kernels"
    triton = Engine(model, num_blocks=256, kv_format="fp8", attention_backend="triton").generate(
        prompts, outputs, ignore_eos=True)
    first = [a[:4] == b[:4] for a, b in zip(ours, triton, strict=True)]
    assert all(first), "the first tokens differ between the CUDA and the Triton kernels"
