"""Do the CTAs of a one-CTA-per-SM launch land one per SM? A plan of ~128 CTAs for the H200's
132 SMs (FP8 B64_L4096, B8_L32768 and B1_L131072, INT4 B1_L131072) asks for less than half an
SM's shared memory, so the block scheduler may put two CTAs on one SM (and none on another):
that SM then streams twice the bytes and the call lasts ~1.5x as long.

1. ``placement``: ``int4_read_probe.cu``'s read-only kernel on B1_L131072's INT4 cache (128
   CTAs, 74 KB of shared memory each: up to three fit an SM) records the SM of each CTA, after
   a zeroing flush (as the bench times), a clean flush, and back to back; rows give, over
   ``$CALLS`` calls, how often some SM held more than one CTA, and the SMs left idle. The same
   with the shared memory padded past half an SM's (``pad``: one CTA per SM at most).
2. ``timing``: each such plan (``$TIMED``: ``case:format``, comma-separated) as the bench
   runs it, the same plan with its shared memory padded past half an SM's, and (with chunks)
   with its merge launched plainly rather than as a programmatic dependent, timed in turns
   with the bench's timer (``ms``) and after a clean flush (``ms_clean_l2``).

Writes ``$OUT/placement_probe.json`` (``PLACEMENT=0``: the timing only).

    OUT=/tmp/out PAGED_REF_CACHE=build/cubins python3 tools/gpu/placement_probe.py  # ~60 s
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from pathlib import Path

import torch

from paged_bench.decode import CASES, SHAPE, bytes_moved
from paged_bench.quant import float64_reference, timed_both_ways
from paged_course.checks import relative_error
from paged_course.results import environment, write_result
from paged_course.testing import make_paged_inputs
from paged_course.timing import (
    copy_bandwidth_gbps,
    read_flush,
    zero_flush,
)
from paged_ref.kernels.cuda_fp8 import _shared_limit, plan_cuda

spec = importlib.util.spec_from_file_location(
    "int4_read_probe", Path(__file__).with_name("int4_read_probe.py"))
read_probe = importlib.util.module_from_spec(spec)
spec.loader.exec_module(read_probe)

CALLS = int(os.environ.get("CALLS", "40"))
TIMED = [tuple(t.split(":")) for t in os.environ.get(
    "TIMED", "B64_L4096:fp8,B8_L32768:fp8,B1_L131072:fp8,B1_L131072:int4").split(",")]


def one_per_sm() -> int:
    """Dynamic shared memory that leaves no room on an SM for a second CTA."""
    return _shared_limit(0) // 2 + 1024


def placement_rows() -> list[dict]:
    inp = make_paged_inputs(CASES["B1_L131072"], device="cuda", seed=0, **SHAPE).quantized("int4")
    sums = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    for pad in (False, True):
        launch, _ = read_probe.bulk_runner("probe_int4_bulk_s4", 1, True, inp, 1024, sums)
        grid = launch.grid
        where = torch.full((grid[0] * grid[1],), -1, dtype=torch.int32, device="cuda")
        launch.args.sm_of_cta = where.data_ptr()
        if pad:
            launch.smem = max(launch.smem, one_per_sm())
        smem = launch.smem
        for before, flush in (("zero_flush", zero_flush), ("read_flush", read_flush),
                              ("back_to_back", None)):
            doubled = idle = most = 0
            for _ in range(CALLS):
                if flush:
                    flush()
                launch()
                per_sm = torch.bincount(where.long(), minlength=sms)
                doubled += int((per_sm > 1).any())
                idle += int((per_sm == 0).sum())
                most = max(most, int(per_sm.max()))
            row = dict(kernel="probe_int4_bulk_s4", case="B1_L131072", ctas=grid[0] * grid[1],
                       sms=sms, smem=smem, padded=pad, before=before, calls=CALLS,
                       calls_with_a_doubled_sm=doubled, idle_sms_per_call=idle / CALLS,
                       most_ctas_on_one_sm=most)
            print(row, flush=True)
            rows.append(row)
    return rows


def timing_rows(name: str, fmt: str, copy_bw: float) -> list[dict]:
    """One case's plan as planned and padded to one CTA per SM, checked, then timed."""
    lens = CASES[name]
    inp = make_paged_inputs(lens, device="cuda", seed=0, **SHAPE).quantized(fmt)
    args, out = inp.args(), torch.empty_like(inp.q)
    plan = plan_cuda(*args, max_len=max(lens), total_tokens=sum(lens))
    variants = [("as planned", plan),
                ("one per SM", dataclasses.replace(plan, smem=max(plan.smem, one_per_sm())))]
    if plan.merge is not None:
        variants.append(("merge launched plainly",
                         dataclasses.replace(plan, dependent_merge=False)))
    ref, nbytes = float64_reference(inp), bytes_moved(inp)
    calls = {}
    for label, pl in variants:
        err = relative_error(pl.run(*args, out=out).float(), ref)
        calls[label] = (lambda pl=pl: pl.run(*args, out=out), err, pl.smem)
    rows = []
    for rep in range(3):
        for label, (call, err, smem) in calls.items():
            row = dict(case=name, kv_format=fmt, launch=label, repeat=rep, smem=smem,
                       ctas=plan.grid[0] * plan.grid[1] * plan.grid[2], stages=plan.stages,
                       chunk_len=plan.chunk_len, rel_err=err, bytes=nbytes,
                       **timed_both_ways(call, nbytes, copy_bw))
            print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()},
                  flush=True)
            rows.append(row)
    return rows


def main() -> None:
    copy_bw = copy_bandwidth_gbps()
    placed = placement_rows() if os.environ.get("PLACEMENT", "1") == "1" else []
    result = dict(environment(), copy_bw_gbps=copy_bw, placement=placed)
    result["timing"] = []
    for name, fmt in TIMED:
        result["timing"] += timing_rows(name, fmt, copy_bw)
        torch.cuda.empty_cache()
    write_result(result, Path(os.environ.get("OUT", "."), "placement_probe.json"))


if __name__ == "__main__":
    main()
