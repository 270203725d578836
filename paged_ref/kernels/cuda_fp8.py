"""Hand-written CUDA decode kernels for FP8 (e4m3) and INT4 caches, next to the Triton ones.

Why: lesson 10 measured the Triton FP8 kernel at about 2/3 of copy bandwidth and the INT4 one
at about a quarter, instruction-bound (8-bit and 4-bit tiles reach the tensor cores through
byte-wide shared-memory loads). The kernels in ``cuda_fp8_decode.cu`` have each thread read
only its own ``mma.sync`` fragments, 16 bytes at a time, from a per-warp ``cp.async`` ring
(its header says how); on sm_90+ the common INT4 launch reads from one ring per CTA that the
TMA unit fills (:func:`tma_feeds`; this module describes the cache to the unit with tensor
maps, once per cache). This module compiles them with ``nvcc`` on first use (cached under
``~/.cache/paged_ref``) and launches them through the CUDA driver API with :mod:`ctypes`: no
C++ extension build, and a kernel launch is visibly what it is: a function in a loaded
module, a grid, a block and an argument struct.

Needs an NVIDIA GPU with FP8 conversions (compute capability 8.9+) and ``nvcc`` (``$CUDA_HOME``
or on ``PATH``); :func:`cuda_fp8_available` says whether this machine has both.

    out = paged_attention_cuda(q, k_q, v_q, block_tables, seq_lens)  # fp8 or int4 caches
    plan = plan_cuda(q, k_q, v_q, block_tables, seq_lens, max_len=4096)   # or plan once,
    out = plan.run(q, k_q, v_q, block_tables, seq_lens)                   # run many

q: float16 / bfloat16 ``[batch, Hq, head_dim]`` (head_dim 64, 128 or 256; ``Hq / Hkv <= 8``);
caches: :class:`~paged_ref.QuantizedKV` in ``fp8`` (per tensor), ``fp8_token_head`` or
``int4`` (a (scale, zero) pair per nibble half) format, ``[num_blocks, block_size, Hkv,
head_dim]`` with a power-of-two block size. Inputs are checked with
:func:`paged_ref.validation.check_shapes` and :func:`~paged_ref.validation.check_values`.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import torch

from paged_ref import _device
from paged_ref.quant import KVFormat, QuantizedKV

SOURCE = Path(__file__).with_name("cuda_fp8_decode.cu")
WARPS_PER_HEAD = 1  # as in the .cu file: warps sharing one KV head's tiles of a chunk
MAX_WARPS = 8  # per CTA (the .cu's launch bounds)
MAX_MERGE_WARPS = 16  # warps of the merge kernel's CTA: one per chunk, at most this
TILE = 16
MAX_GROUP = 8
#: Tiles in each warp's shared-memory ring (the .cu file's STAGES): STAGES - 1 in flight.
#: Plans take :func:`default_stages` unless given a number.
DEFAULT_STAGES = 3
HEAD_DIMS = (64, 128, 256)


class _TensorMap(ctypes.Structure):
    """``CUtensorMap``: 128 opaque bytes that ``cuTensorMapEncodeTiled`` fills (64-byte aligned
    in the .cu's ``Args``: ``_Args`` pads to it)."""

    _fields_ = [("opaque", ctypes.c_ulonglong * 16)]


class _Args(ctypes.Structure):
    """The kernel's ``struct Args``, field for field (1024 bytes)."""

    _fields_ = [(n, ctypes.c_void_p) for n in (
        "q", "k", "v", "k_scale", "v_scale", "block_tables", "seq_lens", "out", "part_o",
        "part_lse", "k_zero", "v_zero")] + [(n, ctypes.c_longlong) for n in (
            "q_sb", "q_sh", "o_sb", "o_sh", "c_sb", "c_st", "c_sh", "s_sb", "s_st", "s_sh",
            "table_sb")] + [(n, ctypes.c_int) for n in (
                "block_shift", "group", "chunk_len", "max_chunks", "max_len",
                "heads_per_cta")] + [
        ("qk_scale_log2", ctypes.c_float), ("_pad", ctypes.c_char * 44),  # (to byte 256)
        ("k_map", _TensorMap), ("v_map", _TensorMap), ("pair_maps", _TensorMap * 4)]


#: KV heads a CTA of the TMA-fed INT4 kernel (the .cu's TMA_HEADS)
TMA_HEADS = 8


def tma_feeds(kind: str, head_dim: int, block_size: int, warps_per_head: int, heads: int,
              capability: tuple, defines: tuple = ()) -> bool:
    """Whether a launch runs ``int4_decode_tma`` (the .cu's INT4 kernel whose CTA shares one
    ring that the TMA unit fills): INT4, head_dim 128, one warp per head and ``TMA_HEADS``
    KV heads a CTA, blocks of >= 16 tokens, compute capability 9.0+, and no ``INT4_TMA=0``
    in ``defines`` (the per-warp kernel, for comparisons)."""
    return (kind == "int4" and head_dim == 128 and warps_per_head == 1 and heads == TMA_HEADS
            and block_size >= TILE and tuple(capability) >= (9, 0)
            and _macro(defines, "INT4_TMA", 1) == 1)


def tma_shared_bytes(stages: int) -> int:
    """Dynamic shared memory of an ``int4_decode_tma`` CTA: ``stages`` tiles of all 8 heads
    (the .cu's ``Int4TmaStage``: 2 x 16 x 8 x 64 bytes of codes and 4 x 16 x 8 (scale, zero)
    pairs), two 8-byte barriers a stage, and 1024 bytes of slack to align the ring (the TMA
    unit's swizzle is of 1024-byte blocks)."""
    return stages * (2 * TILE * TMA_HEADS * 64 + 4 * TILE * TMA_HEADS * 4 + 16) + 1024


U8, U32, SWIZZLE_128B, NO_SWIZZLE = 0, 2, 3, 0  # (cuda.h's enums)
#: How much the L2 fetches around each of the TMA unit's requests (cuda.h's
#: CUtensorMapL2promotion: 0 none, 1 64 bytes, 2 128, 3 256): 128 bytes, B64_L4096 0.0907 ms
#: against 0.0923 with 256 (docs/lab_notes.md, "One TMA producer per CTA"; none: 0.0907)
L2_PROMOTION = 2


def _encode(tensor: torch.Tensor, dtype: int, dims: tuple, strides: tuple, box: tuple,
            swizzle: int) -> _TensorMap:
    """``cuTensorMapEncodeTiled`` of ``tensor``'s memory as a tensor of ``dims`` elements
    (innermost first) with byte ``strides`` (of dims 1.., innermost first) and boxes ``box``."""
    tensor_map, n = _TensorMap(), len(dims)
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    _check(_driver().cuTensorMapEncodeTiled(
        ctypes.byref(tensor_map), dtype, n, ctypes.c_void_p(tensor.data_ptr()),
        (u64 * n)(*dims), (u64 * (n - 1))(*strides), (u32 * n)(*box), (u32 * n)(*[1] * n),
        0, swizzle, L2_PROMOTION, 0), "cuTensorMapEncodeTiled")
    return tensor_map


def _tma_maps(codes: torch.Tensor, v_codes: torch.Tensor, pairs: tuple):
    """What ``int4_decode_tma`` reads through the TMA unit (six ``_TensorMap``, in ``Args``'
    order): the K and V codes
    ``[num_blocks, block_size, Hkv, 64]`` (uint8) as tensors of 128-byte rows (two heads), head
    pairs, tokens of a block, blocks, with boxes of 128 bytes x 4 pairs x 16 tokens, 128-byte
    swizzled; and each (scale, zero) tensor ``[num_blocks, block_size, Hkv, 2]`` (float16) as
    4-byte pairs, heads, tokens, blocks, with boxes of 8 heads x 16 tokens."""
    blocks, block_size, heads, row = codes.shape
    maps = [_encode(c, U8, (2 * row, heads // 2, block_size, blocks),
                    (c.stride(2) * 2, c.stride(1), c.stride(0)), (2 * row, TMA_HEADS // 2, TILE, 1),
                    SWIZZLE_128B) for c in (codes, v_codes)]
    maps += [_encode(t, U32, (heads, block_size, blocks), (2 * t.stride(1), 2 * t.stride(0)),
                     (TMA_HEADS, TILE, 1), NO_SWIZZLE) for t in pairs]
    return (_TensorMap * 6)(*maps)


def _tma_readable(codes: torch.Tensor, pairs: tuple) -> bool:
    """Whether the TMA unit can read these tensors as ``_tma_maps`` describes them: codes with
    each token's heads side by side (stride 64 bytes a head), pairs side by side (2 float16s a
    head), and addresses and strides multiples of 16 bytes."""
    return (codes.stride(3) == 1 and codes.stride(2) == codes.shape[3]
            and all(x % 16 == 0 for x in (codes.stride(0), codes.stride(1), codes.data_ptr()))
            and all(t.stride(3) == 1 and t.stride(2) == 2 and t.data_ptr() % 16 == 0
                    and all(2 * x % 16 == 0 for x in t.stride()[:2]) for t in pairs))


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


def shared_bytes(head_dim: int, stages: int, warps: int, kind: str = "fp8") -> int:
    """Dynamic shared memory of one CTA: ``stages`` tiles per warp (the .cu's ``Stage``: 16 K
    and 16 V rows of ``head_dim`` bytes, unpadded (swizzled), and 2 x 16 float32 scales;
    ``Int4Stage``: rows of ``head_dim / 2`` bytes and 4 x 16 (scale, zero) pairs)."""
    if kind == "int4":
        return warps * stages * (2 * TILE * (head_dim // 2) + 4 * TILE * 4)
    return warps * stages * (2 * TILE * head_dim + 2 * TILE * 4)


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
def _function(device_index: int, name: str, stages: int, defines: tuple,
              source: Path) -> ctypes.c_void_p:
    """Kernel ``name`` from the cubin of ``source``, allowed all the shared memory a CTA may
    have on this GPU (less its own static ``__shared__`` arrays)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    module = _module(device_index, compile_cubin(f"sm_{major}{minor}", stages, defines, source))
    fn = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        _check(_driver().cuModuleGetFunction(ctypes.byref(fn), module, name.encode()),
               f"cuModuleGetFunction({name})")
        static = ctypes.c_int()  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: its __shared__ arrays
        _check(_driver().cuFuncGetAttribute(ctypes.byref(static), 1, fn), "cuFuncGetAttribute")
        max_dynamic_shared = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        _check(_driver().cuFuncSetAttribute(fn, max_dynamic_shared,
                                            _shared_limit(device_index) - static.value),
               "cuFuncSetAttribute")
    return fn


def _shared_limit(device_index: int) -> int:
    """Bytes of shared memory one CTA may ask for on this GPU (227 KiB on an H100 / H200)."""
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def _launch(fn, grid, threads, smem: int, args: _Args, stream: int) -> None:
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    _check(_driver().cuLaunchKernel(fn, *grid, threads, 1, 1, smem, ctypes.c_void_p(stream),
                                    argv, None), "cuLaunchKernel")


class _LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, then a 64-byte union (here its first int)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` of ``cuLaunchKernelEx``."""

    _fields_ = [(n, ctypes.c_uint) for n in (
        "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_bytes")] + [
        ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


#: (grid, threads, shared bytes, stream) -> (CUlaunchConfig, its attribute): made once each
_DEPENDENT_CONFIGS: dict = {}


def _launch_dependent(fn, grid, threads, smem: int, args: _Args, stream: int) -> None:
    """Launch ``fn`` as a programmatic dependent of the kernel before it in ``stream``
    (Hopper+): its CTAs may be scheduled once every CTA of that kernel has started (the decode
    kernel says so first thing) and wait in ``griddepcontrol.wait`` for it to finish, so the
    merge starts without a launch gap. Elsewhere (no such driver entry) a plain launch."""
    if not hasattr(_driver(), "cuLaunchKernelEx"):
        return _launch(fn, grid, threads, smem, args, stream)
    key = (tuple(grid), threads, smem, stream)
    made = _DEPENDENT_CONFIGS.get(key)
    if made is None:
        if len(_DEPENDENT_CONFIGS) >= 64:  # (streams and plans come and go)
            _DEPENDENT_CONFIGS.clear()
        attr = _LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = _LaunchConfig(*grid, threads, 1, 1, smem, ctypes.c_void_p(stream),
                               ctypes.pointer(attr), 1)
        made = _DEPENDENT_CONFIGS[key] = (config, attr)  # (attr: kept alive with config)
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    _check(_driver().cuLaunchKernelEx(ctypes.byref(made[0]), fn, argv, None),
           "cuLaunchKernelEx")


def heads_per_cta(num_kv_heads: int, warps_per_head: int = WARPS_PER_HEAD,
                  max_warps: int = MAX_WARPS) -> int:
    """KV heads side by side in one CTA: the largest divisor of ``num_kv_heads`` that keeps the
    CTA within ``max_warps`` warps. (Their rows interleave in memory, so together they read
    whole token rows of the cache at once.)"""
    most = max(max_warps // warps_per_head, 1)
    return max(h for h in range(1, most + 1) if num_kv_heads % h == 0)


def default_launch(batch: int, num_kv_heads: int, max_len: int, sms: int,
                   total_tokens: int | None = None, kind: str = "fp8") -> tuple[int, int]:
    """``(chunk_len, warps_per_head)`` for a batch of a ``kind`` (``"fp8"`` / ``"int4"``)
    cache, from the probe on the H200 (``results/h200/cuda_kernels_study.json``, part
    ``launch_sweep``): each warp
    streams long runs of one head, about one or two CTAs per SM, and no merge kernel when it
    can be helped.

    * FP8 with lengths about equal (``total_tokens`` >= 90 % of ``batch * max_len``, or
      unknown): whole sequences, with the warps per head (1, 2 or 4; the CTA's KV heads
      shrink to match). FP8 reads fastest with the most KV heads a CTA (longer runs of each
      token row) that still give about one CTA per SM (>= 90 % of the SMs, at most 2 per
      SM): B64_L4096 takes 2 (128 CTAs; 4 heads a CTA, 91.8 % of copy bandwidth against
      90.4 % with 4 warps a head), B256_L1024 takes 1.
    * INT4 with lengths about equal (``h200/cuda_fp8_probe_2026-12-01_int4_launch.json``):
      one warp per head, so a CTA's 8 heads read whole token rows, and chunks of 1024
      tokens, doubled while that would give more than 2 CTAs per SM (whole sequences when
      they are no longer). B64_L4096: 4 chunks, 256 CTAs, 0.0952 ms against 0.0984 with whole
      sequences and 4 warps a head (2 heads a CTA); B8_L32768: 0.0956 against 0.1012 with
      2048-token chunks (1 CTA per SM); 512- and 768-token chunks were slower everywhere. Where
      that leaves fewer than half as many CTAs as SMs (short batches), the rule below.
    * Too few sequences for that (fewer CTAs than SMs even at 4): one warp per head (8 heads
      a CTA) and the sequences cut into as many chunks as fit one CTA per SM (B8_L32768:
      2048 tokens, B1_L131072: 1008), merged by a second kernel.
    * Ragged lengths: one warp per head, chunks sized for about 2 CTAs per SM in all.
    """
    max_len = max(max_len, 1)
    whole = {w: batch * num_kv_heads // heads_per_cta(num_kv_heads, w) for w in (1, 2, 4)}
    layer = whole[1]  # CTAs per chunk position with one warp per head
    uniform = total_tokens is None or total_tokens >= 0.9 * batch * max_len
    if uniform and kind == "int4":
        chunk = 1024
        while layer * math.ceil(max_len / chunk) > 2 * sms and chunk < max_len:
            chunk *= 2
        if layer * math.ceil(max_len / chunk) >= sms / 2:
            return min(chunk, max_len), 1
    if uniform:
        fits = [] if kind == "int4" else [w for w in (1, 2, 4) if 0.9 * sms <= whole[w] <= 2 * sms]
        if fits:
            return max_len, fits[0]
        if whole[1] > 2 * sms:  # many sequences: one warp per head, several CTAs per SM
            return max_len, 1
        chunks = max(1, sms // layer)
        chunk = 16 * math.ceil(math.ceil(max_len / chunks) / 16)
        return max(chunk, min(256, max_len)), 1
    # ragged: CTAs ~= (total / chunk + batch / 2) * layer / batch
    per_cta_pos = layer / batch  # CTAs per (sequence, chunk)
    target = max(2 * sms / per_cta_pos - batch / 2, 1)
    chunk = 16 * math.ceil(total_tokens / target / 16)
    return min(max(chunk, 256), max_len), 1


def default_stages(kind: str, ctas: int, sms: int, warps_per_head: int,
                   tma: bool = False) -> int:
    """Tiles in each warp's ring for a launch of ``ctas`` CTAs (docs/lab_notes.md, "Measure
    the ring depth for each launch"; the H200): FP8 with one warp per head and about
    two CTAs per SM or more (B256_L1024, the ragged batch) reads 1.8-1.9 % faster with 2 (one
    tile in flight while one is used) than with 3; with one CTA per SM (B8_L32768,
    B1_L131072) or two warps a head (B64_L4096) 2 stages were 6-8 % slower. INT4 was as fast
    or slower with 2 everywhere (21 % on B1_L131072) and 4 % slower with 4. The TMA-fed INT4
    kernel (``tma``: :func:`tma_feeds`; one ring per CTA) takes 4, still 2 tiles ahead but
    with a tile of slack before a stage must be free (the .cu's ``TMA_LAG``): B1_L131072
    0.0611 against 0.0640 ms with 3 (``h200/host_cost_probe_2026-12-01_int4_tma.json``). With
    at most one CTA per SM it takes 5 (3 tiles ahead: one CTA's 8 warps keep less in flight):
    B1_L131072 0.0580 against 0.0604 ms, while the batches of 2 CTAs per SM were 2-3 % slower
    with 5 (``h200/source_ab_probe_2026-12-01_int4_tma_stages.json``)."""
    if tma:
        return 5 if ctas <= sms else 4
    if kind == "fp8" and warps_per_head == 1 and ctas >= 1.5 * sms:
        return 2
    return DEFAULT_STAGES


def check_cuda_inputs(q, k_cache, v_cache, kind: str, stages=None) -> str:
    """Raise a clear error for what the ``kind`` (``"fp8"`` or ``"int4"``) kernel does not
    read; its kernel name without the dtype and head_dim (``"fp8_decode_{}_token"``)."""
    what = f"the CUDA {kind.upper()} kernel"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, QuantizedKV) or c.format.kind != kind:
            raise TypeError(f"{what} reads {kind} QuantizedKV caches; {name} is "
                            f"{getattr(getattr(c, 'format', None), 'name', type(c).__name__)}")
    if k_cache.format != v_cache.format:
        raise TypeError(f"k_cache is {k_cache.format.name}, v_cache {v_cache.format.name}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{what} takes float16 / bfloat16 q, got {q.dtype}")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{what} takes head_dim in {HEAD_DIMS}, got {head_dim}")
    if not _reads_grouping(k_cache.format, head_dim):
        raise ValueError(f"{what} reads a (scale, zero) pair per nibble half (format 'int4'); "
                         f"got {k_cache.format.name} (use the Triton kernel for it)")
    if block_size & (block_size - 1):
        raise ValueError(f"{what} needs a power-of-two block_size, got {block_size}")
    if q.shape[1] // num_kv_heads > MAX_GROUP:
        raise ValueError(f"{what} takes up to {MAX_GROUP} query heads per KV head, got "
                         f"{q.shape[1] // num_kv_heads}")
    if stages is not None and not (isinstance(stages, int) and 2 <= stages <= 8):
        raise ValueError(f"stages must be 2..8 (or None: default_stages), got {stages!r}")
    if q.stride(-1) != 1:
        raise ValueError(f"q's head_dim must be contiguous (stride 1) for {what}")
    if not q.is_cuda:
        raise ValueError(f"{what} runs on a CUDA GPU; q is on the CPU")
    return _kernel_name(k_cache.format)


def _reads_grouping(kv_format, head_dim: int) -> bool:
    """FP8 with either scale, or INT4 with a (scale, zero) pair per nibble half: ``int4``, or
    the same grouping spelled ``int4_g<head_dim / 2>`` (the same tensors)."""
    return kv_format.kind == "fp8" or kv_format.group(head_dim) == head_dim // 2


def _kernel_name(kv_format) -> str:
    """The decode kernel of a format, without the dtype and head_dim."""
    if kv_format.kind == "int4":
        return "int4_decode_{}"
    return "fp8_decode_{}" + ("_token" if kv_format.scale_per == "token_head" else "")


CUDA_FORMATS = ("fp8", "fp8_token_head", "int4")


def cuda_refusal(kv_format, q_dtype: torch.dtype, device, *, head_dim: int, group: int,
                 block_size: int) -> str | None:
    """Why the CUDA kernels would not run a call with these sizes, or ``None`` when they
    would (what ``paged_attention(backend="auto")`` and ``plan_decode`` ask before picking
    them): the cache format, q's dtype, head_dim, the group, the block size, and a GPU of
    compute capability >= 8.9 with nvcc: the rules :func:`check_cuda_inputs` raises on."""
    fmt = KVFormat.parse(kv_format) if isinstance(kv_format, str) else kv_format
    if fmt is None or fmt.kind not in ("fp8", "int4"):
        name = getattr(fmt, "name", "plain ones")
        return f"they read {', '.join(CUDA_FORMATS)} caches, not {name}"
    if q_dtype not in (torch.float16, torch.bfloat16):
        return f"they take float16 / bfloat16 q, not {q_dtype}"
    if head_dim not in HEAD_DIMS:
        return f"they take head_dim in {HEAD_DIMS}, not {head_dim}"
    if group > MAX_GROUP:
        return f"they take up to {MAX_GROUP} query heads per KV head, not {group}"
    if block_size & (block_size - 1):
        return f"they need a power-of-two block_size, not {block_size}"
    if not _reads_grouping(fmt, head_dim):
        return f"they read INT4 with a (scale, zero) pair per nibble half ('int4'), not {fmt.name}"
    if torch.device(device).type != "cuda" or not cuda_fp8_available(device):
        return "they need a CUDA GPU of compute capability >= 8.9 and nvcc"
    return None


@dataclass(frozen=True)
class CudaDecodePlan:
    """A prepared launch of the CUDA FP8 or INT4 kernel, as :func:`paged_ref.plan_decode` is
    for the Triton ones: the checks, the kernels, the chunking and the scratch buffers are settled
    once by :func:`plan_cuda`; :meth:`run` fills in the tensors' addresses and launches
    (no tensor value read, nothing allocated but the output). Lengths up to ``max_len`` are
    covered; the kernel clamps longer ones to it (cut short, never read past the table)."""

    q_shape: tuple
    q_dtype: torch.dtype
    cache_shape: tuple  # (block_size, Hkv, head_dim): any number of blocks
    kv_format: object
    device_index: int
    decode: ctypes.c_void_p
    merge: ctypes.c_void_p | None
    grid: tuple
    threads: int
    smem: int
    merge_threads: int
    chunk_len: int
    max_chunks: int
    max_len: int
    heads_per_cta: int
    stages: int  # tiles in each warp's shared-memory ring
    qk_scale_log2: float
    part_o: torch.Tensor | None  # [B, Hq, max_chunks, D] float32 scratch (None: one chunk)
    part_lse: torch.Tensor | None
    dependent_merge: bool = True  # the merge as a programmatic dependent launch (Hopper+)
    tma: bool = False  # int4_decode_tma (tma_feeds): the TMA unit reads the cache
    # its descriptions of the caches seen so far (_tma_maps), by address, shape and strides:
    # a cache is described once, not on every call
    tensor_maps: dict = field(default_factory=dict, compare=False, repr=False)

    def run(self, q, k_cache, v_cache, block_tables, seq_lens, out=None) -> torch.Tensor:
        """Attention for these tensors (shaped, typed and placed as planned).

        Its host time counts as much as the kernel's: B1_L131072's INT4 call lasts ~57 us on
        the H200, and this method took 86-94 us of the GPU machine's host, so that the bench's
        timer (and a serving loop) waited on Python: 75 us for what a CUDA graph of the same
        call replays in 57 (``results/h200/short_calls_study.json``, part ``host_before``). Read
        once per tensor, strides cost little; the stream is taken as a raw handle, and the merge's
        launch configuration is made once: 25-28 us (FP8 15-20), and the bench's timer agrees
        with the graph (``..._after.json``)."""
        qs = q.stride()
        if (tuple(q.shape) != self.q_shape or q.dtype != self.q_dtype
                or q.get_device() != self.device_index or qs[-1] != 1):
            raise ValueError(f"q {tuple(q.shape)} {q.dtype} on {q.device} does not match the "
                             f"plan: {self.q_shape} {self.q_dtype} on cuda:{self.device_index}, "
                             "head_dim contiguous")
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if (getattr(c, "format", None) != self.kv_format
                    or tuple(c.shape[1:]) != self.cache_shape):
                raise ValueError(f"{name} is not a {self.kv_format.name} cache of blocks "
                                 f"{self.cache_shape} (block_size, Hkv, head_dim) as planned")
        if out is None:
            out = torch.empty_like(q)
        if self.q_shape[0] == 0:
            return out
        if qs[0] % 4 or qs[1] % 4 or q.data_ptr() % 8:  # read 4 elements at a time
            q = q.contiguous()
            qs = q.stride()
        target = out
        # The kernel stores 4 channels at a time: an out it cannot (strides not multiples of 4
        # elements) gets the answer through a contiguous temporary.
        o_s = out.stride()
        if o_s[0] % 4 or o_s[1] % 4 or out.data_ptr() % 8 or o_s[2] != 1:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            o_s = out.stride()
        data, v_data = k_cache.data, v_cache.data
        ds = data.stride()
        if v_data.stride() != ds:  # the kernel reads V at K's offsets
            data, v_data = data.contiguous(), v_data.contiguous()
            ds = data.stride()
        if block_tables.stride(1) != 1:  # (the kernel steps through both by 1)
            block_tables = block_tables.contiguous()
        seq_lens = seq_lens.contiguous()
        ks, vs, kz, vz = k_cache.scale, v_cache.scale, k_cache.zero, v_cache.zero
        ss = ks.stride()
        if kz is not None:  # int4: (scale, zero) pairs read 4 bytes at a time, at K's offsets
            pairs = (ks, kz, vs, vz)
            if (ss[-1] != 1 or any(x % 2 for x in ss[:3])
                    or any(t.stride() != ss or t.data_ptr() % 4 for t in pairs)):
                ks, kz, vs, vz = (t.contiguous() for t in pairs)
                ss = ks.stride()
        elif vs.stride() != ss:
            ks, vs = ks.contiguous(), vs.contiguous()
            ss = ks.stride()
        maps = None
        if self.tma:  # the TMA unit's descriptions of these tensors (once per cache)
            key = (data.data_ptr(), v_data.data_ptr(), ks.data_ptr(), kz.data_ptr(),
                   vs.data_ptr(), vz.data_ptr(), data.shape[0], ds, ss)
            maps = self.tensor_maps.get(key)
            if maps is None:
                if not all(_tma_readable(c, (ks, kz, vs, vz)) for c in (data, v_data)):
                    # (copies, laid out and aligned as the TMA unit reads them, every call)
                    data, v_data, ks, kz, vs, vz = (t.clone(memory_format=torch.contiguous_format)
                                                    for t in (data, v_data, ks, kz, vs, vz))
                    ds, ss = data.stride(), ks.stride()
                    maps = _tma_maps(data, v_data, (ks, kz, vs, vz))
                else:
                    if len(self.tensor_maps) >= 16:  # (caches come and go: keep the last few)
                        self.tensor_maps.clear()
                    maps = self.tensor_maps[key] = _tma_maps(data, v_data, (ks, kz, vs, vz))
        s_strides = ss[:3] if len(ss) >= 3 else (0, 0, 0)
        if max(*ds, *s_strides) >= 2 ** 31:  # (the kernels step within a block in int)
            raise ValueError(f"the CUDA kernels take caches whose strides fit 32 bits; got "
                             f"codes {ds}, scales {s_strides}")
        part_o = out if self.part_o is None else self.part_o
        part_lse = out if self.part_lse is None else self.part_lse
        args = _Args(
            q.data_ptr(), data.data_ptr(), v_data.data_ptr(), ks.data_ptr(), vs.data_ptr(),
            block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), part_o.data_ptr(),
            part_lse.data_ptr(), kz.data_ptr() if kz is not None else None,
            vz.data_ptr() if vz is not None else None, qs[0], qs[1], o_s[0], o_s[1],
            ds[0], ds[1], ds[2], *s_strides, block_tables.stride(0),
            int(math.log2(self.cache_shape[0])), self.q_shape[1] // self.cache_shape[1],
            self.chunk_len, self.max_chunks, self.max_len, self.heads_per_cta,
            self.qk_scale_log2)
        if maps is not None:  # (6 maps, in Args' order: one copy of 768 bytes)
            ctypes.memmove(ctypes.addressof(args) + _Args.k_map.offset, maps, ctypes.sizeof(maps))
        stream = _device.current_stream_handle(self.device_index)
        _launch(self.decode, self.grid, self.threads, self.smem, args, stream)
        if self.merge is not None:
            launch = _launch_dependent if self.dependent_merge else _launch
            launch(self.merge, (self.q_shape[1], self.q_shape[0], 1), self.merge_threads, 0,
                   args, stream)
        if target is not out:
            target.copy_(out)
        return target


def plan_cuda(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, chunk_len=None,
              max_len=None, total_tokens=None, stages=None,
              defines=()) -> CudaDecodePlan:
    """For ``fp8`` / ``fp8_token_head`` caches, and ``int4`` ones (a (scale, zero) pair per
    nibble half): check the inputs (:func:`paged_ref.validation.check_shapes`, and
    :func:`~paged_ref.validation.check_values` unless ``max_len`` is given: one read-back),
    compile or load the kernels, choose the chunking and allocate the scratch: a
    :class:`CudaDecodePlan` to :meth:`~CudaDecodePlan.run` on these tensors or others like them.

    ``chunk_len`` (tokens per CTA and KV head) and the warps per head (the ``WARPS_PER_HEAD``
    define) default to :func:`default_launch` of ``max_len`` and ``total_tokens`` (the sum of
    the lengths, read back with ``max_len`` when that is not given). A ``WARPS_PER_HEAD`` in
    ``defines`` without a ``chunk_len`` runs whole sequences. ``stages`` (the ring's depth)
    defaults to :func:`default_stages` of that launch."""
    from paged_ref.validation import check_shapes, check_values

    shapes = check_shapes(q, k_cache, v_cache, block_tables, seq_lens, scale)
    kind = getattr(getattr(k_cache, "format", None), "kind", "fp8")
    check_cuda_inputs(q, k_cache, v_cache, kind if kind == "int4" else "fp8", stages)
    if max_len is None:
        lengths = check_values(block_tables, seq_lens, shapes)
        max_len, total_tokens = lengths.max_len, lengths.total_tokens
    return plan_cuda_for(q.shape, k_cache.shape[1], k_cache.shape[2], q.dtype, q.device,
                         k_cache.format, max_len=max_len, total_tokens=total_tokens,
                         scale=scale, chunk_len=chunk_len, stages=stages, defines=defines)


def plan_cuda_for(q_shape, block_size: int, num_kv_heads: int, dtype: torch.dtype, device,
                  kv_format, *, max_len: int, total_tokens: int | None = None, scale=None,
                  chunk_len=None, stages=None, defines=()) -> CudaDecodePlan:
    """:func:`plan_cuda` from sizes alone (q ``[batch, Hq, head_dim]``, the cache's block
    size, KV heads and format), for callers that checked their inputs already:
    :func:`paged_ref.plan_decode` and ``paged_attention(backend="auto")`` on quantised caches.
    The plan runs on caches of any number of blocks."""
    batch, num_q_heads, head_dim = q_shape
    kind = "int4" if kv_format.kind == "int4" else "fp8"
    kernel = _kernel_name(kv_format)
    if not isinstance(max_len, int) or max_len < 0:
        raise ValueError(f"max_len must be a non-negative int, got {max_len!r}")
    device = torch.device(device).index
    device = torch.cuda.current_device() if device is None else device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    defines = tuple(defines)
    if chunk_len is None and not any(d.startswith("WARPS_PER_HEAD=") for d in defines):
        chunk_len, warps = default_launch(batch, num_kv_heads, max_len, sms, total_tokens,
                                          kind)
        if warps != WARPS_PER_HEAD:
            defines = (*defines, f"WARPS_PER_HEAD={warps}")
    elif chunk_len is None:
        chunk_len = max_len
    # blocks of fewer than 16 tokens need a table entry per token row: the kernel built for them
    defines = tuple(d for d in defines if not d.startswith("SMALL_BLOCKS="))
    if block_size < 16:
        defines = (*defines, "SMALL_BLOCKS=1")
    warps_per_head = _macro(defines, "WARPS_PER_HEAD", WARPS_PER_HEAD)
    chunk_len = 16 * math.ceil(max(chunk_len, 1) / 16)  # tiles start at multiples of 16
    max_chunks = max(1, math.ceil(max_len / chunk_len))
    part_o = part_lse = None
    if max_chunks > 1:
        part_o = torch.empty(batch, num_q_heads, max_chunks, head_dim, dtype=torch.float32,
                             device=f"cuda:{device}")
        part_lse = torch.empty(batch, num_q_heads, max_chunks, dtype=torch.float32,
                               device=f"cuda:{device}")
    limit = _shared_limit(device)
    capability = torch.cuda.get_device_capability(device)
    if stages is None:  # by the CTAs that have work (a ragged batch's grid has idle ones)
        chunks = max_chunks * batch
        if total_tokens is not None:
            chunks = min(chunks, math.ceil(total_tokens / chunk_len) + batch)
        heads = heads_per_cta(num_kv_heads, warps_per_head, _macro(defines, "MAX_WARPS", MAX_WARPS))
        tma = tma_feeds(kind, head_dim, block_size, warps_per_head, heads, capability,
                        defines)
        stages = default_stages(kind, num_kv_heads // heads * chunks, sms, warps_per_head, tma)
    ring = shared_bytes(head_dim, stages, warps_per_head, kind)
    if ring > limit:  # (ring: per KV head of a CTA)
        raise ValueError(f"{stages} stages of head_dim {head_dim} need {ring} bytes of shared "
                         f"memory per head; this GPU allows {limit}: use fewer")
    heads = heads_per_cta(num_kv_heads, warps_per_head,
                          min(_macro(defines, "MAX_WARPS", MAX_WARPS),
                              limit // ring * warps_per_head))
    name = f"{'bf16' if dtype == torch.bfloat16 else 'f16'}_d{head_dim}"
    scale = head_dim ** -0.5 if scale is None else scale
    tma = tma_feeds(kind, head_dim, block_size, warps_per_head, heads,
                    capability, defines)
    smem = tma_shared_bytes(stages) if tma else ring * heads
    if tma:
        kernel = "int4_decode_tma_{}"
    return CudaDecodePlan(
        q_shape=tuple(q_shape), q_dtype=dtype,
        cache_shape=(block_size, num_kv_heads, head_dim), kv_format=kv_format,
        device_index=device,
        decode=_function(device, kernel.format(name), stages, defines, SOURCE),
        merge=(_function(device, f"fp8_merge_{name}", stages, defines, SOURCE)
               if max_chunks > 1 else None),
        grid=(num_kv_heads // heads, max_chunks, batch), threads=32 * heads * warps_per_head,
        smem=smem, merge_threads=32 * min(max_chunks, MAX_MERGE_WARPS),
        chunk_len=chunk_len, max_chunks=max_chunks, max_len=max_len, heads_per_cta=heads,
        stages=stages,
        qk_scale_log2=scale * math.log2(math.e), part_o=part_o, part_lse=part_lse,
        dependent_merge=capability >= (9, 0), tma=tma)


def paged_attention_cuda(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None,
                         out=None, chunk_len=None, max_len=None, total_tokens=None,
                         stages=None, defines=()) -> torch.Tensor:
    """Decode attention over FP8 or INT4 caches with the CUDA kernels (see the module
    docstring): a :func:`plan_cuda` and one :meth:`~CudaDecodePlan.run`.

    ``stages``: tiles in each warp's shared-memory ring (2..8; default
    :func:`default_stages`); ``defines``: other tuning
    macros of the .cu file, for experiments (``("WARPS_PER_HEAD=2", "L2_PREFETCH=128")``).
    ``chunk_len`` (tokens per CTA and KV head) defaults to :func:`default_launch`;
    ``max_len`` (the longest sequence) and ``total_tokens`` are read from ``seq_lens`` when
    ``max_len`` is not given (one read-back). Returns ``[batch, Hq, head_dim]`` in q's dtype
    (``out`` when given).
    """
    from paged_ref.validation import check_out

    if out is not None:
        check_out(out, q)
        if out.stride(-1) != 1:
            raise ValueError("out's head_dim must be contiguous (stride 1) for the CUDA kernels")
    plan = plan_cuda(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                     chunk_len=chunk_len, max_len=max_len, total_tokens=total_tokens,
                     stages=stages, defines=defines)
    return plan.run(q, k_cache, v_cache, block_tables, seq_lens, out)


def paged_attention_cuda_fp8(q, k_cache, v_cache, block_tables, seq_lens, **kwargs):
    """:func:`paged_attention_cuda` for FP8 caches only (anything else: a TypeError)."""
    check_cuda_inputs(q, k_cache, v_cache, "fp8", kwargs.get("stages"))
    return paged_attention_cuda(q, k_cache, v_cache, block_tables, seq_lens, **kwargs)


__all__ = ["CUDA_FORMATS", "CudaDecodePlan", "check_cuda_inputs", "compile_cubin",
           "cuda_fp8_available", "cuda_refusal", "default_launch", "default_stages",
           "heads_per_cta", "tma_feeds", "tma_shared_bytes", "TMA_HEADS",
           "paged_attention_cuda", "paged_attention_cuda_fp8", "plan_cuda", "plan_cuda_for"]
