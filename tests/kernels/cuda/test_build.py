"""The CUDA decode kernels' build, without a GPU: the sources compile for sm_90 (where nvcc is
installed) into the instructions they were written for, with no spills; the ctypes structs
match the C ones; each build setting is a real choice (blocks of >= 16 tokens read no table
entry per row); the cubin cache sees every source file; and the family keeps its shape:
files within their size limits, no import back up into the library."""

from __future__ import annotations

import ast
import ctypes
import re
import subprocess
from pathlib import Path

import pytest
import triton

from paged_ref.kernels.cuda import build, driver, launch
from paged_ref.quant import KVFormat
from tests.mutations.mutate import cuda_mutant

needs_nvcc = pytest.mark.skipif(build.nvcc_path() is None, reason="needs nvcc")
TOOLS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"  # cuobjdump
FOLDER = build.SOURCE.parent


@pytest.fixture(scope="module")
def cubins(tmp_path_factory):
    """One cubin cache for this module's builds (each takes ~10-40 s here)."""
    return tmp_path_factory.mktemp("cubins")


def compiled(cubins, monkeypatch, settings=None, source=None) -> Path:
    monkeypatch.setenv("PAGED_REF_CACHE", str(cubins))
    return build.compile_cubin("sm_90", settings, source)


def sass_ops(cubin: Path, kernel: str) -> list[str]:
    sass = subprocess.run([TOOLS / "cuobjdump", "-sass", "-fun", kernel, cubin], check=True,
                          capture_output=True, text=True).stdout
    return re.findall(r"/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass)


@needs_nvcc
def test_compiles_to_mma_and_async_copies(cubins, monkeypatch):
    cubin = compiled(cubins, monkeypatch)
    ops = sass_ops(cubin, "fp8_decode_bf16_d128")
    assert any(op.startswith("HMMA.16816.F32") for op in ops)  # tensor cores, float32 accum
    assert "LDGSTS.E.BYPASS.128" in ops or any(op.startswith("LDGSTS") for op in ops)
    assert not any(op.startswith(("LDS.U8", "LDS.S8")) for op in ops)  # no byte-wide reads
    assert not any(op.startswith(("STL", "LDL")) for op in ops)  # no register spills
    usage = subprocess.run([TOOLS / "cuobjdump", "-res-usage", cubin], check=True,
                           capture_output=True, text=True).stdout
    assert "fp8_decode_f16_d64_token" in usage and "int4_decode_f16_d256" in usage
    for fmt in launch.CUDA_FORMATS:  # the names plans launch are the cubin's
        for name in ("bf16_d128", "f16_d64"):
            assert launch.kernel_name(KVFormat.parse(fmt)).format(name) in usage
            assert f"merge_chunks_{name}" in usage
    assert "int4_decode_tma_bf16_d128" in usage and "int4_decode_tma_f16_d128" in usage
    # every entry point spill-free (ptxas: no local memory)
    assert re.findall(r"LOCAL:(\d+)", usage) and set(re.findall(r"LOCAL:(\d+)", usage)) == {"0"}
    # INT4: nibbles reach the tensor cores by bit masks (LOP3), never a byte-wide load
    for kernel in ("int4_decode_bf16_d128", "int4_decode_tma_bf16_d128"):
        ops = sass_ops(cubin, kernel)
        assert any(op.startswith("HMMA.16816.F32") for op in ops) and "LOP3.LUT" in ops
        assert not any(op.startswith(("LDS.U8", "LDS.S8", "STL", "LDL")) for op in ops)
    assert any(op.startswith("UTMALDG") for op in sass_ops(cubin, "int4_decode_tma_bf16_d128"))


@needs_nvcc
def test_ctypes_struct_matches_the_c_struct(tmp_path):
    fields = [name for name, _ in driver.Args._fields_]
    probe = tmp_path / "args.cu"
    probe.write_text(
        f'#include "{FOLDER / "common.cuh"}"\n#include <cstdio>\n#include <cstddef>\n'
        "int main() {\n  printf(\"%zu\", sizeof(Args));\n"
        + "".join(f'  printf(" %zu", offsetof(Args, {f}));\n' for f in fields) + "}\n")
    exe = tmp_path / "args"
    subprocess.run([build.nvcc_path(), "-std=c++17", "-arch=sm_90", "-o", exe, probe],
                   check=True, capture_output=True)
    size, *offsets = map(int, subprocess.run([exe], check=True, capture_output=True,
                                             text=True).stdout.split())
    assert size == ctypes.sizeof(driver.Args)
    assert offsets == [getattr(driver.Args, f).offset for f in fields]


@needs_nvcc
def test_ctypes_launch_config_matches_cuda_h(tmp_path):
    """``cuLaunchKernelEx``'s config and attribute structs as cuda.h lays them out."""
    cfg, attr = driver.LaunchConfig, driver.LaunchAttribute
    fields = ["gridDimX", "sharedMemBytes", "hStream", "attrs", "numAttrs"]
    probe = tmp_path / "config.cu"
    probe.write_text(
        "#include <cuda.h>\n#include <cstdio>\n#include <cstddef>\nint main() {\n"
        '  printf("%zu %zu %zu %d", sizeof(CUlaunchConfig), sizeof(CUlaunchAttribute),\n'
        "         offsetof(CUlaunchAttribute, value),\n"
        "         (int)CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION);\n"
        + "".join(f'  printf(" %zu", offsetof(CUlaunchConfig, {f}));\n' for f in fields) + "}\n")
    exe = tmp_path / "config"
    subprocess.run([build.nvcc_path(), "-o", exe, probe], check=True, capture_output=True)
    size, attr_size, value_at, attr_id, *offsets = map(int, subprocess.run(
        [exe], check=True, capture_output=True, text=True).stdout.split())
    assert (size, attr_size, value_at) == (ctypes.sizeof(cfg), ctypes.sizeof(attr),
                                           attr.value.offset)
    assert attr_id == driver.PROGRAMMATIC_STREAM_SERIALIZATION
    assert offsets == [getattr(cfg, f).offset for f in (
        "grid_x", "shared_bytes", "stream", "attrs", "num_attrs")]




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



# The planted mistake: the sources that choose the copy path at compile time (SMALL_BLOCKS)
# choosing it at run time instead (both paths in one build): warp.cuh's LaneCopies (FP8,
# and INT4's small blocks) and int4_decode.cu's copy.
RUNTIME_BLOCK_CHOICE = [("if constexpr (!SMALL_BLOCKS) {  // the whole tile in block blk",
                         "if (a.block_shift >= 4) {"),
                        ("    if constexpr (SMALL_BLOCKS)\n      copy_int4_tile<D>(",
                         "    if (a.block_shift < 4)\n      copy_int4_tile<D>(")]


@needs_nvcc
@pytest.mark.parametrize("kernel", ["fp8_decode_bf16_d128", "int4_decode_bf16_d128"])
def test_blocks_of_16_copy_without_a_table_read_per_row(kernel, cubins, tmp_path_factory,
                                                        monkeypatch):
    """The common build reads one block-table entry per lane every 32 tiles (the look-ahead);
    the SMALL_BLOCKS build also reads one per token row in the loop."""
    runtime = cuda_mutant(build.SOURCE, RUNTIME_BLOCK_CHOICE,
                          tmp_path_factory.getbasetemp() / "runtime_block_choice")
    loads = {}
    for name, settings, source in (("common", None, None),
                                   ("small", build.Build(small_blocks=True), None),
                                   ("runtime", None, runtime)):
        cubin = compiled(cubins, monkeypatch, settings, source)
        sass = subprocess.run([TOOLS / "cuobjdump", "-sass", "-fun", kernel, cubin],
                              check=True, capture_output=True, text=True).stdout
        loads[name] = min(loop_loads(sass))  # the tile loop (the innermost with MMAs)
    assert loads["common"] <= 1 < loads["small"]
    assert loads["runtime"] > 1  # (predicated off, its per-row table reads still issue)


# --- builds and their cache, without nvcc ---------------------------------------------------

def test_each_build_compiles_with_its_settings_once(tmp_path, monkeypatch):
    """nvcc gets the three macros of a build, each build its own cached cubin, compiled once."""
    calls = []

    def nvcc(cmd, **kw):
        calls.append(cmd)
        Path(cmd[cmd.index("-o") + 1]).write_bytes(b"cubin")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(build, "nvcc_path", lambda: "/usr/bin/nvcc")
    monkeypatch.setattr(subprocess, "run", nvcc)
    monkeypatch.setenv("PAGED_REF_CACHE", str(tmp_path))
    settings = [build.Build(), build.Build(4), build.Build(3, 2), build.Build(2, 1, True)]
    cubins = [build.compile_cubin("sm_90", s) for s in settings]
    assert len(set(cubins)) == 4 and all(c.parent == tmp_path for c in cubins)
    assert [c for c in calls[1] if c.startswith("-D")] == [
        "-DSTAGES=4", "-DWARPS_PER_HEAD=1", "-DSMALL_BLOCKS=0"]
    assert "-DWARPS_PER_HEAD=2" in calls[2] and "-DSMALL_BLOCKS=1" in calls[3]
    assert all(str(build.SOURCE) == cmd[-1] and "-arch=sm_90" in cmd for cmd in calls)
    assert build.compile_cubin("sm_90", build.Build(4)) == cubins[1] and len(calls) == 4
    assert build.compile_cubin("sm_90") == cubins[0]  # (Build() by default)


def test_cache_names_every_source_file(tmp_path):
    """A cubin is named by a hash of every source of the folder: an edit to a header (here a
    comment of warp.cuh) makes a new one; the same files elsewhere, the same one."""
    same = cuda_mutant(build.SOURCE, [], tmp_path / "same")
    edited = cuda_mutant(build.SOURCE, [("// What a decode warp does", "// What a warp does")],
                         tmp_path / "edited")
    assert build.source_digest(same) == build.source_digest(build.SOURCE)
    assert build.source_digest(edited) != build.source_digest(build.SOURCE)


# --- the family's shape -----------------------------------------------------------------------

LIMITS = {".cu": 600, ".cuh": 600, ".py": 400}  # lines a file


def oversized(folder: Path) -> dict:
    """The files of ``folder`` over their size limit (``LIMITS``): name -> lines."""
    lines = {p.name: len(p.read_text().splitlines()) for p in sorted(folder.iterdir())
             if p.suffix in LIMITS}
    return {n: k for n, k in lines.items() if k > LIMITS[Path(n).suffix]}


def test_no_file_of_the_family_is_over_its_size_limit(tmp_path):
    assert oversized(FOLDER) == {}
    assert {p.suffix for p in FOLDER.iterdir() if p.is_file()} <= set(LIMITS)
    (tmp_path / "long.cu").write_text("//\n" * 601)  # (the check sees one)
    (tmp_path / "short.py").write_text("#\n" * 400)
    assert oversized(tmp_path) == {"long.cu": 601}


ALLOWED = ("paged_ref._device", "paged_ref.quant", "paged_ref.kernels.cuda")


def imports_above(path: Path) -> set[str]:
    """The ``paged_ref`` modules ``path`` imports that are not the CUDA layer's own or the two
    it may use (``_device``, ``quant``): validation, attention, plan, prefill, ..."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:  # (from paged_ref import x:
            names |= {f"{node.module}.{a.name}" for a in node.names}  # paged_ref.x)
            names |= {node.module} - {"paged_ref"}
    return {n for n in names if n.startswith("paged_ref")
            and not any(n == a or n.startswith(a + ".") for a in ALLOWED)}


def test_the_cuda_layer_imports_nothing_above_it(tmp_path):
    """Kernels take checked inputs: nothing under kernels/cuda imports validation, attention,
    plan or prefill (what calls it)."""
    for path in sorted(FOLDER.glob("*.py")):
        assert imports_above(path) == set(), path.name
    planted = tmp_path / "planted.py"
    planted.write_text("from paged_ref.validation import check_shapes\nimport paged_ref.plan\n")
    assert imports_above(planted) == {"paged_ref.validation", "paged_ref.validation.check_shapes",
                                      "paged_ref.plan"}


# --- planted mistakes: each makes one of the tests above fail ---------------------------------

PLANTED = {
    "the cache named by decode.cu alone (a header's edit unseen)": (
        'for path in sorted(source.parent.glob("*.cu*")):', "for path in [source]:",
        lambda folder, monkeypatch: test_cache_names_every_source_file(folder)),
    "builds of other warps per head sharing a cubin": (
        'tag = "_".join(defines).replace("=", "")', 'tag = defines[0].replace("=", "")',
        test_each_build_compiles_with_its_settings_once),
    "a build's setting not passed to nvcc": (
        '*[f"-D{d}" for d in defines]', '*[f"-D{d}" for d in defines[:1]]',
        test_each_build_compiles_with_its_settings_once),
}


@pytest.mark.parametrize("mistake", PLANTED)
def test_planted_mistakes_in_the_build_are_caught(mistake, tmp_path, monkeypatch):
    from tests.mutations.mutate import mutant_of

    old, new, check = PLANTED[mistake]
    mutant = mutant_of(build, [(old, new)], tmp_path, monkeypatch)
    monkeypatch.setattr(mutant, "SOURCE", build.SOURCE)  # (not the mutant file's folder)
    monkeypatch.setitem(globals(), "build", mutant)
    (tmp_path / "check").mkdir()
    with pytest.raises(AssertionError):
        check(tmp_path / "check", monkeypatch)
