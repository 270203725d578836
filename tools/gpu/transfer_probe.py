"""Why does the packed KV transfer reach 77 % of the GPU-to-GPU copy bandwidth, not 80 %+?

Lesson 11's packed transfer (:mod:`paged_ref.transfer`) of a 32k-token prompt of the 8B-like
shape (32 layers, 8 KV heads, head_dim 128, bf16, blocks of 16: 4 GiB) reached 302 GB/s on two
H200s; one contiguous NCCL send/recv of 4 GiB reaches 370 GB/s, a ``dst.copy_(src)`` across the
GPUs 393 GB/s. At 8k and 32k tokens alike about 2.5 ms go missing. Suspects: (a) the gather /
scatter copy kernels (huge grids) hold every SM, so NCCL's kernel for the message just released
waits for SM slots; (b) ``index_copy_`` (the receiver's scatter) is a slow kernel; (c) costs per
message or per allocation (the staging buffers are allocated inside the timed region).

This probe times, for the 32k- and 8k-token prompts (blocks scattered in both pools, receiver
wall time from the header to the last block landed, as ``Transfer.seconds``; median of
``--reps`` after a warm-up; rank 1's blocks checked equal to rank 0's after every rep):

* ``V0_library``: ``transfer.send_sequence`` / ``recv_sequence`` as they are;
  ``V0_probe``: this file's copy of their loops (must time the same: the base of V2/V3);
  ``raw_chunked``: the same messages with no gather and no scatter (sizes suspect (c));
* ``V1_high_priority``: NCCL on high-priority streams (a ``new_group`` with
  ``ProcessGroupNCCL.Options(is_high_priority_stream=True)``); ``V1_min_ctas32`` /
  ``V1_max_ctas16``: the ``ncclConfig_t`` CTA bounds of that group's communicators;
* ``V2_tritonN``: gather and scatter by a persistent Triton kernel of N programs (N SMs at
  most), each copying whole 32 KiB block rows, two at a time, the other SMs left to NCCL (the
  copy only has to outrun NVLink, not HBM); also gather-only and scatter-only;
* ``V3_index_put`` (scatter by ``index_put_``), ``V3_prealloc`` (staging buffers allocated
  once, outside the timed region), both, and combinations with V1/V2;
* ``V4[...]``: NCCL environment settings, each in a fresh pair of processes (NCCL reads them
  once): ``NCCL_P2P_NVL_CHUNKSIZE`` 1/2/4 MiB (default 512 KiB), more or fewer p2p channels
  (``NCCL_MIN_P2P_NCHANNELS`` / ``NCCL_MAX_P2P_NCHANNELS``, ``NCCL_MIN_NCHANNELS``),
  copy-engine p2p (``NCCL_P2P_USE_CUDA_MEMCPY=1``);
* the ceilings: one contiguous NCCL send/recv of 4 GiB, and ``dst.copy_(src)`` cuda:0 ->
  cuda:1 (the "copy bandwidth" every percentage is of);
* the copy kernels alone (one 512 MiB message of the 32k prompt, no NCCL running; the Triton
  kernel at 1, 2 and 4 rows at a time);
* the fixed costs of a transfer: a 16-byte message there and back (header + answer), and the
  receiver's host work before its answer (``add_sequence``, ``_block_index``);
* a torch.profiler trace of ``V0_library`` at 32k on both ranks: per kernel class (gather,
  nccl, scatter) total time and count, and the share of the wall time during which an NCCL
  kernel was running (union of their intervals), plus each rank's kernel timeline.

Writes ``--out`` (``$OUT/transfer_probe.json``) after every pair of processes. On two GPUs:
``bash tools/gpu/transfer_probe.sh``. ``--cpu`` runs the same code on gloo with a tiny pool and
the Triton kernel in the interpreter (the smoke test, tests/test_transfer_probe.py).
"""

from __future__ import annotations  # noqa: I001 (paged_ref before triton, see below)

import argparse
import datetime as dt
import json
import math
import os
import re
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

# First: on a machine without a GPU, paged_ref sets TRITON_INTERPRET=1 before triton is imported.
from paged_ref import KVCacheManager, PagedKVCache, transfer
from paged_course.timing import events_ms
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import triton
import triton.language as tl

from paged_ref.cache_math import blocks_needed
from paged_bench.transfer import SHAPE as GPU_SHAPE
from paged_bench.transfer import make_pool, sync_device
from paged_course.results import environment, write_result
from paged_course.two_ranks import free_port
from paged_ref.transfer.payload import _block_index, _block_rows, _pool_rows, _row_numel, _staging

#: The 8B-like model's KV shape is bench_transfer's (GPU_SHAPE); a tiny one for the CPU smoke run.
CPU_SHAPE = dict(num_layers=6, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.bfloat16)


# ---------------------------------------------------------------- the SM-limited copy kernel
@triton.jit
def copy_rows_kernel(src_ptr, dst_ptr, index_ptr, num_rows, ROW: tl.constexpr,
                     BLOCK: tl.constexpr, ROWS: tl.constexpr, GATHER: tl.constexpr):
    """Persistent grid of P programs: program p copies the groups of ``ROWS`` rows p, p + P,
    p + 2P, ... (all their loads in flight at once). Rows are ``ROW`` int32 words. ``GATHER``:
    ``dst[r] = src[index[r]]``, else ``dst[index[r]] = src[r]``."""
    offs = tl.arange(0, BLOCK)
    for group in range(tl.program_id(0), tl.cdiv(num_rows, ROWS), tl.num_programs(0)):
        r = group * ROWS + tl.arange(0, ROWS)
        live = r < num_rows
        j = tl.load(index_ptr + r, mask=live, other=0).to(tl.int64)
        if GATHER:
            src_row = j
            dst_row = r.to(tl.int64)
        else:
            src_row = r.to(tl.int64)
            dst_row = j
        for c in tl.static_range(0, ROW, BLOCK):
            cols = c + offs
            mask = live[:, None] & (cols < ROW)[None, :]
            x = tl.load(src_ptr + src_row[:, None] * ROW + cols[None, :], mask=mask)
            tl.store(dst_ptr + dst_row[:, None] * ROW + cols[None, :], x, mask=mask)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, programs: int,
              gather: bool, rows: int = 2) -> None:
    """Whole-row copy by :func:`copy_rows_kernel` on at most ``programs`` programs (SMs),
    ``rows`` rows (a power of two) at a time each. ``src`` / ``dst``: contiguous
    ``[rows, row]`` (any dtype; moved as int32 words); ``index``: int64 ``[n]``.
    gather: ``dst[r] = src[index[r]]``; else ``dst[index[r]] = src[r]``."""
    words = src.shape[1] * src.element_size() // 4
    block = min(triton.next_power_of_2(words), 16384 // rows)
    grid = (max(1, min(programs, triton.cdiv(len(index), rows))),)
    copy_rows_kernel[grid](src.view(torch.int32), dst.view(torch.int32), index, len(index),
                           ROW=words, BLOCK=block, ROWS=rows, GATHER=gather,
                           num_warps=16 if src.is_cuda else 4)


# Gathers ``out[r] = pool[rows[r]]`` and scatters ``pool[rows[r]] = buf[r]`` by name.
def gather_index_select(pool, rows, out):
    torch.index_select(pool, 0, rows, out=out)


def scatter_index_copy(pool, rows, buf):
    pool.index_copy_(0, rows, buf)


def scatter_index_put(pool, rows, buf):
    pool.index_put_((rows,), buf)


def gather_triton(programs):
    return lambda pool, rows, out: copy_rows(pool, out, rows, programs, gather=True)


def scatter_triton(programs):
    return lambda pool, rows, buf: copy_rows(buf, pool, rows, programs, gather=False)


def no_copy(pool, rows, buf):
    """``raw_chunked``: the messages travel, nothing is gathered or scattered."""


# ------------------------------------------------- the send / receive loops (transfer/stream.py's)
def send_payload(cache, idx, bounds, dst, group, staging, gather):
    """``transfer.stream.send_payload`` (packed): gather layers [l0, l1) into one of two staging
    buffers and ``isend`` it; the next gather overlaps this send."""
    rows = _block_rows(cache, idx)
    in_flight = [None, None]
    for i, (layer0, layer1) in enumerate(bounds):
        if in_flight[i % 2] is not None:
            in_flight[i % 2].wait()  # this buffer's previous send has read it
        buf = _message_rows(staging[i % 2], cache, layer1 - layer0, len(idx))
        gather(_pool_rows(cache), rows[:, layer0:layer1].flatten(), buf)
        in_flight[i % 2] = dist.isend(buf, dst, group=group)
    for work in in_flight:
        if work is not None:
            work.wait()


def recv_payload(cache, idx, bounds, src, group, staging, scatter):
    """``transfer.stream.recv_payload`` (packed): the next ``irecv`` is posted before this message
    is scattered into its blocks."""
    rows = _block_rows(cache, idx)

    def post(i):
        layer0, layer1 = bounds[i]
        buf = _message_rows(staging[i % 2], cache, layer1 - layer0, len(idx))
        return buf, dist.irecv(buf, src, group=group)

    pending = post(0)
    for i, (layer0, layer1) in enumerate(bounds):
        buf, work = pending
        if i + 1 < len(bounds):
            pending = post(i + 1)
        work.wait()
        scatter(_pool_rows(cache), rows[:, layer0:layer1].flatten(), buf)


def _message_rows(buffer, cache, num_layers, num_blocks):
    """The start of a flat staging buffer as ``[2 * num_layers * num_blocks, row]``."""
    n = 2 * num_layers * num_blocks
    return buffer[: n * _row_numel(cache)].view(n, _row_numel(cache))


# ---------------------------------------------------------------------------- the variants
@dataclass(frozen=True)
class Variant:
    """One way to move the payload. ``library``: call ``send_sequence`` / ``recv_sequence``;
    else this file's loops with ``gather`` / ``scatter`` (names of :func:`copy_fns`),
    ``prealloc``: staging buffers allocated once, outside the timed region; ``group``: a key of
    :data:`GROUPS` (None: the default group)."""

    name: str
    library: bool = False
    gather: str = "index_select"
    scatter: str = "index_copy"
    prealloc: bool = False
    group: str | None = None
    checked: bool = True


def copy_fns(v: Variant):
    def pick(name, kind):
        if name.startswith("triton"):
            n = int(name[len("triton"):])
            return gather_triton(n) if kind == "gather" else scatter_triton(n)
        return {"index_select": gather_index_select, "index_copy": scatter_index_copy,
                "index_put": scatter_index_put, "none": no_copy}[name]

    return pick(v.gather, "gather"), pick(v.scatter, "scatter")


#: Extra process groups: name -> (high-priority streams, ncclConfig_t fields).
GROUPS = {"hp": (True, {}), "min_ctas32": (False, {"min_ctas": 32}),
          "max_ctas16": (False, {"max_ctas": 16})}


def main_variants(programs: list[int], gpu: bool) -> list[Variant]:
    """V0 .. V3 (the first pair of processes)."""
    t = f"triton{32 if 32 in programs else programs[-1]}"
    vs = [Variant("V0_library", library=True),
          Variant("V0_probe"),
          Variant("raw_chunked", gather="none", scatter="none", checked=False),
          Variant("raw_chunked+prealloc", gather="none", scatter="none", prealloc=True,
                  checked=False)]
    if gpu:
        vs += [Variant("V1_high_priority", library=True, group="hp")]
    vs += [Variant(f"V2_triton{n}", gather=f"triton{n}", scatter=f"triton{n}")
           for n in programs]
    vs += [Variant(f"V2_gather_only_{t}", gather=t),
           Variant(f"V2_scatter_only_{t}", scatter=t),
           Variant("V3_index_put", scatter="index_put"),
           Variant("V3_prealloc", prealloc=True),
           Variant("V3_index_put+prealloc", scatter="index_put", prealloc=True),
           Variant(f"V2+V3_{t}+prealloc", gather=t, scatter=t, prealloc=True)]
    if gpu:
        vs += [Variant("V1+V3_high_priority+prealloc", prealloc=True, group="hp"),
               Variant(f"V1+V2+V3_high_priority+{t}+prealloc", gather=t, scatter=t,
                       prealloc=True, group="hp"),
               # last: communicators with CTA bounds (new NCCL configs: the likeliest to fail)
               Variant("V1_min_ctas32", library=True, group="min_ctas32"),
               Variant("V1_max_ctas16", library=True, group="max_ctas16")]
    return vs


def env_variants(programs: list[int]) -> list[Variant]:
    """What each V4 pair of processes runs under its NCCL settings."""
    t = f"triton{32 if 32 in programs else programs[-1]}"
    return [Variant("V0_library", library=True),
            Variant("raw_chunked+prealloc", gather="none", scatter="none", prealloc=True,
                    checked=False),
            Variant(f"V2+V3_{t}+prealloc", gather=t, scatter=t, prealloc=True)]


#: V4: NCCL settings read once per process (NCCL 2.2x names; defaults in the comments).
ENV_SETS = {
    "nvl_chunk_1MiB": {"NCCL_P2P_NVL_CHUNKSIZE": str(1 << 20)},  # default 512 KiB
    "nvl_chunk_2MiB": {"NCCL_P2P_NVL_CHUNKSIZE": str(2 << 20)},
    "nvl_chunk_4MiB": {"NCCL_P2P_NVL_CHUNKSIZE": str(4 << 20), "NCCL_BUFFSIZE": str(8 << 20)},
    "channels_32": {"NCCL_MIN_NCHANNELS": "32", "NCCL_MIN_P2P_NCHANNELS": "32"},
    "p2p_channels_max8": {"NCCL_MAX_P2P_NCHANNELS": "8"},
    "ce_memcpy": {"NCCL_P2P_USE_CUDA_MEMCPY": "1"},  # copy engines, no SMs for NCCL
}


# ------------------------------------------------------------------------------ one rank
@dataclass
class Side:
    """One rank's state for one prompt: its pool, and on rank 1 the sender's pool regenerated
    (same seed) to check against."""

    rank: int
    device: torch.device
    prompt: int
    cache: PagedKVCache
    manager: KVCacheManager
    chunk_bytes: int | None  # packed mode's message size (None: the library's default)
    per_chunk: int
    bounds: list
    staging: list
    ref: PagedKVCache | None = None
    ref_manager: KVCacheManager | None = None
    groups: dict = field(default_factory=dict)


def _barrier(device, group=None):
    dist.barrier(group=group, device_ids=[device.index] if device.type == "cuda" else None)


def one_transfer(side: Side, v: Variant) -> float | None:
    """Move ``"req"`` from rank 0 to rank 1 once; rank 1's wall seconds (None on rank 0)."""
    group = side.groups.get(v.group)
    cache, manager = side.cache, side.manager
    if v.library:
        if side.rank == 0:
            transfer.send_sequence(cache, manager, "req", dst=1, group=group,
                                   chunk_bytes=side.chunk_bytes)
            return None
        return transfer.recv_sequence(cache, manager, "req2", src=0, group=group).seconds
    gather, scatter = copy_fns(v)
    num_blocks = blocks_needed(side.prompt, cache.block_size)
    word = torch.zeros(2, dtype=torch.int64, device=side.device)  # header / answer stand-in
    if side.rank == 0:
        idx = _block_index(cache, manager.block_table("req"))
        sync_device(side.device)
        dist.send(word, 1, group=group)
        dist.recv(word, 1, group=group)
        staging = side.staging if v.prealloc else _staging(cache, side.per_chunk,
                                                                    num_blocks)
        send_payload(cache, idx, side.bounds, 1, group, staging, gather)
        sync_device(side.device)
        return None
    dist.recv(word, 0, group=group)
    start = time.perf_counter()
    manager.add_sequence("req2", side.prompt)
    idx = _block_index(cache, manager.block_table("req2"))
    dist.send(word, 0, group=group)
    staging = side.staging if v.prealloc else _staging(cache, side.per_chunk,
                                                                num_blocks)
    recv_payload(cache, idx, side.bounds, 0, group, staging, scatter)
    sync_device(side.device)
    return time.perf_counter() - start


def blocks_equal(side: Side) -> bool:
    """Rank 1: the blocks of ``"req2"`` equal the sender's blocks of ``"req"``."""
    ref_idx = torch.as_tensor(side.ref_manager.block_table("req"), device=side.device)
    got_idx = torch.as_tensor(side.manager.block_table("req2"), device=side.device)
    return all(torch.equal(side.ref.kv[kv, layer, ref_idx], side.cache.kv[kv, layer, got_idx])
               for kv in (0, 1) for layer in range(side.cache.num_layers))


def time_variant(side: Side, v: Variant, reps: int) -> dict | None:
    """Warm-up + ``reps`` transfers; rank 1 returns the row (median ms), checking its blocks
    after every rep (scribbled over before it)."""
    times, ok = [], True
    for _ in range(reps + 1):
        if side.rank == 1:
            side.cache.kv.zero_()  # so a block that did not land cannot pass the check
        sync_device(side.device)
        _barrier(side.device)
        seconds = one_transfer(side, v)
        if side.rank == 1:
            times.append(seconds)
            if v.checked:
                ok = ok and blocks_equal(side)
            side.manager.free_sequence("req2")
    if side.rank == 0:
        return None
    if not ok:
        raise AssertionError(f"{v.name}: rank 1's blocks differ from rank 0's")
    return {"variant": v.name, "prompt_tokens": side.prompt, "ms": statistics.median(times[1:])
            * 1e3, "reps_ms": [t * 1e3 for t in times[1:]], "warmup_ms": times[0] * 1e3,
            "checked": v.checked}


def build_side(rank, device, shape, prompt, chunk_bytes, groups) -> Side:
    cache, manager = make_pool(prompt, device, seed=prompt if rank == 0 else prompt + 1,
                               shape=shape)
    ref = ref_manager = None
    if rank == 1:
        manager.free_sequence("req")  # room for the incoming copy
        ref, ref_manager = make_pool(prompt, device, seed=prompt, shape=shape)
    num_blocks = blocks_needed(prompt, shape["block_size"])
    per_chunk = transfer.layers_per_chunk(cache, num_blocks, "packed", chunk_bytes)
    return Side(rank, device, prompt, cache, manager, chunk_bytes, per_chunk,
                transfer.chunk_bounds(cache.num_layers, per_chunk),
                _staging(cache, per_chunk, num_blocks), ref, ref_manager, groups)


def make_groups(names, gpu: bool, errors: list) -> dict:
    """Process groups over ranks 0 and 1 with the :data:`GROUPS` options (NCCL only); a group
    that cannot be made is left out, with its error appended to ``errors``."""
    groups = {}
    for name in names if gpu else []:
        high_priority, config = GROUPS[name]
        try:  # (the same on both ranks: both fail alike)
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = high_priority
            if config:
                nccl_config = opts.config
                for key, value in config.items():
                    setattr(nccl_config, key, value)
                opts.config = nccl_config
            groups[name] = dist.new_group([0, 1], backend="nccl", pg_options=opts)
        except Exception as e:
            errors.append({"what": f"group {name}", "error": f"{type(e).__name__}: {e}"})
    return groups


def fixed_costs(side: Side, reps: int) -> dict:
    """What every transfer pays whatever its size: a two-int64 message there and back (the
    header and the answer), and on the receiver the host work before its answer (the manager's
    ``add_sequence`` and ``_block_index`` of the block table). Median ms."""
    word = torch.zeros(2, dtype=torch.int64, device=side.device)
    ping = []
    for _ in range(reps + 2):
        _barrier(side.device)
        t0 = time.perf_counter()
        if side.rank == 0:
            dist.send(word, 1)
            dist.recv(word, 1)
        else:
            dist.recv(word, 0)
            dist.send(word, 0)
        sync_device(side.device)
        ping.append((time.perf_counter() - t0) * 1e3)
    out = {"prompt_tokens": side.prompt, "round_trip_ms": statistics.median(ping[2:])}
    if side.rank == 1:
        add, index = [], []
        for _ in range(reps + 1):
            t0 = time.perf_counter()
            side.manager.add_sequence("req2", side.prompt)
            t1 = time.perf_counter()
            _block_index(side.cache, side.manager.block_table("req2"))
            sync_device(side.device)
            index.append((time.perf_counter() - t1) * 1e3)
            add.append((t1 - t0) * 1e3)
            side.manager.free_sequence("req2")
        out.update(add_sequence_ms=statistics.median(add[1:]),
                   block_index_ms=statistics.median(index[1:]))
    return out


def raw_sendrecv_gbps(rank, device, num_bytes, reps, group=None) -> float:
    """One contiguous buffer, ``dist.send`` / ``recv``: the transport's ceiling (GB/s)."""
    big = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(reps + 1):
        _barrier(device)
        sync_device(device)
        t0 = time.perf_counter()
        (dist.send if rank == 0 else dist.recv)(big, 1 - rank, group=group)
        sync_device(device)
        times.append(time.perf_counter() - t0)
    return num_bytes / statistics.median(times[1:]) / 1e9


def copy_kernel_rows(side: Side, programs: list[int], reps: int) -> list[dict]:
    """The gather / scatter kernels alone on one full message (rank 0, no NCCL running)."""
    cache = side.cache
    layer0, layer1 = side.bounds[min(1, len(side.bounds) - 1)]
    idx = _block_index(cache, side.manager.block_table("req"))
    rows = _block_rows(cache, idx)[:, layer0:layer1].flatten()
    pool = _pool_rows(cache)
    buf = _message_rows(side.staging[0], cache, layer1 - layer0, len(idx))
    nbytes = buf.numel() * buf.element_size()
    ref = pool[rows]
    methods = [("gather", "index_select", lambda: gather_index_select(pool, rows, buf)),
               ("scatter", "index_copy", lambda: scatter_index_copy(pool, rows, buf)),
               ("scatter", "index_put", lambda: scatter_index_put(pool, rows, buf))]
    for n in programs:  # (the transfers use 2 rows at a time)
        for k in (1, 2, 4):
            methods += [
                ("gather", f"triton{n}x{k}", lambda n=n, k=k: copy_rows(pool, buf, rows, n, True,
                                                                        k)),
                ("scatter", f"triton{n}x{k}", lambda n=n, k=k: copy_rows(buf, pool, rows, n,
                                                                         False, k))]
    out = []
    for kind, name, fn in methods:
        try:
            buf.copy_(ref)
            ms = _time_ms(fn, side.device, reps)
            if not torch.equal(pool[rows], ref) or not torch.equal(buf, ref):
                raise AssertionError(f"{kind} {name}: wrong data")
            out.append({"kind": kind, "method": name, "ms": ms, "bytes": nbytes,
                        "gbps": nbytes / ms / 1e6, "layers": layer1 - layer0})
        except Exception as e:  # one failure must not stop the rest
            out.append({"kind": kind, "method": name, "error": f"{type(e).__name__}: {e}"})
    return out


def _time_ms(fn, device, reps: int) -> float:
    if device.type == "cuda":
        return events_ms(fn, reps=reps, warmup=1)
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


# ------------------------------------------------------------------------- the profile
def kernel_class(name: str) -> str:
    """``nccl`` (communication, also gloo's ops on a CPU), ``gather``, ``scatter`` or ``other``."""
    n = name.lower().replace("_", "")
    if "nccl" in n or "gloo" in n or "c10d::" in n:
        return "nccl"
    if "indexselect" in n or "gather" in n:
        return "gather"
    if "indexcopy" in n or "indexput" in n or "scatter" in n:
        return "scatter"
    if "copyrowskernel" in n:
        return "copy_rows"
    return "other"


def union_ms(intervals) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def profile_summary(events: list[dict], wall_ms: float | None) -> dict:
    """Per kernel class and name: total ms and count; the union of NCCL kernels' intervals
    (ms, % of the span from the first kernel start to the last kernel end, % of ``wall_ms``);
    how much of it overlapped a copy kernel; the timeline (ms from the first kernel)."""
    if not events:
        return {"error": "no kernel events"}
    t0 = min(e["ts"] for e in events)
    span = (max(e["ts"] + e["dur"] for e in events) - t0) / 1e3
    by_class, by_name = {}, {}
    for e in events:
        for table, key in ((by_class, kernel_class(e["name"])), (by_name, e["name"][:200])):
            entry = table.setdefault(key, {"total_ms": 0.0, "count": 0})
            entry["total_ms"] += e["dur"] / 1e3
            entry["count"] += 1
    spans = {k: [((e["ts"] - t0) / 1e3, (e["ts"] + e["dur"] - t0) / 1e3) for e in events
                 if kernel_class(e["name"]) in k] for k in (("nccl",), ("gather", "scatter",
                                                                        "copy_rows"))}
    nccl_ms, copy_ms = union_ms(spans[("nccl",)]), union_ms(spans[("gather", "scatter",
                                                                     "copy_rows")])
    both_ms = nccl_ms + copy_ms - union_ms(spans[("nccl",)] + spans[("gather", "scatter",
                                                                       "copy_rows")])
    timeline = [{"class": kernel_class(e["name"]), "name": e["name"][:120],
                 "start_ms": round((e["ts"] - t0) / 1e3, 4), "dur_ms": round(e["dur"] / 1e3, 4)}
                for e in sorted(events, key=lambda e: e["ts"])]
    top = dict(sorted(by_name.items(), key=lambda kv: -kv[1]["total_ms"])[:12])
    return {"span_ms": span, "wall_ms": wall_ms, "by_class": by_class, "by_name": top,
            "nccl_busy_ms": nccl_ms, "nccl_busy_pct_of_span": 100 * nccl_ms / span,
            "nccl_busy_pct_of_wall": 100 * nccl_ms / wall_ms if wall_ms else None,
            "nccl_and_copy_overlap_ms": both_ms, "timeline": timeline[:80]}


def profile_v0(side: Side) -> dict:
    """One ``V0_library`` transfer under torch.profiler (after the timed reps warmed it up)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = side.device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if gpu else [])
    if side.rank == 1:
        side.cache.kv.zero_()
    sync_device(side.device)
    _barrier(side.device)
    with profile(activities=activities) as prof:
        seconds = one_transfer(side, Variant("V0_library", library=True))
        sync_device(side.device)
    ok = None
    if side.rank == 1:
        ok = blocks_equal(side)
        side.manager.free_sequence("req2")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    category = "kernel" if gpu else "cpu_op"
    events = [e for e in trace.get("traceEvents", []) if e.get("cat") == category
              and "dur" in e and (gpu or kernel_class(e["name"]) != "other")]
    summary = profile_summary(events, seconds * 1e3 if seconds else None)
    summary.update({"rank": side.rank, "prompt_tokens": side.prompt, "events": category,
                    "checked_equal": ok})
    return summary


# ------------------------------------------------------------------------ rank processes
def _record(out_dir: Path, rank: int, kind: str, data) -> None:
    """Append one record to this rank's JSON-lines file (read by the parent even if the pair
    of processes is killed later)."""
    with open(out_dir / f"rank{rank}.jsonl", "a") as f:
        f.write(json.dumps({"kind": kind, "data": data}) + "\n")


def _agree(ok: bool, device) -> bool:
    """Both ranks ok? (so a failure to prepare a variant on one rank cannot hang the other)."""
    flag = torch.tensor([int(ok)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def rank_main(rank: int, out_dir: Path, *, gpu: bool, prompts: list[int], reps: int,
              variants: list[Variant], group_names: list[str], programs: list[int],
              raw_bytes: int, chunk_bytes: int | None, profile: bool, kernels: bool) -> None:
    device = torch.device("cuda", rank) if gpu else torch.device("cpu")
    shape = GPU_SHAPE if gpu else CPU_SHAPE
    say = (lambda *a: print(f"[rank {rank}]", *a, flush=True))
    errors = []
    groups = make_groups(group_names, gpu, errors)
    for error in errors:
        _record(out_dir, rank, "error", error)
    for label, group in [("raw_contiguous", None), ("raw_contiguous[hp]", groups.get("hp"))]:
        if label.endswith("[hp]") and group is None:
            continue
        gbps = raw_sendrecv_gbps(rank, device, raw_bytes, reps, group)
        if rank == 1:
            _record(out_dir, rank, "raw", {"variant": label, "bytes": raw_bytes, "gbps": gbps})
            say(f"{label}: {gbps:.0f} GB/s")
    kernels_checked = False
    for prompt in prompts:
        side = build_side(rank, device, shape, prompt, chunk_bytes, groups)
        costs = fixed_costs(side, reps)
        if rank == 1:
            _record(out_dir, rank, "fixed_costs", costs)
        for v in variants:
            if v.group is not None and v.group not in groups:
                continue
            try:  # compile and check the copy kernels before any message is in flight
                if "triton" in v.gather + v.scatter and not kernels_checked:
                    check_copy_kernels(device, programs=[4], shape=shape)
                    kernels_checked = True
                ready = True
            except Exception as e:
                ready = False
                _record(out_dir, rank, "error", {"variant": v.name, "prompt_tokens": prompt,
                                                 "error": f"{type(e).__name__}: {e}"})
            if not _agree(ready, device):
                continue
            try:
                row = time_variant(side, v, reps)
                if row is not None:
                    row["messages"] = len(side.bounds)
                    _record(out_dir, rank, "row", row)
                    say(f"P{prompt} {v.name}: {row['ms']:.3f} ms")
            except Exception as e:
                _record(out_dir, rank, "error", {"variant": v.name, "prompt_tokens": prompt,
                                                 "error": f"{type(e).__name__}: {e}",
                                                 "trace": traceback.format_exc()[-1500:]})
                say(f"P{prompt} {v.name}: FAILED {e}")
                if side.rank == 1 and side.manager.has_sequence("req2"):
                    side.manager.free_sequence("req2")
        if prompt == max(prompts):
            if profile:
                try:
                    _record(out_dir, rank, "profile", profile_v0(side))
                except Exception as e:
                    _record(out_dir, rank, "error", {"what": "profile",
                                                     "error": f"{type(e).__name__}: {e}"})
            if kernels and rank == 0:
                _record(out_dir, rank, "kernels", copy_kernel_rows(side, programs, reps))
            _barrier(device)
        del side
        if gpu:
            torch.cuda.empty_cache()


def check_copy_kernels(device, programs=(2,), shape=CPU_SHAPE, seed: int = 0) -> None:
    """The Triton copy kernel against ``index_select`` / ``index_copy_`` on a small pool
    (scattered, shuffled rows): raises ``AssertionError`` on any difference."""
    gen = torch.Generator(device=device).manual_seed(seed)
    row = shape["block_size"] * shape["num_kv_heads"] * shape["head_dim"]
    pool = torch.randn(40, row, generator=gen, device=device).to(shape["dtype"])
    rows = torch.randperm(40, generator=gen, device=device)[:23]
    for n in programs:
        for k in (1, 2, 4):
            out = torch.empty(len(rows), row, dtype=pool.dtype, device=device)
            copy_rows(pool, out, rows, n, gather=True, rows=k)
            assert torch.equal(out, torch.index_select(pool, 0, rows)), f"gather, {n}x{k}"
            new = torch.randn(len(rows), row, generator=gen, device=device).to(pool.dtype)
            got, want = pool.clone(), pool.clone()
            copy_rows(new, got, rows, n, gather=False, rows=k)
            want.index_copy_(0, rows, new)
            assert torch.equal(got, want), f"scatter, {n}x{k}"


def _entry(rank, backend, port, out_dir, env, kwargs):
    os.environ.update(env)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2, timeout=dt.timedelta(seconds=90))
    try:
        rank_main(rank, Path(out_dir), **kwargs)
    finally:
        dist.destroy_process_group()


def run_pair(backend: str, env: dict, deadline_s: float, **kwargs) -> tuple[list, str | None]:
    """Run :func:`rank_main` on two spawned processes with ``env`` set before NCCL starts;
    kill them after ``deadline_s``. Returns (records of both ranks, error or None)."""
    env = {"NCCL_NVLS_ENABLE": "0", **env}
    error = None
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_entry, args=(backend, free_port(), d, env, kwargs), nprocs=2,
                                 join=False, start_method="spawn")
        end = time.monotonic() + deadline_s
        try:
            while not ctx.join(timeout=1):
                if time.monotonic() > end:
                    error = f"killed after {deadline_s:.0f} s"
                    for p in ctx.processes:
                        if p.is_alive():
                            p.kill()
                    break
        except Exception as e:
            error = f"{type(e).__name__}: {str(e)[-1500:]}"
        records = []
        for rank in (0, 1):
            path = Path(d) / f"rank{rank}.jsonl"
            if path.exists():
                records += [json.loads(line) for line in path.read_text().splitlines() if line]
    return records, error


#: NCCL_DEBUG=INFO lines worth keeping: settings taken from the environment, channel counts.
NCCL_INFO = re.compile(r"set by environment|p2p channels|[Cc]hunk[Ss]ize|NCCL version|"
                       r"Channel 00/.* via ")


# ---------------------------------------------------------------------------------- parent
def peer_copy_gbps(gpu: bool, num_bytes: int, reps: int = 10) -> float:
    """``cuda:1 <- cuda:0`` copy GB/s (bench_transfer's measure); on a CPU a memcpy (labelled
    as such, not a measurement of anything GPU)."""
    if gpu:
        from paged_bench.transfer import p2p_copy_gbps

        gbps = p2p_copy_gbps(num_bytes, reps)
        torch.cuda.empty_cache()
        return gbps
    src = torch.randn(num_bytes // 4)
    dst = torch.empty_like(src)
    return num_bytes / (_time_ms(lambda: dst.copy_(src), src.device, reps) * 1e-3) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                 "transfer_probe.json"))
    p.add_argument("--cpu", action="store_true",
                   help="gloo, tiny pool, Triton in the interpreter (smoke run)")
    p.add_argument("--prompts", default=None, help="default 32768,8192 (CPU: 37,64)")
    p.add_argument("--reps", type=int, default=None, help="default 5 (CPU: 2)")
    p.add_argument("--programs", default=None, help="Triton copy grid sizes, default "
                   "8,16,32,66 (CPU: 2,3)")
    p.add_argument("--env-sets", default=",".join(ENV_SETS),
                   help="V4 NCCL settings to try (names of ENV_SETS, '' for none)")
    p.add_argument("--main-seconds", type=float, default=150)
    p.add_argument("--env-seconds", type=float, default=40)
    p.add_argument("--nccl-debug", action=argparse.BooleanOptionalAction, default=True,
                   help="NCCL_DEBUG=INFO to a file; its settings / channel lines go to the JSON")
    args = p.parse_args(argv)
    gpu = not args.cpu
    if gpu and torch.cuda.device_count() < 2:
        print("needs two CUDA GPUs (or --cpu for the smoke run)")
        return 2
    prompts = [int(x) for x in (args.prompts or ("32768,8192" if gpu else "37,64")).split(",")]
    reps = args.reps or (5 if gpu else 2)
    programs = [int(x) for x in (args.programs or ("8,16,32,66" if gpu else "2,3")).split(",")]
    shape = GPU_SHAPE if gpu else CPU_SHAPE
    row_bytes = shape["block_size"] * shape["num_kv_heads"] * shape["head_dim"] * 2
    payload = {pr: 2 * shape["num_layers"] * blocks_needed(pr, shape["block_size"]) * row_bytes
               for pr in prompts}
    raw_bytes = payload[max(prompts)]
    backend = "nccl" if gpu else "gloo"
    # CPU: messages of two layers (the tiny payload would otherwise be one message).
    chunk_bytes = None if gpu else 2 * payload[max(prompts)] // shape["num_layers"]
    common = dict(gpu=gpu, prompts=prompts, reps=reps, programs=programs, raw_bytes=raw_bytes)
    t_start = time.perf_counter()

    copy_gbps = peer_copy_gbps(gpu, raw_bytes if gpu else 64 << 20)
    print(f"peer copy ({'cuda:0 -> cuda:1' if gpu else 'CPU memcpy'}): {copy_gbps:.0f} GB/s",
          flush=True)
    result = {**environment(), "num_gpus": 2 if gpu else 0, "peer_copy_gbps": copy_gbps,
              "shape": {**{k: v for k, v in shape.items() if k != "dtype"},
                        "dtype": str(shape["dtype"]).replace("torch.", "")},
              "reps": reps, "programs": programs, "results": [], "raw": [],
              "fixed_costs": [], "copy_kernels": [], "profile_v0": {}, "pairs": [],
              "errors": []}
    if not gpu:
        result["gpu"] += " -- smoke run on gloo, not a measurement"

    def debug_env(name):
        if not (args.nccl_debug and gpu):
            return {}
        return {"NCCL_DEBUG": "INFO", "NCCL_DEBUG_SUBSYS": "INIT,ENV,P2P",
                "NCCL_DEBUG_FILE": str(Path(tempfile.gettempdir()) / f"nccl_{name}.%p.txt")}

    pairs = [("main", {}, main_variants(programs, gpu), list(GROUPS) if gpu else [], True,
              args.main_seconds)]
    for name in [n for n in args.env_sets.split(",") if n]:
        pairs.append((f"V4[{name}]", ENV_SETS[name], env_variants(programs), [], False,
                      args.env_seconds))
    for name, env, variants, group_names, first, deadline in pairs:
        t0 = time.perf_counter()
        print(f"--- {name} {env}", flush=True)
        dbg = debug_env(re.sub(r"\W", "_", name))
        records, error = run_pair(backend, {**env, **dbg}, deadline, variants=variants,
                                     group_names=group_names, chunk_bytes=chunk_bytes,
                                     profile=first, kernels=first, **common)
        nccl_info = _collect_nccl_info(dbg)
        result["pairs"].append({"name": name, "env": env, "seconds": time.perf_counter() - t0,
                                "error": error, "nccl_info": nccl_info})
        if error:
            print(f"{name}: {error}", flush=True)
        merge_records(result, records, name, env, first, payload)
        raw_main = [r["gbps"] for r in result["raw"] if r["pair"] == "main"
                    and r["variant"] == "raw_contiguous"]
        result["nccl_sendrecv_gbps"] = raw_main[0] if raw_main else None
        result["seconds"] = time.perf_counter() - t_start
        write_result(result, args.out)
    print_summary(result)
    print(f"wrote {args.out} in {time.perf_counter() - t_start:.0f} s")
    return 0


def merge_records(result: dict, records: list, name: str, env: dict, first: bool,
                  payload: dict) -> None:
    """Add one pair of processes' records to ``result``: rows get GB/s, % of the peer copy
    bandwidth and the ms over this pair's contiguous NCCL send/recv at that bandwidth."""
    copy_gbps = result["peer_copy_gbps"]
    raw = [d["gbps"] for k, d in ((r["kind"], r["data"]) for r in records)
           if k == "raw" and d["variant"] == "raw_contiguous"]
    for rec in records:
        kind, data = rec["kind"], rec["data"]
        if kind == "row":
            pb = payload[data["prompt_tokens"]]
            result["results"].append({
                **data, "variant": data["variant"] if first else f"{name}:{data['variant']}",
                "case": f"P{data['prompt_tokens']}", "pair": name, "env": env,
                "payload_bytes": pb, "gbps": pb / data["ms"] / 1e6,
                "pct_peer_copy_bw": 100 * pb / data["ms"] / 1e6 / copy_gbps,
                "ms_over_raw_contiguous": data["ms"] - pb / raw[0] / 1e6 if raw else None})
        elif kind == "raw":
            result["raw"].append({**data, "pair": name, "env": env,
                                  "pct_peer_copy_bw": 100 * data["gbps"] / copy_gbps})
        elif kind == "fixed_costs":
            result["fixed_costs"].append({**data, "pair": name})
        elif kind == "kernels":
            result["copy_kernels"] = data
        elif kind == "profile":
            result["profile_v0"][f"rank{data['rank']}"] = data
        elif {**data, "pair": name} not in result["errors"]:  # (both ranks may say it)
            result["errors"].append({**data, "pair": name})


def _collect_nccl_info(dbg: dict) -> list[str]:
    """The kept lines of the NCCL_DEBUG files of one pair of processes (then removed)."""
    if not dbg:
        return []
    pattern = Path(dbg["NCCL_DEBUG_FILE"])
    lines = []
    for path in sorted(pattern.parent.glob(pattern.name.replace("%p", "*"))):
        lines += [line.strip()[-220:] for line in path.read_text(errors="replace").splitlines()
                  if NCCL_INFO.search(line)]
        path.unlink()
    return list(dict.fromkeys(lines))[:60]


def print_summary(result: dict) -> None:
    bw = result["peer_copy_gbps"]
    for r in result["raw"]:
        print(f"{r['variant']:28s} {r['pair']:24s} {r['gbps']:7.1f} GB/s "
              f"{r['pct_peer_copy_bw']:5.1f} % of copy")
    for c in result["fixed_costs"]:
        print(f"fixed costs {c['pair']} P{c['prompt_tokens']}: "
              + ", ".join(f"{k} {v:.3f}" for k, v in c.items() if k.endswith("_ms")))
    for r in sorted(result["results"], key=lambda r: (-r["prompt_tokens"], r["ms"])):
        over = r["ms_over_raw_contiguous"]
        over = f"{over:+7.3f} ms over NCCL" if over is not None else ""
        print(f"{r['case']:7s} {r['variant']:52s} {r['ms']:8.3f} ms {r['gbps']:7.1f} GB/s "
              f"{r['pct_peer_copy_bw']:5.1f} % {over}")
    for k in result["copy_kernels"]:
        if "ms" in k:
            print(f"kernel {k['kind']:8s} {k['method']:14s} {k['ms']:7.3f} ms "
                  f"{k['gbps']:7.1f} GB/s ({k['bytes'] >> 20} MiB)")
        else:
            print(f"kernel {k['kind']:8s} {k['method']:14s} {k['error']}")
    for rank, prof in result["profile_v0"].items():
        if "by_class" not in prof:
            print(f"profile {rank}: {prof}")
            continue
        classes = ", ".join(f"{c} {v['total_ms']:.2f} ms x{v['count']}"
                            for c, v in prof["by_class"].items())
        wall = f"{prof['nccl_busy_pct_of_wall']:.0f} % of wall" if prof["wall_ms"] else ""
        print(f"profile {rank}: span {prof['span_ms']:.2f} ms; {classes}; NCCL busy "
              f"{prof['nccl_busy_ms']:.2f} ms = {prof['nccl_busy_pct_of_span']:.0f} % of span "
              f"{wall}; NCCL overlapping copies {prof['nccl_and_copy_overlap_ms']:.2f} ms")
    for e in result["errors"]:
        print("error:", {k: v for k, v in e.items() if k != "trace"})
    print(f"(percentages of the peer copy bandwidth, {bw:.0f} GB/s)")


if __name__ == "__main__":
    sys.exit(main())
