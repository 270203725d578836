"""The CUDA decode kernels' launch rules and plans, without a GPU (paged_ref.kernels.cuda's
launch and plans): the checks that refuse what they do not read, the chunking and warps per
head, the ring depth, the build each plan asks for, and where the TMA-fed INT4 kernel runs
(plans made on a pretend H200: 132 SMs, 227 KiB of shared memory a CTA)."""

from __future__ import annotations

import ctypes
import functools
import types

import pytest
import torch

from paged_course.testing import make_paged_inputs
from paged_ref.kernels.cuda import build, driver, launch, plans
from paged_ref.quant import KVFormat


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
        plans.paged_attention_cuda_fp8(*inp.args())


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
        launch.check_cuda_inputs(q, k, v, k.format.kind)


@pytest.mark.parametrize("what, error", [
    ("int64 tables", "block_tables must be int32"), ("a table row short", "block_tables must"),
    ("lens of another batch", "seq_lens must be int32"), ("q of another head_dim", "does not fit"),
    ("Hq not a multiple of Hkv", "does not fit"),
])
def test_plans_check_that_the_tensors_fit_one_another(what, error):
    """What the launch's grid and strides assume of the tensors, checked where the caller's
    validation is not (the kernels would read other rows or memory otherwise)."""
    inp = make_paged_inputs([20, 5, 9], num_q_heads=8, num_kv_heads=2, head_dim=64,
                            dtype=torch.bfloat16).quantized("fp8")
    q, k, _, tables, lens = inp.args()
    plans._check_layout(q, k, tables, lens)  # (as they are: fine)
    if what == "int64 tables":
        tables = tables.long()
    elif what == "a table row short":
        tables = tables[:2]
    elif what == "lens of another batch":
        lens = lens[:2]
    elif what == "q of another head_dim":
        q = torch.randn(3, 8, 128, dtype=torch.bfloat16)
    else:
        q = torch.randn(3, 7, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=error):
        plans._check_layout(q, k, tables, lens)


def test_unavailable_without_a_gpu():
    if not torch.cuda.is_available():
        assert not launch.cuda_kernels_available()


@pytest.mark.parametrize("batch, heads, max_len, total, want", [
    (64, 8, 4096, None, (4096, 2)),         # whole sequences, 2 warps a head: 128 CTAs
    (256, 8, 1024, None, (1024, 1)),        # whole sequences, 8 heads a CTA: 256 CTAs
    (8, 8, 32768, 8 * 32768, (2048, 1)),    # 16 chunks x 8 sequences: one CTA per SM
    (1, 8, 131072, None, (1008, 1)),        # 131 chunks
    (32, 8, 16137, 258483, (1056, 1)),      # ragged (B32_ragged): about 2 CTAs per SM
    (4, 8, 2048, None, (256, 1)),           # chunks of at least 256 tokens
    (4, 8, 200, None, (200, 1)),            # short: never cut
    (512, 8, 1024, None, (1024, 1)),        # many sequences: several CTAs per SM
])
def test_default_launch(batch, heads, max_len, total, want):
    assert launch.default_launch(batch, heads, max_len, sms=132, total_tokens=total) == want


@pytest.mark.parametrize("batch, max_len, want_fp8, want_int4", [
    (64, 4096, (4096, 2), (1024, 1)),     # FP8: 4 heads a CTA, 128 CTAs; INT4: 8 heads a
                                          # CTA, 4 chunks of 1024: 256 CTAs
    (32, 4096, (4096, 4), (1024, 1)),     # FP8: 128 CTAs with 4 warps a head; INT4: 128
    (256, 1024, (1024, 1), (1024, 1)),    # 256 CTAs with 8 heads a CTA
    (8, 32768, (2048, 1), (1024, 1)),     # FP8: one CTA per SM; INT4: 256 CTAs
    (1, 131072, (1008, 1), (1024, 1)),    # one CTA per SM (INT4: chunks stay >= 1024)
    (128, 4096, (4096, 1), (2048, 1)),    # INT4: 1024 would make 512 CTAs: 2048, 256
    (256, 4096, (4096, 1), (4096, 1)),    # whole sequences fill the SMs already
    (4, 2048, (256, 1), (256, 1)),        # little work: as many CTAs as there are SMs
    (2, 1000, (256, 1), (256, 1)),        # (not 2 CTAs of whole sequences)
])
def test_default_launch_by_format(batch, max_len, want_fp8, want_int4):
    """FP8 takes the most heads a CTA that still fill the SMs; INT4 8 heads a CTA (whole
    token rows) and 1024-token chunks, longer while they would make over 2 CTAs per SM."""
    rule = functools.partial(launch.default_launch, batch, 8, max_len, 132)
    assert rule(kind="fp8") == want_fp8
    assert rule(kind="int4") == want_int4


# --- backend="cuda" / "auto" on quantised caches, decided without a GPU -------------------

def test_cuda_backend_refusals_without_a_gpu():
    import paged_ref

    kw = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
    plain = make_paged_inputs([5, 20], device="cpu", **kw)
    with pytest.raises(ValueError, match="CUDA GPU only"):
        paged_ref.paged_attention(*plain.quantized("fp8").args(), backend="cuda")
    with pytest.raises(ValueError, match="not quantised"):
        paged_ref.paged_attention(*plain.args(), backend="cuda")
    sizes = dict(num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                 dtype=torch.bfloat16, device="cpu")
    plan = paged_ref.plan_decode([5, 20], kv_format="fp8", **sizes)
    assert plan.backend == "torch" and plan.kv_format.name == "fp8" and plan.cuda is None
    with pytest.raises(ValueError, match="CUDA GPU only"):
        paged_ref.plan_decode([5, 20], kv_format="fp8", backend="cuda", **sizes)
    with pytest.raises(ValueError):
        paged_ref.plan_decode([5, 20], kv_format="fp9", **sizes)


@pytest.mark.parametrize("fmt, dtype, head_dim, group, block, reason", [
    (None, torch.bfloat16, 128, 4, 16, "not plain ones"),
    ("int4_g128", torch.bfloat16, 128, 4, 16, "not int4_g128"),
    ("fp8", torch.float32, 128, 4, 16, "float16 / bfloat16 q"),
    ("fp8", torch.bfloat16, 96, 4, 16, "head_dim"),
    ("fp8", torch.bfloat16, 128, 16, 16, "up to 8 query heads"),
    ("int4", torch.float16, 128, 4, 12, "power-of-two block_size"),
    ("fp8", torch.bfloat16, 128, 4, 16, "compute capability"),  # this machine: no such GPU
])
def test_cuda_refusal_names_the_reason(fmt, dtype, head_dim, group, block, reason):
    refusal = launch.cuda_refusal(fmt, dtype, "cpu", head_dim=head_dim, group=group,
                                  block_size=block)
    assert refusal is not None and reason in refusal


def test_cuda_refusal_reads_int4_halves_under_either_name():
    """``int4_g<head_dim / 2>`` is ``int4``'s grouping (the same tensors): it gets as far as
    the device check, as ``int4`` does; other groupings are refused for what they are."""
    for fmt in ("int4", "int4_g64", KVFormat.parse("fp8_token_head")):
        refusal = launch.cuda_refusal(fmt, torch.bfloat16, "cpu", head_dim=128, group=4,
                                      block_size=16)
        assert "compute capability" in refusal
    assert "not int4_g128" in launch.cuda_refusal("int4_g128", torch.bfloat16, "cpu",
                                                 head_dim=128, group=4, block_size=16)


# --- plans on a pretend H200 ---------------------------------------------------------------

@pytest.fixture
def h200(monkeypatch):
    """A pretend GPU of 132 SMs and compute capability ``h200.capability`` (9.0 unless set);
    the kernels a plan loads are recorded in ``h200.asked`` as ``(name, Build)``."""
    gpu = types.SimpleNamespace(capability=(9, 0), asked=[])
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        multi_processor_count=132, shared_memory_per_block_optin=232448))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: gpu.capability)
    monkeypatch.setattr(driver, "function", lambda dev, name, settings, source: (
        gpu.asked.append((name, settings, source)) or ctypes.c_void_p()))
    empty = torch.empty  # (the merge's scratch, on the CPU here)
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: empty(*a, **k))
    return gpu


def plan_for(fmt: str, batch: int, max_len: int, *, kv_heads=8, head_dim=128, block=16,
             **kw):
    return plans.plan_cuda_for((batch, 4 * kv_heads, head_dim), block, kv_heads,
                               torch.bfloat16, "cuda:0", KVFormat.parse(fmt), max_len=max_len,
                               **kw)


@pytest.mark.parametrize("fmt, batch, max_len, total, want", [
    ("fp8", 256, 1024, None, 2),         # 256 CTAs of 8 heads, one warp each
    ("fp8", 32, 16137, 258483, 2),       # B32_ragged: ~2 CTAs per SM that have work
    ("fp8_token_head", 256, 1024, None, 2),
    ("fp8", 64, 4096, None, 3),          # 2 warps a head
    ("fp8", 8, 32768, None, 3),          # one CTA per SM
    ("fp8", 1, 131072, None, 3),
    ("fp8", 4, 2048, None, 3),           # little work
    ("fp8", 8, 16384, 8 * 300, 3),       # a long table but few tokens: most CTAs idle
    ("int4", 256, 1024, None, 4),        # INT4 on sm_90: the TMA ring, 4 stages
    ("int4", 64, 4096, None, 4),
    ("int4", 8, 32768, None, 4),         # 256 CTAs
    ("int4", 1, 131072, None, 5),        # 128 CTAs, one per SM: 3 tiles ahead
])
def test_plans_pick_the_ring_depth(h200, fmt, batch, max_len, total, want):
    plan = plan_for(fmt, batch, max_len, total_tokens=total)
    assert plan.stages == want
    assert {settings.stages for _, settings, _ in h200.asked} == {want}  # (the build's)


def test_ring_depth_rule():
    assert launch.default_stages("fp8", 198, 132, 1) == 2
    assert launch.default_stages("fp8", 197, 132, 1) == 3
    assert launch.default_stages("fp8", 512, 132, 2) == 3
    assert launch.default_stages("int4", 512, 132, 1) == 3
    assert launch.default_stages("int4", 512, 132, 1, tma=True) == 4
    assert launch.default_stages("int4", 133, 132, 1, tma=True) == 4
    assert launch.default_stages("int4", 132, 132, 1, tma=True) == 5
    inp = make_paged_inputs([40], num_q_heads=8, num_kv_heads=2, head_dim=64,
                            dtype=torch.bfloat16).quantized("fp8")
    for bad in (1, 9, 2.5):
        with pytest.raises(ValueError, match="stages must be 2..8"):
            launch.check_cuda_inputs(inp.q, inp.k_cache, inp.v_cache, "fp8", stages=bad)


def test_plans_build_the_small_blocks_kernels_for_blocks_under_16(h200):
    for block_size in (1, 2, 4, 8, 16, 32, 256):
        h200.asked.clear()
        plan_for("fp8", 64, 256, block=block_size)
        (name, settings, source), = h200.asked  # (whole sequences: no merge kernel)
        assert settings.small_blocks == (block_size < 16) and source == build.SOURCE
        assert ("SMALL_BLOCKS=1" in settings.defines()) == (block_size < 16)


@pytest.mark.parametrize("fmt, batch, max_len, kw, want", [
    # (chunk_len, warps a head, CTAs: Hkv / heads a CTA x chunks x batch)
    ("fp8", 64, 4096, {}, (4096, 2, 2 * 1 * 64)),     # default_launch: 2 warps a head
    ("fp8", 32, 4096, {}, (4096, 4, 4 * 1 * 32)),     # 4
    ("fp8", 64, 4096, {"chunk_len": 1000}, (1008, 1, 1 * 5 * 64)),  # a chunk_len alone
    ("fp8", 8, 1000, {"warps_per_head": 4}, (1008, 4, 4 * 1 * 8)),  # alone: whole sequences
    ("int4", 64, 4096, {"warps_per_head": 2, "chunk_len": 512}, (512, 2, 2 * 8 * 64)),
])
def test_plans_launch_the_warps_per_head_they_build(h200, fmt, batch, max_len, kw, want):
    """The warps per head a plan launches (its CTA's threads) are those its kernels were
    built for (``Build.warps_per_head``: ``WARPS_PER_HEAD``), chosen or given."""
    plan = plan_for(fmt, batch, max_len, **kw)
    warps = plan.threads // 32 // plan.heads_per_cta
    assert (plan.chunk_len, warps, plan.grid[0] * plan.grid[1] * plan.grid[2]) == want
    assert {settings.warps_per_head for _, settings, _ in h200.asked} == {warps}
    assert (plan.merge is None) == (plan.max_chunks == 1)


def test_plans_refuse_warps_per_head_they_do_not_build(h200):
    for bad in (0, 3, 8, 2.0):
        with pytest.raises(ValueError, match="warps_per_head must be one of"):
            plan_for("fp8", 8, 1000, warps_per_head=bad)


@pytest.mark.parametrize("capability, head_dim, kv_heads, block, kw, tma", [
    ((9, 0), 128, 8, 16, {}, True),
    ((9, 0), 128, 16, 64, {}, True),             # two CTA columns of 8 heads
    ((9, 0), 128, 8, 16, {"tma": True}, True),
    ((9, 0), 128, 8, 16, {"tma": False}, False),  # asked for the per-warp ring
    ((8, 9), 128, 8, 16, {}, False),             # no TMA unit
    ((9, 0), 64, 8, 16, {}, False),              # head_dim 64: the per-warp kernel
    ((9, 0), 128, 4, 16, {}, False),             # 4 heads a CTA
    ((9, 0), 128, 8, 8, {}, False),              # blocks of fewer than 16 tokens
    ((9, 0), 128, 8, 16, {"warps_per_head": 2}, False),
])
def test_plans_run_the_tma_ring_where_it_reads_the_launch(h200, capability, head_dim,
                                                          kv_heads, block, kw, tma):
    """Which INT4 decode kernel a plan loads, its ring depth and its shared memory."""
    h200.capability = capability
    plan = plan_for("int4", 64, 4096, kv_heads=kv_heads, head_dim=head_dim, block=block, **kw)
    assert plan.tma == tma
    assert h200.asked[0][0] == (f"int4_decode_tma_bf16_d{head_dim}" if tma
                                else f"int4_decode_bf16_d{head_dim}")
    assert [n for n, _, _ in h200.asked[1:]] == (  # (warps_per_head alone: whole sequences)
        [f"merge_chunks_bf16_d{head_dim}"] if plan.max_chunks > 1 else [])
    if tma:
        assert plan.stages == 4 and plan.smem == launch.tma_shared_bytes(4)
        assert plan.threads == 32 * build.TMA_HEADS and plan.smem <= 232448 // 2
    else:
        assert plan.stages == 3


@pytest.mark.parametrize("capability, head_dim, kv_heads", [((8, 9), 128, 8), ((9, 0), 64, 8),
                                                            ((9, 0), 128, 4)])
def test_plans_refuse_a_tma_ring_that_cannot_read_the_launch(h200, capability, head_dim,
                                                             kv_heads):
    h200.capability = capability
    with pytest.raises(ValueError, match="tma=True"):
        plan_for("int4", 64, 4096, kv_heads=kv_heads, head_dim=head_dim, tma=True)


def test_fp8_plans_load_the_kernel_of_their_scales(h200):
    for fmt, name in (("fp8", "fp8_decode_bf16_d128"), ("fp8_token_head",
                                                        "fp8_decode_bf16_d128_token")):
        h200.asked.clear()
        plan = plan_for(fmt, 1, 131072)
        assert [n for n, _, _ in h200.asked] == [name, "merge_chunks_bf16_d128"]
        assert not plan.tma


# --- planted mistakes: each makes one of the tests above fail ---------------------------------

PLANTED = {
    "the warps per head launched, not built": (
        "settings = Build(stages, warps_per_head, block_size < 16)",
        "settings = Build(stages, 1, block_size < 16)",
        lambda gpu: test_plans_launch_the_warps_per_head_they_build(
            gpu, "fp8", 64, 4096, {}, (4096, 2, 128))),
    "blocks under 16 tokens built as larger ones": (
        "settings = Build(stages, warps_per_head, block_size < 16)",
        "settings = Build(stages, warps_per_head, block_size < 8)",
        test_plans_build_the_small_blocks_kernels_for_blocks_under_16),
    "tma=False ignored": (
        "    tma = feeds and tma is not False\n", "    tma = feeds\n",
        lambda gpu: test_plans_run_the_tma_ring_where_it_reads_the_launch(
            gpu, (9, 0), 128, 8, 16, {"tma": False}, False)),
    "the ring depth of the TMA kernel for tma=False": (
        "feeds = tma is not False and tma_feeds(", "feeds = tma_feeds(",
        lambda gpu: test_plans_run_the_tma_ring_where_it_reads_the_launch(
            gpu, (9, 0), 128, 8, 16, {"tma": False}, False)),
    "tma=True where it cannot read the launch": (
        "    if tma and not feeds:\n", "    if False:\n",
        lambda gpu: test_plans_refuse_a_tma_ring_that_cannot_read_the_launch(
            gpu, (8, 9), 128, 8)),
    "warps_per_head not checked": (
        "or warps_per_head not in WARPS_PER_HEAD)", "or warps_per_head > 8)",
        test_plans_refuse_warps_per_head_they_do_not_build),
    "a table of another batch let through": (
        " or t.shape[0] != batch:", ":",
        lambda gpu: test_plans_check_that_the_tensors_fit_one_another(
            "a table row short", "block_tables must")),
}


@pytest.mark.parametrize("mistake", PLANTED)
def test_planted_mistakes_in_the_plans_are_caught(mistake, h200, tmp_path, monkeypatch):
    from tests.mutations.mutate import mutant_of

    old, new, check = PLANTED[mistake]
    monkeypatch.setitem(globals(), "plans", mutant_of(plans, [(old, new)], tmp_path,
                                                      monkeypatch))
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check(h200)
