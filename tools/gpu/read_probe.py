"""How fast can the H200 read a paged FP8 cache through a block table, by each way of copying?

Runs the kernels of ``read_probe.cu`` (no attention: only the reads, see its header) on
B64_L4096's FP8 cache (64 sequences x 4096 tokens, 8 KV heads, head_dim 128, blocks of 16
shuffled in memory: 537 MB of K and V), and prints / writes (``$OUT/read_probe.json``) for each
kernel and launch shape the median time with the L2 flushed before each call
(``paged_course.timing.time_ms``, the bench's timer) and back to back, as a fraction of
copy bandwidth. (The committed ``benchmarks/h200/read_probe.json`` was timed by an earlier
loop of this script that flushed the same way: zeroing 256 MB before each call.)

    PAGED_REF_CACHE=build/cubins python3 tools/gpu/read_probe.py          # time
    ncu --kernel-name regex:probe_ --metrics ... python3 tools/gpu/read_probe.py --once

The cubin is compiled with nvcc on first use and cached like the decode kernels' (under
``$PAGED_REF_CACHE``; ``tools/gpu/precompile_cuda.py --read-probe`` builds it off the GPU).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from pathlib import Path

import torch

from paged_ref.kernels.cuda_fp8 import DEFAULT_STAGES, _function, _launch

SOURCE = Path(__file__).resolve().with_name("read_probe.cu")
B, L, HEADS, D, BLOCK = 64, 4096, 8, 128, 16


class P(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in ("k", "v", "tables", "out")] + [
        ("flat_bytes", ctypes.c_longlong)] + [(n, ctypes.c_int) for n in (
            "table_sb", "chunk_len", "seq_len", "hpc", "wph")]


# (kernel, heads per CTA, warps per head, chunk_len): the warp kernels' grid is
# (HEADS / hpc, chunks, B); the bulk kernels' (chunks, B) with all 8 heads and a producer warp.
SHAPES = [
    ("probe_cpasync_pf256", 2, 4, 4096), ("probe_cpasync_pf0", 2, 4, 4096),
    ("probe_cpasync_pf256", 8, 1, 1024), ("probe_cpasync_pf256", 1, 8, 2048),
    ("probe_cpasync_swz_pf256", 2, 4, 4096), ("probe_cpasync_swz_pf0", 2, 4, 4096),
    ("probe_cpasync_swz_pf256", 8, 1, 1024), ("probe_cpasync_swz_pf0", 8, 1, 1024),
    ("probe_ldg", 2, 4, 4096), ("probe_ldg", 8, 1, 1024),
    ("probe_bulk_rows_s3", 8, 1, 1024), ("probe_bulk_rows_s3", 8, 1, 512),
    ("probe_bulk_rows_s6", 8, 1, 2048), ("probe_bulk_rows_s6", 8, 1, 1024),
    ("probe_bulk_tile_s3", 8, 1, 1024), ("probe_bulk_tile_s6", 8, 1, 2048),
    ("probe_flat", 0, 0, 0),
]


def launcher(kernel: str, hpc: int, wph: int, chunk: int, bufs: dict):
    k, v, tables, out = bufs["k"], bufs["v"], bufs["tables"], bufs["out"]
    p = P(k.data_ptr(), v.data_ptr(), tables.data_ptr(), out.data_ptr(), k.numel(),
          tables.stride(0), chunk or L, L, hpc or 1, wph or 1)
    if kernel == "probe_flat":
        grid, threads, smem = (132 * 8, 1, 1), 256, 0
    elif kernel.startswith("probe_bulk"):
        stages = int(kernel[-1])
        row = HEADS * D + (16 if "rows" in kernel else 0)
        grid, threads = (L // chunk, B, 1), 32 * (HEADS + 1)
        smem = stages * 2 * BLOCK * row + 2 * stages * 8
    else:
        grid, threads = (HEADS // hpc, L // chunk, B), 32 * hpc * wph
        smem = hpc * wph * 3 * 2 * BLOCK * (D + (0 if "swz" in kernel else 16))
    fn = _function(0, kernel, DEFAULT_STAGES, (), SOURCE)  # (all the shared memory allowed)

    def run():
        _launch(fn, grid, threads, smem, p, torch.cuda.current_stream().cuda_stream)
    return run


def main() -> int:
    once = "--once" in sys.argv
    torch.manual_seed(0)
    num_blocks = B * L // BLOCK
    bufs = {
        "k": torch.randint(0, 256, (num_blocks, BLOCK, HEADS, D), dtype=torch.uint8, device="cuda"),
        "v": torch.randint(0, 256, (num_blocks, BLOCK, HEADS, D), dtype=torch.uint8, device="cuda"),
        "tables": torch.randperm(num_blocks, device="cuda", dtype=torch.int32).view(B, -1),
        "out": torch.zeros(1 << 16, dtype=torch.int32, device="cuda"),
    }
    nbytes = 2 * bufs["k"].numel()
    from paged_course.timing import copy_bandwidth_gbps, events_ms, time_ms, warm_up_gpu

    rows = []
    if not once:
        warm_up_gpu()
        copy_bw = copy_bandwidth_gbps()
    only = os.environ.get("PROBES")  # a comma-separated subset of the kernels
    for kernel, hpc, wph, chunk in SHAPES:
        if only and kernel not in only.split(","):
            continue
        run = launcher(kernel, hpc, wph, chunk, bufs)
        run()
        torch.cuda.synchronize()
        if once:
            continue
        cold = time_ms(run)  # (the bench's timer: the L2 flushed before each call)
        warm = events_ms(run, reps=60, warmup=0)  # back to back
        row = {"kernel": kernel, "hpc": hpc, "wph": wph, "chunk_len": chunk,
               "ms_l2_flushed": round(cold, 4), "ms_back_to_back": round(warm, 4),
               "pct_copy_bw_flushed": round(100 * nbytes / cold / 1e6 / copy_bw, 1),
               "pct_copy_bw_back_to_back": round(100 * nbytes / warm / 1e6 / copy_bw, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if once:
        return 0
    result = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "cuda": torch.version.cuda, "copy_bw_gbps": round(copy_bw, 1), "bytes": nbytes,
              "rows": rows}
    out = Path(os.environ.get("OUT", ".")) / "read_probe.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
