"""A hand-written CUDA decode kernel for FP8 (e4m3) caches, next to the Triton ones.

Why: lesson 10 measured the Triton FP8 kernel at about 2/3 of copy bandwidth, instruction-bound
(its 8-bit V tile reaches the tensor cores through byte-wide shared-memory loads). The kernel in
``cuda_fp8_decode.cu`` has each thread read only its own ``mma.sync`` fragments, 16 bytes at a
time, from a per-warp ``cp.async`` ring (its header says how). This module compiles it with
``nvcc`` on first use (cached under ``~/.cache/paged_ref``) and launches it through the CUDA
driver API with :mod:`ctypes`: no C++ extension build, and a kernel launch is visibly what it
is: a function in a loaded module, a grid, a block and an argument struct.

Needs an NVIDIA GPU with FP8 conversions (compute capability 8.9+) and ``nvcc`` (``$CUDA_HOME``
or on ``PATH``); :func:`cuda_fp8_available` says whether this machine has both.

    out = paged_attention_cuda_fp8(q, k_fp8, v_fp8, block_tables, seq_lens)

q: float16 / bfloat16 ``[batch, Hq, head_dim]`` (head_dim 64, 128 or 256; ``Hq / Hkv <= 8``);
caches: :class:`~paged_ref.QuantizedKV` in ``fp8`` (per tensor) or ``fp8_token_head`` format,
``[num_blocks, block_size, Hkv, head_dim]`` with a power-of-two block size. Inputs are checked
with :func:`paged_ref.validation.check_shapes` and :func:`~paged_ref.validation.check_values`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
from pathlib import Path

import torch

from paged_ref.quant import QuantizedKV

SOURCE = Path(__file__).with_name("cuda_fp8_decode.cu")
WARPS = 4  # as in the .cu file
TILE = 16
MAX_GROUP = 8
#: Tiles in each warp's shared-memory ring (the .cu file's STAGES): STAGES - 1 in flight.
DEFAULT_STAGES = 3
HEAD_DIMS = (64, 128, 256)


class _Args(ctypes.Structure):
    """The kernel's ``struct Args``, field for field."""

    _fields_ = [(n, ctypes.c_void_p) for n in (
        "q", "k", "v", "k_scale", "v_scale", "block_tables", "seq_lens", "out", "part_o",
        "part_lse")] + [(n, ctypes.c_longlong) for n in (
            "q_sb", "q_sh", "o_sb", "o_sh", "c_sb", "c_st", "c_sh", "s_sb", "s_st", "s_sh",
            "table_sb")] + [(n, ctypes.c_int) for n in (
                "block_shift", "group", "chunk_len", "max_chunks")] + [
        ("qk_scale_log2", ctypes.c_float)]


def nvcc_path() -> str | None:
    """The nvcc to compile with: ``$CUDA_HOME/bin/nvcc``, else the one on PATH, else None."""
    home = os.environ.get("CUDA_HOME")
    if home and Path(home, "bin", "nvcc").exists():
        return str(Path(home, "bin", "nvcc"))
    return shutil.which("nvcc")


def cuda_fp8_available(device: torch.device | str | None = None) -> bool:
    """A CUDA GPU with compute capability >= 8.9 and an nvcc to build the kernel."""
    if not torch.cuda.is_available() or nvcc_path() is None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def shared_bytes(head_dim: int, stages: int, warps: int = WARPS) -> int:
    """Dynamic shared memory of one CTA: ``stages`` tiles per warp (the .cu's ``Stage``: K and
    V rows of ``head_dim + 16`` bytes, and 2 x 16 float32 scales)."""
    return warps * stages * (2 * TILE * (head_dim + 16) + 2 * TILE * 4)


def _macro(defines: tuple, name: str, default: int) -> int:
    """The value a ``-D`` define gives macro ``name`` (``default`` when not defined)."""
    values = [int(d.split("=")[1]) for d in defines if d.split("=")[0] == name]
    return values[-1] if values else default


def compile_cubin(arch: str, stages: int = DEFAULT_STAGES, defines: tuple = (),
                  source: Path | None = None) -> Path:
    """``source`` (default ``cuda_fp8_decode.cu``) compiled for ``arch`` (e.g. ``"sm_90"``)
    with ``STAGES`` and other ``-D`` ``defines`` (``("MIN_BLOCKS=4",)``: the .cu's tuning
    macros), cached by source hash and settings."""
    source = Path(source or SOURCE)
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("the CUDA FP8 kernel needs nvcc (set CUDA_HOME or put nvcc on PATH)")
    digest = hashlib.sha256(source.read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("PAGED_REF_CACHE", Path.home() / ".cache" / "paged_ref"))
    tag = "_".join([f"STAGES={stages}", *defines]).replace("=", "")
    cubin = cache / f"cuda_fp8_decode_{digest}_{arch}_{tag}.cubin"
    if not cubin.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = cubin.with_suffix(f".{os.getpid()}.tmp")
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-O3", "-std=c++17", f"-DSTAGES={stages}",
               *[f"-D{d}" for d in defines], "-o", str(tmp), str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
        tmp.replace(cubin)
    return cubin


def _check(result: int, what: str) -> None:
    if result != 0:
        raise RuntimeError(f"CUDA driver call {what} failed with error {result}")


@functools.cache
def _driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def _module(device_index: int, cubin: Path) -> ctypes.c_void_p:
    """``cubin`` loaded into ``device_index``'s (primary) context, once."""
    with torch.cuda.device(device_index):
        torch.cuda.current_stream().synchronize()  # makes torch's context current here
        module = ctypes.c_void_p()
        _check(_driver().cuModuleLoadData(ctypes.byref(module), cubin.read_bytes()),
               "cuModuleLoadData")
    return module


@functools.cache
def _function(device_index: int, name: str, stages: int, defines: tuple, smem: int,
              source: Path) -> ctypes.c_void_p:
    """Kernel ``name`` from the cubin of ``source``, allowed ``smem`` bytes of dynamic shared
    memory."""
    major, minor = torch.cuda.get_device_capability(device_index)
    module = _module(device_index, compile_cubin(f"sm_{major}{minor}", stages, defines, source))
    fn = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_driver().cuModuleGetFunction(ctypes.byref(fn), module, name.encode()),
               f"cuModuleGetFunction({name})")
        max_dynamic_shared = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(_driver().cuFuncSetAttribute(fn, max_dynamic_shared, smem),
               "cuFuncSetAttribute")
    return fn


def _launch(fn, grid, threads, smem: int, args: _Args, stream: int) -> None:
    argv = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(args), ctypes.c_void_p))
    _check(_driver().cuLaunchKernel(fn, *grid, threads, 1, 1, smem, ctypes.c_void_p(stream),
                                    argv, None), "cuLaunchKernel")


def default_chunk_len(batch: int, num_kv_heads: int, max_len: int, sms: int) -> int:
    """Tokens per CTA: 2048 (within a point of the best of 1024 / 2048 / whole sequences at 3
    stages on every large bench case, ``benchmarks/h200/cuda_fp8_probe.json``), halved down
    to 256 while fewer than 2 CTAs per SM would run."""
    chunk = min(max(max_len, 1), 2048)
    while chunk > 256 and batch * num_kv_heads * math.ceil(max_len / chunk) < 2 * sms:
        chunk //= 2
    return chunk


def check_fp8_inputs(q, k_cache, v_cache, stages=DEFAULT_STAGES) -> str:
    """Raise a clear error for what this kernel does not read; the kernel-name suffix."""
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, QuantizedKV) or c.format.kind != "fp8":
            raise TypeError(f"the CUDA FP8 kernel reads fp8 QuantizedKV caches; {name} is "
                            f"{getattr(getattr(c, 'format', None), 'name', type(c).__name__)}")
    if k_cache.format != v_cache.format:
        raise TypeError(f"k_cache is {k_cache.format.name}, v_cache {v_cache.format.name}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"the CUDA FP8 kernel takes float16 / bfloat16 q, got {q.dtype}")
    if not q.is_cuda:
        raise ValueError("the CUDA FP8 kernel runs on a CUDA GPU; q is on the CPU")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"the CUDA FP8 kernel takes head_dim in {HEAD_DIMS}, got {head_dim}")
    if block_size & (block_size - 1):
        raise ValueError(f"the CUDA FP8 kernel needs a power-of-two block_size, got {block_size}")
    if q.shape[1] // num_kv_heads > MAX_GROUP:
        raise ValueError(f"the CUDA FP8 kernel takes up to {MAX_GROUP} query heads per KV "
                         f"head, got {q.shape[1] // num_kv_heads}")
    if not 2 <= stages <= 8:
        raise ValueError(f"stages must be 2..8, got {stages}")
    if q.stride(-1) != 1:
        raise ValueError("q's head_dim must be contiguous (stride 1) for the CUDA FP8 kernel")
    return "_token" if k_cache.format.scale_per == "token_head" else ""


def paged_attention_cuda_fp8(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None,
                             out=None, chunk_len=None, max_len=None,
                             stages=DEFAULT_STAGES, defines=()) -> torch.Tensor:
    """Decode attention over FP8 caches with the CUDA kernel (see the module docstring).

    ``stages``: tiles in each warp's shared-memory ring (2..8); ``defines``: other tuning
    macros of the .cu file, for experiments (``("WARPS=8", "MIN_BLOCKS=2")``).
    ``chunk_len`` (tokens per CTA) defaults to :func:`default_chunk_len`; ``max_len`` (the
    longest sequence) is read from ``seq_lens`` when not given (one read-back). Returns
    ``[batch, Hq, head_dim]`` in q's dtype (``out`` when given).
    """
    from paged_ref.validation import check_out, check_shapes, check_values

    shapes = check_shapes(q, k_cache, v_cache, block_tables, seq_lens, scale)
    suffix = check_fp8_inputs(q, k_cache, v_cache, stages)
    if max_len is None:
        max_len = check_values(block_tables, seq_lens, shapes).max_len
    if out is None:
        out = torch.empty_like(q)
    else:
        check_out(out, q)
        if out.stride(-1) != 1:
            raise ValueError("out's head_dim must be contiguous (stride 1) for the CUDA FP8 kernel")
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if batch == 0:
        return out
    device = q.device.index
    if chunk_len is None:
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        chunk_len = default_chunk_len(batch, num_kv_heads, max_len, sms)
    chunk_len = 16 * math.ceil(max(chunk_len, 1) / 16)  # tiles start at multiples of 16
    max_chunks = max(1, math.ceil(max_len / chunk_len))
    part_o = part_lse = out  # placeholders when nothing is split
    if max_chunks > 1:
        part_o = torch.empty(batch, num_q_heads, max_chunks, head_dim, dtype=torch.float32,
                             device=q.device)
        part_lse = torch.empty(batch, num_q_heads, max_chunks, dtype=torch.float32,
                               device=q.device)
    ks, vs = k_cache.scale, v_cache.scale
    s_strides = (ks.stride(0), ks.stride(1), ks.stride(2)) if ks.dim() == 3 else (0, 0, 0)
    scale = head_dim ** -0.5 if scale is None else scale
    data = k_cache.data
    block_tables = block_tables if block_tables.stride(1) == 1 else block_tables.contiguous()
    seq_lens = seq_lens.contiguous()  # (the kernel steps through both by 1)
    args = _Args(
        q.data_ptr(), data.data_ptr(), v_cache.data.data_ptr(), ks.data_ptr(), vs.data_ptr(),
        block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), part_o.data_ptr(),
        part_lse.data_ptr(), q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        data.stride(0), data.stride(1), data.stride(2), *s_strides, block_tables.stride(0),
        int(math.log2(block_size)), num_q_heads // num_kv_heads, chunk_len, max_chunks,
        scale * math.log2(math.e))
    name = f"{'bf16' if q.dtype == torch.bfloat16 else 'f16'}_d{head_dim}"
    stream = torch.cuda.current_stream(q.device).cuda_stream
    defines = tuple(defines)
    warps = _macro(defines, "WARPS", WARPS)
    smem = shared_bytes(head_dim, stages, warps)
    grid = (num_kv_heads, max_chunks, batch)
    _launch(_function(device, f"fp8_decode_{name}{suffix}", stages, defines, smem, SOURCE),
            grid, warps * 32, smem, args, stream)
    if max_chunks > 1:
        _launch(_function(device, f"fp8_merge_{name}", stages, defines, 0, SOURCE),
                (num_q_heads, batch, 1), head_dim, 0, args, stream)
        # (the temporaries are freed when this call returns; the caching allocator keeps them
        # for later work on this stream only, which runs after the kernels)
    return out


__all__ = ["check_fp8_inputs", "compile_cubin", "cuda_fp8_available", "default_chunk_len",
           "paged_attention_cuda_fp8"]
