"""Is INT4's ~3.8 TB/s the ceiling of reading its cache, or the kernel's? For each case in
``$CASES``, the bench's INT4 inputs (seed 0, blocks shuffled in memory), timed in turns with
the bench's timer (``ms``: do_bench, 256 MB zeroed before each call) and after a flush that
leaves the L2 clean (``ms_clean_l2``):

* ``kernel``: the INT4 CUDA plan the bench runs (checked against the float64 answer first);
* ``bulk_s{3,4,6}[_x2][_codes]``: ``int4_read_probe.cu``'s read-only kernels on the same
  cache, table and chunks as the plan: a ring of 3, 4 or 6 stages, one block a stage (``x2``:
  two), each block's K and V codes and its four (scale, zero) pieces (``codes``: the codes
  only) as 1-D TMA bulk copies;
* ``flat``: one contiguous buffer of the call's bytes, streamed;
* ``copy``: ``bench_quant.same_bytes_copy`` (half the bytes read, half written).

``FORMATS=fp8`` reads the FP8 cache instead (16 KB blocks of codes, nothing else) with the same
rings, for comparison. Percentages are of the copy bandwidth measured first, counting the
bench's bytes (``bench.bytes_moved``; the ``codes`` rows count what they read). Writes
``$OUT/int4_read_probe.json``.

    OUT=/tmp/out PAGED_REF_CACHE=build/cubins python3 tools/gpu/int4_read_probe.py  # ~90 s

The cubin is compiled with nvcc on first use and cached like the decode kernels' (under
``$PAGED_REF_CACHE``; ``tools/gpu/precompile_cuda.py --read-probe`` builds it off the GPU).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from paged_bench.decode import CASES, SHAPE, bytes_moved
from paged_bench.quant import float64_reference, same_bytes_copy, timed_both_ways
from paged_course.checks import relative_error
from paged_course.results import environment, write_result
from paged_course.testing import make_paged_inputs
from paged_course.timing import copy_bandwidth_gbps
from paged_ref._device import current_stream_handle
from paged_ref.kernels.cuda_fp8 import DEFAULT_STAGES, _function, _launch, plan_cuda

SOURCE = Path(__file__).resolve().with_name("int4_read_probe.cu")
NAMES = os.environ.get("CASES", "B64_L4096,B8_L32768,B1_L131072,B256_L1024,B32_ragged").split(",")
FORMATS = os.environ.get("FORMATS", "int4").split(",")  # (or fp8: its cache, no pieces)
#: (label, kernel, blocks a stage, with the (scale, zero) pieces)
PROBES = [("bulk_s4", "probe_int4_bulk_s4", 1, True), ("bulk_s3", "probe_int4_bulk_s3", 1, True),
          ("bulk_s6", "probe_int4_bulk_s6", 1, True), ("bulk_s3_x2", "probe_int4_bulk_s3", 2, True),
          ("bulk_s4_codes", "probe_int4_bulk_s4", 1, False)]
TILE = 16


class P(ctypes.Structure):
    _fields_ = [(n, ctypes.c_void_p) for n in (
        "k", "v", "pair0", "pair1", "pair2", "pair3", "tables", "seq_lens", "out", "sm_of_cta")] + [
        ("flat_bytes", ctypes.c_longlong)] + [(n, ctypes.c_int) for n in (
            "table_sb", "chunk_len", "block_bytes", "pair_bytes", "blocks_per_stage")]


class BulkCall:
    """One launch of a read-only kernel: its ``args`` (a ``P``), ``grid`` and ``smem``."""

    def __init__(self, fn, grid, smem: int, args: P):
        self.fn, self.grid, self.smem, self.args = fn, grid, smem, args

    def __call__(self) -> None:
        _launch(self.fn, self.grid, 288, self.smem, self.args, current_stream_handle(0))


def bulk_runner(kernel: str, per_stage: int, pairs: bool, inp, chunk_len: int, out):
    """The read-only kernel ``kernel`` over ``inp``'s cache, chunked as the plan is, and the
    bytes it reads."""
    k, v = inp.k_cache, inp.v_cache
    block_bytes = k.data[0].numel()  # codes of one block (all heads)
    pair_bytes = k.scale[0].numel() * k.scale.element_size() if pairs else 0
    pieces = (k.scale, k.zero, v.scale, v.zero) if pairs else ()
    p = P(k.data.data_ptr(), v.data.data_ptr(), *(t.data_ptr() for t in pieces),
          *(0,) * (4 - len(pieces)), inp.block_tables.data_ptr(),
          inp.seq_lens.data_ptr(), out.data_ptr(), None, 0, inp.block_tables.stride(0),
          chunk_len, block_bytes, pair_bytes, per_stage)
    ring = int(kernel[-1])
    smem = ring * per_stage * (2 * block_bytes + 4 * pair_bytes) + 2 * ring * 8
    max_len = int(inp.seq_lens.max())
    grid = ((max_len + chunk_len - 1) // chunk_len, inp.seq_lens.numel(), 1)
    fn = _function(0, kernel, DEFAULT_STAGES, (), SOURCE)
    blocks = int(((inp.seq_lens + TILE - 1) // TILE).sum())
    return BulkCall(fn, grid, smem, p), blocks * (2 * block_bytes + 4 * pair_bytes)


def flat_runner(nbytes: int, out):
    buf = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    p = P(buf.data_ptr(), buf.data_ptr(), 0, 0, 0, 0, 0, 0, out.data_ptr(), None, nbytes, 0, 0, 0,
          0, 0)
    fn = _function(0, "probe_flat", DEFAULT_STAGES, (), SOURCE)
    ctas = 8 * torch.cuda.get_device_properties(0).multi_processor_count

    def run():
        _launch(fn, (ctas, 1, 1), 256, 0, p, current_stream_handle(0))
    run.buffer = buf  # (kept alive with the call)
    return run


def probe_case(name: str, copy_bw: float, fmt: str = "int4") -> list[dict]:
    """Rows for one case: each call of the list above timed both ways, in two turns. ``fmt``
    "fp8": the FP8 cache (16 KB blocks, no pieces), read by the rings without pieces."""
    lens = CASES[name]
    inp = make_paged_inputs(lens, device="cuda", seed=0, **SHAPE).quantized(fmt)
    args, answer = inp.args(), torch.empty_like(inp.q)
    plan = plan_cuda(*args, max_len=max(lens), total_tokens=sum(lens))
    err = relative_error(plan.run(*args, out=answer).float(), float64_reference(inp))
    nbytes = bytes_moved(inp)
    sums = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    calls = {"kernel": ((lambda: plan.run(*args, out=answer)), nbytes)}
    for label, kernel, per_stage, pairs in PROBES:
        if fmt != "int4" and pairs:  # (FP8: the codes are all there is)
            label, pairs = label.replace("_codes", ""), False
        elif fmt != "int4":
            continue
        run, read = bulk_runner(kernel, per_stage, pairs, inp, plan.chunk_len, sums)
        calls[label] = (run, nbytes if pairs or fmt != "int4" else read)
    calls["flat"] = (flat_runner(nbytes, sums), nbytes)
    for call, _ in calls.values():
        call()
    torch.cuda.synchronize()
    copy = same_bytes_copy(nbytes)
    print(name, f"plan: chunk_len {plan.chunk_len}, stages {plan.stages}, err {err:.2e}", copy,
          flush=True)
    rows = []
    for rep in range(2):
        for label, (call, counted) in calls.items():
            row = dict(case=name, kv_format=fmt, probe=label, repeat=rep, bytes=counted,
                       **timed_both_ways(call, counted, copy_bw),
                       chunk_len=plan.chunk_len, kernel_stages=plan.stages, kernel_rel_err=err,
                       **copy)
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
                  flush=True)
            rows.append(row)
    return rows


def main() -> None:
    copy_bw = copy_bandwidth_gbps()
    rows = []
    for name in NAMES:
        for fmt in FORMATS:
            rows += probe_case(name, copy_bw, fmt)
        torch.cuda.empty_cache()
        write_result(dict(environment(), copy_bw_gbps=copy_bw, rows=rows),
                     Path(os.environ.get("OUT", "."), "int4_read_probe.json"))


if __name__ == "__main__":
    main()
