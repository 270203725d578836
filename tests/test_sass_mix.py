"""tools/sass_mix.py compiles a decode kernel for sm_90 with no GPU and reads its machine code.

Run in a subprocess: it compiles for real, so Triton must not be in interpreter mode.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from paged_course import ROOT


def test_bf16_kernel_compiles_for_sm90_and_uses_ldmatrix(tmp_path):
    out = tmp_path / "mix.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    subprocess.run([sys.executable, str(ROOT / "tools" / "sass_mix.py"), "--only", "bf16",
                    "--out", str(out)], check=True, env=env, capture_output=True, timeout=300)
    (row,) = json.loads(out.read_text())["rows"]
    assert row["format"] == "bf16" and 32 <= row["registers"] <= 255
    # 16-bit operands reach the tensor cores through ldmatrix; the products are HMMA.
    assert row["LDSM"] > 0 and row["HMMA"] > 0 and row["LDGSTS"] > 0
    assert row["total"] > sum(row[k] for k in ("LDS", "LDSM", "HMMA"))


def test_committed_mix_shows_fp8_reading_v_byte_by_byte():
    """The lesson's claim, in the committed JSON: the FP8 kernels read shared memory with several
    times the plain loads (LDS) of the bf16 kernel, and about as many ldmatrix as it or fewer."""
    rows = {(r["format"], r["tile"], r["warps"]): r for r in json.loads(
        (ROOT / "results" / "cpu" / "sm90_sass_mix.json").read_text())["rows"]}
    bf16, fp8 = rows[("bf16", 64, 4)], rows[("fp8", 64, 2)]
    assert fp8["LDS"] > 3 * bf16["LDS"] and fp8["LDSM"] < bf16["LDSM"]
