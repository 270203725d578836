"""The CUDA driver API through :mod:`ctypes`: a cubin loaded, a kernel looked up, launched with
its argument struct, and the TMA unit's tensor maps encoded. No C++ extension build: a kernel
launch is visibly what it is, a function in a loaded module, a grid, a block and an
:class:`Args` struct (``common.cuh``'s ``struct Args``, field for field).

    fn = function(0, "fp8_decode_bf16_d128", Build(), SOURCE)  # compiled, loaded, looked up
    launch(fn, grid, threads, shared_bytes, args, stream)
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from paged_ref.kernels.cuda.build import TILE, TMA_HEADS, Build, compile_cubin


class TensorMap(ctypes.Structure):
    """``CUtensorMap``: 128 opaque bytes that ``cuTensorMapEncodeTiled`` fills (64-byte aligned
    in the .cu's ``Args``: :class:`Args` pads to it)."""

    _fields_ = [("opaque", ctypes.c_ulonglong * 16)]


class Args(ctypes.Structure):
    """The kernels' ``struct Args`` (``common.cuh``), field for field (1024 bytes)."""

    _fields_ = [(n, ctypes.c_void_p) for n in (
        "q", "k", "v", "k_scale", "v_scale", "block_tables", "seq_lens", "out", "part_o",
        "part_lse", "k_zero", "v_zero")] + [(n, ctypes.c_longlong) for n in (
            "q_sb", "q_sh", "o_sb", "o_sh", "c_sb", "c_st", "c_sh", "s_sb", "s_st", "s_sh",
            "table_sb")] + [(n, ctypes.c_int) for n in (
                "block_shift", "group", "chunk_len", "max_chunks", "max_len",
                "heads_per_cta")] + [
        ("qk_scale_log2", ctypes.c_float), ("_pad", ctypes.c_char * 44),  # (to byte 256)
        ("k_map", TensorMap), ("v_map", TensorMap), ("pair_maps", TensorMap * 4)]


def check(result: int, what: str) -> None:
    """Raise ``RuntimeError`` naming driver call ``what`` unless it returned CUDA_SUCCESS."""
    if result != 0:
        raise RuntimeError(f"CUDA driver call {what} failed with error {result}")


@functools.cache
def driver() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


@functools.cache
def _module(device_index: int, cubin: Path) -> ctypes.c_void_p:
    """``cubin`` loaded into ``device_index``'s (primary) context, once."""
    with torch.cuda.device(device_index):
        torch.cuda.current_stream().synchronize()  # makes torch's context current here
        module = ctypes.c_void_p()
        check(driver().cuModuleLoadData(ctypes.byref(module), cubin.read_bytes()),
              "cuModuleLoadData")
    return module


@functools.cache
def function(device_index: int, name: str, build: Build, source: Path) -> ctypes.c_void_p:
    """Kernel ``name`` from the cubin of ``source`` with ``build``'s settings (compiled for this
    GPU's architecture on first use), allowed all the shared memory a CTA may have on this GPU
    (less its own static ``__shared__`` arrays)."""
    major, minor = torch.cuda.get_device_capability(device_index)
    module = _module(device_index, compile_cubin(f"sm_{major}{minor}", build, source))
    fn = ctypes.c_void_p()
    with torch.cuda.device(device_index):
        check(driver().cuModuleGetFunction(ctypes.byref(fn), module, name.encode()),
              f"cuModuleGetFunction({name})")
        static = ctypes.c_int()  # CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES: its __shared__ arrays
        check(driver().cuFuncGetAttribute(ctypes.byref(static), 1, fn), "cuFuncGetAttribute")
        max_dynamic_shared = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        check(driver().cuFuncSetAttribute(fn, max_dynamic_shared,
                                          shared_limit(device_index) - static.value),
              "cuFuncSetAttribute")
    return fn


def shared_limit(device_index: int) -> int:
    """Bytes of shared memory one CTA may ask for on this GPU (227 KiB on an H100 / H200)."""
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def launch(fn, grid, threads: int, smem: int, args: Args, stream: int) -> None:
    """``cuLaunchKernel``: ``grid`` (3 ints) of ``threads``-thread CTAs with ``smem`` bytes of
    dynamic shared memory, on the raw ``stream`` handle, with ``args`` as the one parameter."""
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    check(driver().cuLaunchKernel(fn, *grid, threads, 1, 1, smem, ctypes.c_void_p(stream),
                                  argv, None), "cuLaunchKernel")


class LaunchAttribute(ctypes.Structure):
    """``CUlaunchAttribute``: an id, then a 64-byte union (here its first int)."""

    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                ("rest", ctypes.c_char * 60)]


class LaunchConfig(ctypes.Structure):
    """``CUlaunchConfig`` of ``cuLaunchKernelEx``."""

    _fields_ = [(n, ctypes.c_uint) for n in (
        "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z", "shared_bytes")] + [
        ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(LaunchAttribute)),
        ("num_attrs", ctypes.c_uint)]


PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION


#: (grid, threads, shared bytes, stream) -> (CUlaunchConfig, its attribute): made once each
_DEPENDENT_CONFIGS: dict = {}


def launch_dependent(fn, grid, threads: int, smem: int, args: Args, stream: int) -> None:
    """Launch ``fn`` as a programmatic dependent of the kernel before it in ``stream``
    (Hopper+): its CTAs may be scheduled once every CTA of that kernel has started (the decode
    kernel says so first thing) and wait in ``griddepcontrol.wait`` for it to finish, so the
    merge starts without a launch gap. Elsewhere (no such driver entry) a plain launch."""
    if not hasattr(driver(), "cuLaunchKernelEx"):
        return launch(fn, grid, threads, smem, args, stream)
    key = (tuple(grid), threads, smem, stream)
    made = _DEPENDENT_CONFIGS.get(key)
    if made is None:
        if len(_DEPENDENT_CONFIGS) >= 64:  # (streams and plans come and go)
            _DEPENDENT_CONFIGS.clear()
        attr = LaunchAttribute(id=PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        config = LaunchConfig(*grid, threads, 1, 1, smem, ctypes.c_void_p(stream),
                              ctypes.pointer(attr), 1)
        made = _DEPENDENT_CONFIGS[key] = (config, attr)  # (attr: kept alive with config)
    argv = (ctypes.c_void_p * 1)(ctypes.addressof(args))
    check(driver().cuLaunchKernelEx(ctypes.byref(made[0]), fn, argv, None), "cuLaunchKernelEx")


# --- the TMA unit's tensor maps (int4_decode_tma) ---------------------------------------------

U8, U32, SWIZZLE_128B, NO_SWIZZLE = 0, 2, 3, 0  # (cuda.h's enums)
#: How much the L2 fetches around each of the TMA unit's requests (cuda.h's
#: CUtensorMapL2promotion: 0 none, 1 64 bytes, 2 128, 3 256): 128 bytes, B64_L4096 0.0907 ms
#: against 0.0923 with 256 on the H200 (none: 0.0907; tma_promotion_probe, commit 9ae93fd)
L2_PROMOTION = 2


def _encode(tensor: torch.Tensor, dtype: int, dims: tuple, strides: tuple, box: tuple,
            swizzle: int) -> TensorMap:
    """``cuTensorMapEncodeTiled`` of ``tensor``'s memory as a tensor of ``dims`` elements
    (innermost first) with byte ``strides`` (of dims 1.., innermost first) and boxes ``box``."""
    tensor_map, n = TensorMap(), len(dims)
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    check(driver().cuTensorMapEncodeTiled(
        ctypes.byref(tensor_map), dtype, n, ctypes.c_void_p(tensor.data_ptr()),
        (u64 * n)(*dims), (u64 * (n - 1))(*strides), (u32 * n)(*box), (u32 * n)(*[1] * n),
        0, swizzle, L2_PROMOTION, 0), "cuTensorMapEncodeTiled")
    return tensor_map


def tma_maps(codes: torch.Tensor, v_codes: torch.Tensor, pairs: tuple):
    """What ``int4_decode_tma`` reads through the TMA unit (six :class:`TensorMap`, in ``Args``'
    order): the K and V codes ``[num_blocks, block_size, Hkv, 64]`` (uint8) as tensors of
    128-byte rows (two heads), head pairs, tokens of a block, blocks, with boxes of 128 bytes x
    4 pairs x 16 tokens, 128-byte swizzled; and each (scale, zero) tensor ``[num_blocks,
    block_size, Hkv, 2]`` (float16) as 4-byte pairs, heads, tokens, blocks, with boxes of
    8 heads x 16 tokens."""
    blocks, block_size, heads, row = codes.shape
    maps = [_encode(c, U8, (2 * row, heads // 2, block_size, blocks),
                    (c.stride(2) * 2, c.stride(1), c.stride(0)), (2 * row, TMA_HEADS // 2, TILE, 1),
                    SWIZZLE_128B) for c in (codes, v_codes)]
    maps += [_encode(t, U32, (heads, block_size, blocks), (2 * t.stride(1), 2 * t.stride(0)),
                     (TMA_HEADS, TILE, 1), NO_SWIZZLE) for t in pairs]
    return (TensorMap * 6)(*maps)


def tma_readable(codes: torch.Tensor, pairs: tuple) -> bool:
    """Whether the TMA unit can read these tensors as :func:`tma_maps` describes them: codes
    with each token's heads side by side (stride 64 bytes a head), pairs side by side (2
    float16s a head), and addresses and strides multiples of 16 bytes."""
    return (codes.stride(3) == 1 and codes.stride(2) == codes.shape[3]
            and all(x % 16 == 0 for x in (codes.stride(0), codes.stride(1), codes.data_ptr()))
            and all(t.stride(3) == 1 and t.stride(2) == 2 and t.data_ptr() % 16 == 0
                    and all(2 * x % 16 == 0 for x in t.stride()[:2]) for t in pairs))
