"""Where a kernel's instructions and stalls go, from Nsight Compute's source page (SASS), on
any machine: warp instructions executed per unit of work (e.g. per 16-token tile) and the
share of warp-state samples, by opcode and by pipe, and the stall reasons overall. Make the
CSV on the GPU machine:

    ncu --kernel-name regex:int4_decode --launch-skip 3 --launch-count 1 --clock-control none \\
        --section SourceCounters --section WarpStateStats -o /tmp/int4 \\
        python3 tools/gpu/cuda_fp8_ncu.py int4
    ncu --import /tmp/int4.ncu-rep --page source --csv --print-source sass > int4_sass.csv

then ``python tools/gpu/ncu_source_summary.py int4_sass.csv --per 131072`` (B64_L4096 has
64 x 8 x 256 tiles of 16 tokens).
"""

from __future__ import annotations

import argparse
import collections
import csv
import re

#: Hopper's pipes for the opcodes these kernels use (integer/logic ALU at half rate, FMA, ...);
#: the rest (branches, conversions such as F2FP, barriers) are counted as "other"
PIPES = {
    "alu": {"LOP3", "SHF", "IADD3", "ISETP", "PRMT", "MOV", "LEA", "FSETP", "SEL", "FMNMX",
            "PLOP3", "FSEL", "VOTE", "IABS"},
    "fma": {"IMAD", "FFMA", "FMUL", "FADD", "HADD2", "HMUL2", "HFMA2", "VIADD"},
    "tensor": {"HMMA", "IMMA"},
    "xu": {"MUFU"},
    "memory": {"LDS", "LDG", "STG", "STS", "LDGSTS", "SHFL", "MOVM", "LDC", "LDSM"},
}


def opcode(source: str) -> str:
    text = re.sub(r"^@!?U?P\w+\s+", "", source.strip())  # drop a predicate
    return text.split()[0].split(".")[0] if text else "?"


def summarise(path: str, per: float) -> str:
    rows = list(csv.reader(open(path)))
    header, data = rows[1], rows[2:]
    col = {h: i for i, h in enumerate(header)}

    def number(row, name):
        text = row[col[name]].replace(",", "")
        return float(text) if text else 0.0

    executed, samples = collections.Counter(), collections.Counter()
    stalls = collections.Counter()
    stall_cols = [h for h in header if h.startswith("stall_") and "Not Issued" not in h]
    for row in data:
        op = opcode(row[col["Source"]])
        executed[op] += number(row, "Instructions Executed")
        samples[op] += number(row, "Warp Stall Sampling (All Samples)")
        for h in stall_cols:
            stalls[h[len("stall_"):]] += number(row, h)
    total, total_samples = sum(executed.values()), sum(samples.values()) or 1
    lines = [f"{path}: {total / per:.1f} warp instructions per unit ({total:.0f} in all)",
             "", "by pipe (instructions per unit, share of samples):"]
    groups = {**PIPES, "other": set(executed) - set().union(*PIPES.values())}
    for pipe, ops in groups.items():
        n = sum(executed[o] for o in ops)
        s = sum(samples[o] for o in ops)
        lines.append(f"  {pipe:8s} {n / per:7.1f}  {100 * s / total_samples:5.1f} %")
    lines += ["", "by opcode:"]
    for op, n in executed.most_common(25):
        lines.append(f"  {op:10s} {n / per:7.1f}  {100 * samples[op] / total_samples:5.1f} %")
    lines += ["", "stall reasons (share of samples): " + ", ".join(
        f"{k} {100 * v / total_samples:.1f} %" for k, v in stalls.most_common(8))]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="+")
    parser.add_argument("--per", type=float, default=1.0, help="units of work in the launch")
    args = parser.parse_args()
    print("\n\n".join(summarise(p, args.per) for p in args.csv))


if __name__ == "__main__":
    main()
