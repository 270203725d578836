"""tools/gpu/ncu_source_summary.py: the per-unit counts and shares it reads from Nsight
Compute's source-page CSV (a made-up one here: no GPU or ncu needed)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parents[1] / "tools" / "gpu"))
import ncu_source_summary as summary  # noqa: E402

HEADER = ['"Address"', '"Source"', '"Warp Stall Sampling (All Samples)"',
          '"Instructions Executed"', '"stall_wait"', '"stall_math"', '"stall_math (Not Issued)"']
ROWS = [  # opcode, samples, executed, wait, math (a predicated one, a blank line)
    ("0x10", "LOP3.LUT R1, R2, 0xf, RZ, 0xc0, !PT", 30, 400, 10, 20),
    ("0x20", "@!P0 SHF.R.U32.HI R3, RZ, 0x8, R4", 10, 200, 10, 0),
    ("0x30", "HMMA.16816.F32 R8, R12, R16, R8", 40, 100, 40, 0),
    ("0x40", "BRA 0x10", 20, 100, 0, 20),
    ("0x50", "", 0, 0, 0, 0),
]


def write_csv(path: Path) -> Path:
    lines = ['"Kernel Name","int4_decode_bf16_d128",', ",".join(HEADER)]
    lines += [",".join(f'"{x}"' for x in (*row, 999)) for row in ROWS]  # (not-issued column)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_opcode_drops_predicates_and_modifiers():
    assert summary.opcode("@!P0 SHF.R.U32.HI R3, RZ, 0x8, R4") == "SHF"
    assert summary.opcode("@UP1 LDGSTS.E [R1], desc[UR4][R2.64]") == "LDGSTS"
    assert summary.opcode("  ") == "?"


def test_counts_per_unit_and_shares(tmp_path):
    text = summary.summarise(str(write_csv(tmp_path / "x.csv")), per=100)
    assert "8.0 warp instructions per unit (800 in all)" in text
    assert "  alu          6.0   40.0 %" in text  # LOP3 + SHF: 600 of 800, 40 of 100 samples
    assert "  tensor       1.0   40.0 %" in text
    assert "  other        1.0   20.0 %" in text  # BRA (and the blank line's nothing)
    assert "  LOP3           4.0   30.0 %" in text
    # stall reasons: issued-or-not columns only (the "(Not Issued)" copy is left out)
    assert "wait 60.0 %, math 40.0 %" in text
