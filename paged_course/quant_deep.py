"""Readers of lesson 10's deep dives: the numbers 10a, 10b and 10c print, from the committed
study files (``results/h200/<name>.json``, one a deep dive, each part stamped with the GPU, date
and commit of the probe that measured it).

    part = study_part("fp8_triton_study", "kv_halves")   # one part: its stamp and its rows
    best_by(part["rows"], "label")                        # the fastest row of each label

Every function takes the parsed part (a dict) so that a test can hand it a planted one.
"""

from __future__ import annotations

import json
from pathlib import Path

from paged_course import ROOT

STUDIES = ("fp8_triton_study", "cuda_kernels_study", "short_calls_study")
#: The quant suite's cases with enough work to be bandwidth-bound (as paged_bench.quant).
LARGE_CASES = ("B64_L4096", "B8_L32768", "B1_L131072", "B256_L1024", "B32_ragged")


def load_study(name: str, root: Path = ROOT) -> dict:
    """``results/h200/<name>.json``: ``{"what", "gpu", "date", "commit", "parts": {...}}``.

    Raises:
        ValueError: ``name`` is not one of :data:`STUDIES`.
    """
    if name not in STUDIES:
        raise ValueError(f"name must be one of {STUDIES}, got {name!r}")
    return json.loads((root / "results" / "h200" / f"{name}.json").read_text())


def study_part(name: str, part: str, root: Path = ROOT) -> dict:
    """One part of a study file (its stamp, ``what``, ``source`` and rows).

    Raises:
        KeyError: the study has no such part (the message lists the parts it has).
    """
    parts = load_study(name, root)["parts"]
    if part not in parts:
        raise KeyError(f"{name} has no part {part!r}; it has {sorted(parts)}")
    return parts[part]


def stamp(part: dict) -> str:
    """``"NVIDIA H200, 2026-12-01, commit abc1234"``: what a printed table is labelled with."""
    return f"{part['gpu']}, {part['date']}, commit {part['commit']}"


def best_by(rows: list[dict], *keys: str, value: str = "ms") -> dict:
    """The fastest row (least ``value``, rows without one skipped) of each distinct ``keys``
    tuple (a single key gives plain keys), in first-seen order."""
    best: dict = {}
    for r in rows:
        if r.get(value) is None or r.get("status", "ok") != "ok":
            continue
        key = tuple(r.get(k) for k in keys) if len(keys) > 1 else r.get(keys[0])
        if key not in best or r[value] < best[key][value]:
            best[key] = r
    return best


# ---- 10a: the Triton kernels ---------------------------------------------------------------

def read_row_summary(part: dict) -> dict[str, dict]:
    """Read-only Triton kernels: per format, the best ``% of copy bandwidth`` with one KV head
    a row (``per_head``, its ``row_bytes``) and with all heads of a token in one row."""
    out = {}
    for fmt in ("bf16", "fp8", "int4"):
        rows = [r for r in part["rows"] if r["label"].startswith(f"read {fmt} ")]
        per_head = max((r for r in rows if r["heads_per_row"] == 1),
                       key=lambda r: r["pct_copy_bw"])
        all_heads = max((r for r in rows if r["heads_per_row"] > 1),
                        key=lambda r: r["pct_copy_bw"])
        out[fmt] = {"row_bytes": per_head["row_bytes"], "per_head": per_head["pct_copy_bw"],
                    "all_heads": all_heads["pct_copy_bw"]}
    return out


PV_NAMES = {"dot": "V to float16, tl.dot (the library's)",
            "bits": "V to float16 by integer ops, tl.dot", "fp8": "p to e4m3, e4m3 tl.dot",
            "fp8_t": "e4m3 product, transposed (V^T p^T)",
            "dot_t": "float16 product, transposed", "fma": "no tensor cores (FMA)"}


def pv_path_best(*parts: dict) -> list[dict]:
    """The fastest launch config of each ``p @ V`` path and V layout over ``parts`` (the paths
    and their launch-shape sweep), fastest first: ``{"path", "v_layout", "ms", "pct", "label"}``."""
    rows = [r for p in parts for r in p["rows"]]
    best = best_by(rows, "pv", "v_layout")
    out = [{"path": PV_NAMES[pv], "v_layout": "transposed" if lay == "dT" else "token-major",
            "ms": r["ms"], "pct": r["pct_copy_bw"], "label": r["label"]}
           for (pv, lay), r in best.items()]
    return sorted(out, key=lambda r: r["ms"])


def regs_summary(part: dict, fmt: str) -> dict:
    """The register sweep for ``fmt`` on B64_L4096: the best row with no cap, the best with
    at most 128 registers, and the best with head-major blocks."""
    rows = [r for r in part["rows"] if r["fmt"] == fmt]

    def best(**want):
        got = [r for r in rows if all(r.get(k) == v for k, v in want.items())]
        return min(got, key=lambda r: r["ms"])

    return {"free": best(layout="tok", maxnreg=None), "capped": best(layout="tok", maxnreg=128),
            "head_major": best(layout="head")}


def prefetch_summary(regs: dict, prefetch: dict) -> dict[str, dict]:
    """Per format: the best ``% of copy bandwidth`` through Triton's pipeline (bf16: the
    prefetch study's own row; FP8 / INT4: the register sweep's best) and with the kernel's
    register prefetch."""
    out = {}
    for fmt in ("bf16", "fp8", "int4"):
        piped = [r for r in (prefetch if fmt == "bf16" else regs)["rows"]
                 if r["fmt"] == fmt and r["layout"] == "tok" and not r["prefetch"]]
        fetched = [r for r in prefetch["rows"]
                   if r["fmt"] == fmt and r["layout"] == "tok" and r["prefetch"]]
        out[fmt] = {"pipeline": min(piped, key=lambda r: r["ms"])["pct_copy_bw"],
                    "prefetch": min(fetched, key=lambda r: r["ms"])["pct_copy_bw"]}
    return out


def split_summary(part: dict) -> dict[str, dict[int, float]]:
    """Per format, per chunk count: the best ms over launch configs."""
    out: dict[str, dict[int, float]] = {}
    for r in part["rows"]:
        got = out.setdefault(r["format"], {})
        got[r["chunks"]] = min(got.get(r["chunks"], r["ms"]), r["ms"])
    return {f: dict(sorted(c.items())) for f, c in out.items()}


# ---- 10b: the CUDA kernels -----------------------------------------------------------------

def design_steps(part: dict, case: str = "B64_L4096") -> list[dict]:
    """Each design step of the CUDA kernels: its label, date, commit, and the FP8 / INT4 best
    ms and % of copy bandwidth on ``case`` (None where that step's run has no such row)."""
    return [{"label": s["label"], "date": s["date"], "commit": s["commit"],
             **{f"{fmt} {k}": s.get(f"{case} {fmt} {key}") for fmt in ("fp8", "int4")
                for k, key in (("ms", "ms"), ("pct", "pct_copy_bw"))}}
            for s in part["rows"]]


def ab_change(part: dict, old: str, new: str, kv_format: str = "int4") -> dict[str, dict]:
    """An A/B of one GPU call: per case, the best ms of source ``old`` and ``new`` (over the
    turns) and the change in %."""
    best = best_by([r for r in part["rows"] if r["kv_format"] == kv_format], "case", "source")
    out = {}
    for case in dict.fromkeys(r["case"] for r in part["rows"]):
        if (case, old) in best and (case, new) in best:
            a, b = best[case, old]["ms"], best[case, new]["ms"]
            out[case] = {"old": a, "new": b, "change_pct": 100 * (b / a - 1)}
    return out


def launch_sweep(part: dict, case: str, kv_format: str) -> list[dict]:
    """The CUDA rows of the launch sweep for one case and format, fastest first."""
    return sorted((r for r in part["rows"] if r["case"] == case and r["kv_format"] == kv_format
                   and r["label"].startswith("cuda")), key=lambda r: r["ms"])


def copy_path_rows(part: dict) -> list[dict]:
    """The read-only copy paths: ``layout`` (padded / swizzled / TMA tile / flat), ``hint``
    (the L2 prefetch hint or ``-``), CTA shape and % of copy bandwidth (L2 flushed)."""
    out = []
    for r in part["rows"]:
        k = r["kernel"]
        layout = ("flat" if "flat" in k else "TMA tile" if "bulk" in k
                  else "swizzled" if "swz" in k else "padded")
        out.append({"layout": layout, "hint": "L2::256B" if "pf256" in k else "-",
                    "heads": r["hpc"], "warps": r["wph"], "chunk": r["chunk_len"],
                    "ms": r["ms_l2_flushed"], "pct": r["pct_copy_bw_flushed"]})
    return out


# ---- 10c: measuring short calls ------------------------------------------------------------

def family(row: dict) -> str:
    """Whose kernel a quant-suite row timed: ``"Triton"``, ``"CUDA"`` or ``"FlashInfer"``."""
    if row["backend"] == "flashinfer":
        return "FlashInfer"
    return "CUDA" if row["backend"].startswith("cuda_") else "Triton"


def flush_bias(part: dict, picked=(("Triton", "bf16"), ("CUDA", "fp8"), ("CUDA", "int4"),
                                   ("FlashInfer", "fp8"))) -> list[dict]:
    """Per large case and picked (family, format): ms after do_bench's zeroing flush and after
    a reading one (clean L2), the write-back the zeroing flush billed (µs), both shares of copy
    bandwidth, and a copy of the same bytes timed both ways."""
    out = []
    for case in LARGE_CASES:
        for fam, fmt in picked:
            r = next((r for r in part["rows"] if r["case"] == case and r["kv_format"] == fmt
                      and family(r) == fam), None)
            if r is None:
                continue
            out.append({"case": case, "kernel": f"{fam} {fmt}", "mb": r["bytes"] / 1e6,
                        "ms": r["ms"], "ms_clean": r["ms_clean_l2"],
                        "billed_us": 1000 * (r["ms"] - r["ms_clean_l2"]),
                        "pct": r["pct_copy_bw"], "pct_clean": r["pct_copy_bw_clean_l2"],
                        "copy_billed_us": 1000 * (r["copy_ms"] - r["copy_ms_clean_l2"])})
    return out


def fit_fixed_cost(rows: list[dict], copy_bw_gbps: float) -> dict:
    """Least-squares line through (bytes, ms) of one format's rows: the fixed cost a call (µs,
    the intercept) and the streaming rate (% of copy bandwidth, from the slope).

    Raises:
        ValueError: fewer than two rows, or all of one size (no line to fit).
    """
    xs, ys = [r["bytes"] for r in rows], [r["ms"] for r in rows]
    if len(set(xs)) < 2:
        raise ValueError(f"need rows of at least two sizes to fit a line, got sizes {xs}")
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)
    fixed_ms = my - slope * mx
    return {"fixed_us": 1000 * fixed_ms,
            "streaming_pct_copy_bw": 100 * (1e-6 / slope) / copy_bw_gbps, "points": n}


def ceiling_rows(copy_part: dict, ab_part: dict, kv_formats=("fp8", "int4")) -> list[dict]:
    """Per large case and format: the bytes, a plain copy of them (ms, % of copy bandwidth)
    and the CUDA kernel timed in the same GPU call (``ab_part``'s ``new`` rows, best turn),
    with the copy's time as a share of the kernel's (100 %: as fast as a copy)."""
    best = best_by(ab_part["rows"], "case", "kv_format", "source")
    out = []
    for r in copy_part["rows"]:
        if r["kv_format"] not in kv_formats:
            continue
        k = best.get((r["case"], r["kv_format"], "new"))
        out.append({"case": r["case"], "kv_format": r["kv_format"], "mb": r["bytes"] / 1e6,
                    "copy_ms": r["copy_ms"], "copy_pct": r["copy_pct_copy_bw"],
                    "kernel_ms": k["ms"] if k else None,
                    "kernel_vs_copy_pct": 100 * r["copy_ms"] / k["ms"] if k else None})
    return out
