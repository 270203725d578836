"""What a plain device-to-device copy reaches at each bench case's byte count, timed as the
bench times (``time_ms``: the median of do_bench with its 256 MB L2 flush before each call):
the ceiling that any kernel reading that many bytes meets, next to the copy bandwidth (a 2 GB
copy) that the bench's shares are of. A copy of N / 2 bytes moves N (read + written). For each
large case and format: the bytes the decode kernel reads, the copy's ms and its share of copy
bandwidth, and the same after a flush that leaves the L2 clean (``copy_ms_clean_l2``: the
floor for the bench's ``ms_clean_l2``). Writes ``$OUT/size_floor_probe.json``.

    OUT=/tmp/out PYTHONPATH=$PWD python3 tools/gpu/size_floor_probe.py     # about 20 s
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from paged_bench.decode import CASES, SHAPE, bytes_moved
from paged_bench.quant import LARGE_CASES, same_bytes_copy
from paged_course.results import environment, write_result
from paged_course.testing import make_paged_inputs
from paged_course.timing import copy_bandwidth_gbps, gbps

FORMATS = ("bf16", "fp8", "fp8_token_head", "int4")


def copy_share(nbytes: int, copy_bw: float) -> dict:
    """A copy that moves ``nbytes`` (half read, half written): its ms (the bench's timer, and
    after a flush that leaves the L2 clean) and their shares of copy_bw."""
    times = same_bytes_copy(nbytes)
    return dict(**times, copy_pct_copy_bw=100 * gbps(nbytes, times["copy_ms"]) / copy_bw,
                copy_pct_copy_bw_clean_l2=100 * gbps(nbytes, times["copy_ms_clean_l2"]) / copy_bw)


def main() -> None:
    copy_bw = copy_bandwidth_gbps()
    rows = []
    for name in LARGE_CASES:
        lens = CASES[name]
        plain = make_paged_inputs(lens, device="cuda", seed=0, **SHAPE)
        for fmt in FORMATS:
            inp = plain if fmt == "bf16" else plain.quantized(fmt)
            nbytes = bytes_moved(inp)
            row = dict(case=name, kv_format=fmt, bytes=nbytes, **copy_share(nbytes, copy_bw))
            print(row, flush=True)
            rows.append(row)
            del inp
        del plain
        torch.cuda.empty_cache()
    write_result(dict(environment(), copy_bw_gbps=copy_bw, rows=rows),
                 Path(os.environ.get("OUT", "."), "size_floor_probe.json"))


if __name__ == "__main__":
    main()
