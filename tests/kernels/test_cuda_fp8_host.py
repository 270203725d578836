"""The CUDA FP8 kernel's host side, without a GPU: the checks that refuse what it does not
read, the chunking, and (where nvcc is installed) that the source compiles for sm_90 into the
instructions it was written for and that the ctypes argument struct matches the C one."""

from __future__ import annotations

import ctypes
import functools
import itertools
import re
import subprocess
from pathlib import Path

import pytest
import torch
import triton

from paged_course import banks
from paged_course.testing import make_paged_inputs
from paged_ref.kernels import cuda_fp8
from paged_ref.quant import KVFormat

needs_nvcc = pytest.mark.skipif(cuda_fp8.nvcc_path() is None, reason="needs nvcc")


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
        cuda_fp8.paged_attention_cuda_fp8(*inp.args())


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
        cuda_fp8.check_cuda_inputs(q, k, v, k.format.kind)



def test_unavailable_without_a_gpu():
    if not torch.cuda.is_available():
        assert not cuda_fp8.cuda_fp8_available()


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
    assert cuda_fp8.default_launch(batch, heads, max_len, sms=132, total_tokens=total) == want


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
    launch = functools.partial(cuda_fp8.default_launch, batch, 8, max_len, 132)
    assert launch(kind="fp8") == want_fp8
    assert launch(kind="int4") == want_int4


@needs_nvcc
def test_compiles_to_mma_and_async_copies(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGED_REF_CACHE", str(tmp_path))
    cubin = cuda_fp8.compile_cubin("sm_90")
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    sass = subprocess.run([tools / "cuobjdump", "-sass", "-fun", "fp8_decode_bf16_d128", cubin],
                          check=True, capture_output=True, text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)
    assert any(op.startswith("HMMA.16816.F32") for op in ops)  # tensor cores, float32 accum
    assert "LDGSTS.E.BYPASS.128" in ops or any(op.startswith("LDGSTS") for op in ops)
    assert not any(op.startswith(("LDS.U8", "LDS.S8")) for op in ops)  # no byte-wide reads
    assert not any(op.startswith(("STL", "LDL")) for op in ops)  # no register spills
    usage = subprocess.run([tools / "cuobjdump", "-res-usage", cubin], check=True,
                           capture_output=True, text=True).stdout
    assert "fp8_decode_f16_d64_token" in usage and "int4_decode_f16_d256" in usage
    for fmt in cuda_fp8.CUDA_FORMATS:  # the names plans launch are the cubin's
        for name in ("bf16_d128", "f16_d64"):
            assert cuda_fp8._kernel_name(KVFormat.parse(fmt)).format(name) in usage
    # INT4: nibbles reach the tensor cores by bit masks (LOP3), never a byte-wide load
    sass = subprocess.run([tools / "cuobjdump", "-sass", "-fun", "int4_decode_bf16_d128", cubin],
                          check=True, capture_output=True, text=True).stdout
    ops = re.findall(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)
    assert any(op.startswith("HMMA.16816.F32") for op in ops) and "LOP3.LUT" in ops
    assert not any(op.startswith(("LDS.U8", "LDS.S8", "STL", "LDL")) for op in ops)


@needs_nvcc
def test_ctypes_struct_matches_the_c_struct(tmp_path):
    fields = [name for name, _ in cuda_fp8._Args._fields_]
    probe = tmp_path / "args.cu"
    probe.write_text(
        f'#include "{cuda_fp8.SOURCE}"\n#include <cstdio>\n#include <cstddef>\n'
        "int main() {\n  printf(\"%zu\", sizeof(Args));\n"
        + "".join(f'  printf(" %zu", offsetof(Args, {f}));\n' for f in fields) + "}\n")
    exe = tmp_path / "args"
    subprocess.run([cuda_fp8.nvcc_path(), "-std=c++17", "-arch=sm_90", "-o", exe, probe],
                   check=True, capture_output=True)
    size, *offsets = map(int, subprocess.run([exe], check=True, capture_output=True,
                                             text=True).stdout.split())
    assert size == ctypes.sizeof(cuda_fp8._Args)
    assert offsets == [getattr(cuda_fp8._Args, f).offset for f in fields]


# --- the swizzled shared-memory tiles (the model: paged_course.banks) ----------------

def test_swizzle_is_the_kernels():
    assert banks.SWIZZLE_SOURCE in cuda_fp8.SOURCE.read_text()


def test_swizzle_keeps_each_line_whole():
    """Every 128-byte line of a tile (a line of the cache, copied by one instruction) stays one
    line of shared memory, its 16-byte chunks only permuted: the copies stay line-aligned.
    Rows padded by 16 bytes do not (the planted mistake this guards against)."""
    for row_bytes, line in itertools.product((32, 64, 128, 256), range(64)):
        chunks = sorted(banks.swizzled(128 * line + 16 * c, row_bytes) for c in range(8))
        assert chunks == [128 * line + 16 * c for c in range(8)]
        at = [128 * line + 16 * c for c in range(8)]
        assert all(banks.swizzled(a + b, row_bytes) == banks.swizzled(a, row_bytes) + b
                   for a in at for b in range(16))
    for row_bytes in (32, 64, 128, 256):
        assert banks.lines_stay_whole("swizzled", row_bytes)
        assert not banks.lines_stay_whole("padded", row_bytes)


def test_wavefront_count_sees_a_conflict():
    same_bank = [128 * lane for lane in range(32)]  # 32 lanes, one bank, 32 different words
    assert banks.wavefronts(same_bank, 4) == 32
    assert banks.wavefronts([4 * lane for lane in range(32)], 4) == 1  # 32 banks: one pass
    assert banks.wavefronts([16 * lane for lane in range(32)], 16) == 4  # 512 bytes: four


@pytest.mark.parametrize("kind", ["fp8", "int4"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_swizzled_reads_conflict_no_more_than_padded_rows(kind, head_dim):
    """The fragment reads cost no more shared-memory wavefronts than with rows padded by 16
    bytes (the layout before), and the unswizzled, unpadded layout (the planted mistake)
    costs more where it matters (rows of 64 bytes and more)."""
    swz, padded, plain = (banks.step_wavefronts(kind, head_dim, layout)
                          for layout in ("swizzled", "padded", "plain"))
    assert swz <= padded
    row_bytes = head_dim if kind == "fp8" else head_dim // 2
    if row_bytes >= 64:
        assert plain > swz
    if row_bytes <= 128:  # all but FP8 head_dim 256: no conflict at all
        assert swz == banks.ideal_wavefronts(kind, head_dim)


def one_offset_rule_holds(place) -> bool:
    """What int4_decode relies on for rows of 64 bytes (INT4 head_dim 128; FragmentOffsets and
    Int4Copier): for every lane, row r + 8 lies 512 bytes past row r (K reads, copies) and
    row 2t + 1 at row 2t's offset ^ 64 (V reads), at each byte a lane reads or copies."""
    for lane in range(32):
        g, t = lane // 4, lane % 4
        k = place(g, t * 16)
        v = place(2 * t, g * 8)
        if place(g + 8, t * 16) != k + 512:
            return False
        if [place(2 * t + 1, g * 8), place(2 * t + 8, g * 8), place(2 * t + 9, g * 8)] != [
                v ^ 64, v + 512, (v ^ 64) + 512]:
            return False
        row0, piece = lane // 4, lane % 4  # (the copies: rows row0, row0 + 8)
        if place(row0 + 8, 16 * piece) != place(row0, 16 * piece) + 512:
            return False
    return True


def test_rows_of_64_bytes_need_one_offset_a_thread():
    assert one_offset_rule_holds(lambda r, b: banks.place("swizzled", r, b, 64))
    # the planted mistake: the 128-byte rows' pattern (c ^ n % 8) breaks the rule
    assert not one_offset_rule_holds(lambda r, b: banks.swizzled(64 * r + b, 128))


@needs_nvcc
def test_ctypes_launch_config_matches_cuda_h(tmp_path):
    """``cuLaunchKernelEx``'s config and attribute structs as cuda.h lays them out."""
    cfg, attr = cuda_fp8._LaunchConfig, cuda_fp8._LaunchAttribute
    fields = ["gridDimX", "sharedMemBytes", "hStream", "attrs", "numAttrs"]
    probe = tmp_path / "config.cu"
    probe.write_text(
        "#include <cuda.h>\n#include <cstdio>\n#include <cstddef>\nint main() {\n"
        '  printf("%zu %zu %zu %d", sizeof(CUlaunchConfig), sizeof(CUlaunchAttribute),\n'
        "         offsetof(CUlaunchAttribute, value),\n"
        "         (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n"
        + "".join(f'  printf(" %zu", offsetof(CUlaunchConfig, {f}));\n' for f in fields) + "}\n")
    exe = tmp_path / "config"
    subprocess.run([cuda_fp8.nvcc_path(), "-o", exe, probe], check=True, capture_output=True)
    size, attr_size, value_at, attr_id, *offsets = map(int, subprocess.run(
        [exe], check=True, capture_output=True, text=True).stdout.split())
    assert (size, attr_size, value_at) == (ctypes.sizeof(cfg), ctypes.sizeof(attr),
                                           attr.value.offset)
    assert attr_id == cuda_fp8.PROGRAMMATIC_STREAM_SERIALIZATION
    assert offsets == [getattr(cfg, f).offset for f in (
        "grid_x", "shared_bytes", "stream", "attrs", "num_attrs")]


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
    refusal = cuda_fp8.cuda_refusal(fmt, dtype, "cpu", head_dim=head_dim, group=group,
                                    block_size=block)
    assert refusal is not None and reason in refusal


def test_cuda_refusal_reads_int4_halves_under_either_name():
    """``int4_g<head_dim / 2>`` is ``int4``'s grouping (the same tensors): it gets as far as
    the device check, as ``int4`` does; other groupings are refused for what they are."""
    for fmt in ("int4", "int4_g64", KVFormat.parse("fp8_token_head")):
        refusal = cuda_fp8.cuda_refusal(fmt, torch.bfloat16, "cpu", head_dim=128, group=4,
                                        block_size=16)
        assert "compute capability" in refusal
    assert "not int4_g128" in cuda_fp8.cuda_refusal("int4_g128", torch.bfloat16, "cpu",
                                                   head_dim=128, group=4, block_size=16)


# --- the two builds: blocks of >= 16 tokens and smaller ones (SMALL_BLOCKS) ---------------

def plan_defines(monkeypatch, block_size: int, defines=()) -> tuple:
    """The -D defines plan_cuda_for asks the kernels to be built with, on a pretend H200."""
    import types

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        multi_processor_count=132, shared_memory_per_block_optin=232448))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    asked = []
    monkeypatch.setattr(cuda_fp8, "_function",
                        lambda dev, name, stages, d, src: asked.append(d) or ctypes.c_void_p())
    cuda_fp8.plan_cuda_for((64, 32, 128), block_size, 8, torch.bfloat16, "cuda:0",
                           KVFormat.parse("fp8"), max_len=256, defines=defines)
    assert len(asked) == 1  # (whole sequences: no merge kernel)
    return asked[0]


def planned_stages(monkeypatch, fmt: str, batch: int, max_len: int, total=None) -> int:
    """The ring depth plan_cuda_for picks for a standard-shape batch, on a pretend H200."""
    import types

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        multi_processor_count=132, shared_memory_per_block_optin=232448))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: (9, 0))
    monkeypatch.setattr(cuda_fp8, "_function", lambda *a: ctypes.c_void_p())
    empty = torch.empty  # (the merge's scratch, on the CPU here)
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: empty(*a, **k))
    return cuda_fp8.plan_cuda_for((batch, 32, 128), 16, 8, torch.bfloat16, "cuda:0",
                                  KVFormat.parse(fmt), max_len=max_len,
                                  total_tokens=total).stages


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
def test_plans_pick_the_ring_depth(monkeypatch, fmt, batch, max_len, total, want):
    assert planned_stages(monkeypatch, fmt, batch, max_len, total) == want


def test_ring_depth_rule():
    assert cuda_fp8.default_stages("fp8", 198, 132, 1) == 2
    assert cuda_fp8.default_stages("fp8", 197, 132, 1) == 3
    assert cuda_fp8.default_stages("fp8", 512, 132, 2) == 3
    assert cuda_fp8.default_stages("int4", 512, 132, 1) == 3
    assert cuda_fp8.default_stages("int4", 512, 132, 1, tma=True) == 4
    assert cuda_fp8.default_stages("int4", 133, 132, 1, tma=True) == 4
    assert cuda_fp8.default_stages("int4", 132, 132, 1, tma=True) == 5
    inp = make_paged_inputs([40], num_q_heads=8, num_kv_heads=2, head_dim=64,
                            dtype=torch.bfloat16).quantized("fp8")
    for bad in (1, 9, 2.5):
        with pytest.raises(ValueError, match="stages must be 2..8"):
            cuda_fp8.check_cuda_inputs(inp.q, inp.k_cache, inp.v_cache, "fp8", stages=bad)


def test_plans_build_the_small_blocks_kernels_for_blocks_under_16(monkeypatch):
    for block_size in (1, 2, 4, 8):
        assert "SMALL_BLOCKS=1" in plan_defines(monkeypatch, block_size)
    for block_size in (16, 32, 256):
        assert not any(d.startswith("SMALL_BLOCKS") for d in plan_defines(monkeypatch, block_size))
    # the block size decides, whatever the caller passed
    assert "SMALL_BLOCKS=1" in plan_defines(monkeypatch, 8, defines=("SMALL_BLOCKS=0",))
    assert "SMALL_BLOCKS=1" not in plan_defines(monkeypatch, 16, defines=("SMALL_BLOCKS=1",))


def loop_loads(sass: str) -> list[int]:
    """Global loads to registers (LDG; not the LDGSTS copies to shared memory) in each loop
    with MMAs of a kernel's SASS (a loop: a backward branch)."""
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)
    at = {int(a, 16): i for i, (a, _) in enumerate(ins)}
    counts = []
    for i, (a, text) in enumerate(ins):
        target = re.search(r"BRA\s.*?(0x[0-9a-f]+)", text)
        if target and int(target.group(1), 16) < int(a, 16):
            body = ins[at[int(target.group(1), 16)]:i + 1]
            if any("HMMA" in t for _, t in body):
                counts.append(sum(bool(re.search(r"(^|\s)LDG[.\s]", t)) for _, t in body))
    return counts


# The planted mistake per kernel: the sources that choose the copy path at compile time
# (SMALL_BLOCKS), choosing it at run time instead (both paths in one build).
LANE_COPIES = ("if constexpr (!SMALL_BLOCKS) {  // the whole tile in block blk",
               "if (a.block_shift >= 4) {")
RUNTIME_BLOCK_CHOICE = {
    "fp8_decode_bf16_d128": [LANE_COPIES],
    "int4_decode_bf16_d128": [LANE_COPIES,
                              ("    if constexpr (SMALL_BLOCKS)\n      copy_int4_tile<D>(",
                               "    if (a.block_shift < 4)\n      copy_int4_tile<D>(")],
}


@needs_nvcc
@pytest.mark.parametrize("kernel", RUNTIME_BLOCK_CHOICE)
def test_blocks_of_16_copy_without_a_table_read_per_row(kernel, tmp_path, monkeypatch):
    """The common build reads one block-table entry per lane every 32 tiles (the look-ahead);
    the SMALL_BLOCKS build also reads one per token row in the loop."""
    monkeypatch.setenv("PAGED_REF_CACHE", str(tmp_path))
    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    # the planted mistake: the block size decided at run time, both paths in one build
    text = cuda_fp8.SOURCE.read_text()
    for fast, runtime in RUNTIME_BLOCK_CHOICE[kernel]:
        assert text.count(fast) == 1
        text = text.replace(fast, runtime)
    (tmp_path / "runtime.cu").write_text(text)
    loads = {}
    for build, defines, source in (("common", (), None), ("small", ("SMALL_BLOCKS=1",), None),
                                   ("runtime", (), tmp_path / "runtime.cu")):
        cubin = cuda_fp8.compile_cubin("sm_90", defines=defines, source=source)
        sass = subprocess.run([tools / "cuobjdump", "-sass", "-fun", kernel,
                               cubin], check=True, capture_output=True, text=True).stdout
        loads[build] = min(loop_loads(sass))  # the tile loop (the innermost with MMAs)
    assert loads["common"] <= 1 < loads["small"]
    assert loads["runtime"] > 1  # (predicated off, its per-row table reads still issue)


# --- the TMA-fed INT4 kernel's ring (banks.tma_*) -------------------------------------------

def test_tma_ring_reads_take_the_fewest_wavefronts_in_row_token_order():
    """Every head's fragment reads of a TMA tile take 24 wavefronts a tile when the MMA rows
    take the tokens as row_token says (K's conflict-free, V's two a group of lanes), the
    fewest of any order of the tile's first 8 rows (checked over all 40,320); in plain order
    (the planted mistake) 40, and with bits 0 and 1 swapped 32."""
    assert banks.ideal_wavefronts("int4", 128) == 16
    for head in range(cuda_fp8.TMA_HEADS):
        assert banks.tma_step_wavefronts(head) == 24
        assert banks.tma_step_wavefronts(head, order=lambda r: r) == 40
        assert banks.tma_step_wavefronts(
            head, order=lambda r: (r & ~3) | ((r & 1) << 1) | ((r >> 1) & 1)) == 32
    fewest = min(banks.tma_step_wavefronts(0, order=lambda r, p=p: p[r % 8] + r // 8 * 8)
                 for p in itertools.permutations(range(8)))
    assert fewest == 24
    assert sorted(map(banks.row_token, range(16))) == list(range(16))  # a permutation


def test_tma_ring_offsets_are_where_the_tma_unit_puts_the_rows():
    """The .cu's one-offset-a-thread formulas (mirrored in banks.tma_offsets) name the bytes
    of the rows each read wants: K rows g, g + 8 and V rows 2t + (j & 1) + 8 (j >> 1), as
    tokens row_token(row), 16 (K) or 8 (V) bytes at t * 16 and g * 8 of the head's 64."""
    source = cuda_fp8.SOURCE.read_text()
    assert "int row_token(int r) { return r ^ ((r >> 1) & 1); }" in source  # the same order
    for head, lane in itertools.product(range(8), range(32)):
        g, t = lane // 4, lane % 4
        k_at, v_at = banks.tma_offsets(head, lane)
        for j in range(2):
            token = banks.row_token(8 * j + g)
            assert [k_at + 4096 * j + b for b in range(16)] == [
                banks.tma_place(token, head, 16 * t + b) for b in range(16)]
        for j in range(4):
            token = banks.row_token(2 * t + (j & 1) + 8 * (j >> 1))
            at = v_at[j & 1] + 4096 * (j >> 1)
            assert [at + b for b in range(8)] == [
                banks.tma_place(token, head, 8 * g + b) for b in range(8)]


@pytest.mark.parametrize("capability, head_dim, kv_heads, block, defines, tma", [
    ((9, 0), 128, 8, 16, (), True),
    ((9, 0), 128, 16, 64, (), True),            # two CTA columns of 8 heads
    ((9, 0), 128, 8, 16, ("INT4_TMA=0",), False),  # asked for the per-warp ring
    ((8, 9), 128, 8, 16, (), False),            # no TMA unit
    ((9, 0), 64, 8, 16, (), False),             # head_dim 64: the per-warp kernel
    ((9, 0), 128, 4, 16, (), False),            # 4 heads a CTA
    ((9, 0), 128, 8, 8, (), False),             # blocks of fewer than 16 tokens
    ((9, 0), 128, 8, 16, ("WARPS_PER_HEAD=2",), False),
])
def test_plans_run_the_tma_ring_where_it_reads_the_launch(monkeypatch, capability, head_dim,
                                                          kv_heads, block, defines, tma):
    """Which INT4 decode kernel a plan loads, its ring depth and its shared memory (a pretend
    GPU of 132 SMs and this compute capability)."""
    import types

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: types.SimpleNamespace(
        multi_processor_count=132, shared_memory_per_block_optin=232448))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=None: capability)
    names = []
    monkeypatch.setattr(cuda_fp8, "_function",
                        lambda dev, name, *a: names.append(name) or ctypes.c_void_p())
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **k: empty(*a, **k))
    plan = cuda_fp8.plan_cuda_for((64, 4 * kv_heads, head_dim), block, kv_heads, torch.bfloat16,
                                  "cuda:0", KVFormat.parse("int4"), max_len=4096,
                                  defines=defines)
    assert plan.tma == tma
    assert names[0] == (f"int4_decode_tma_bf16_d{head_dim}" if tma
                        else f"int4_decode_bf16_d{head_dim}")
    if tma:
        assert plan.stages == 4 and plan.smem == cuda_fp8.tma_shared_bytes(4)
        assert plan.threads == 32 * cuda_fp8.TMA_HEADS and plan.smem <= 232448 // 2
    else:
        assert plan.stages == 3
