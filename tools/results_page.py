"""Write ``results/README.md``, the results page: one table per suite, read from the committed
JSON files (so the page and the files cannot disagree), and an index of every file.

    python tools/results_page.py            # rewrite results/README.md
    python tools/results_page.py --check    # exit 1 if it is stale (tests/repo runs this)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "results"
PAGE = RESULTS / "README.md"

#: One line per file: what it holds and who reads it (every file under results/ is listed).
FILES = {
    "h200/decode.json": "decode suite (04-08)",
    "h200/decode.png": "plot of decode.json",
    "h200/decode_gather.json": "decode, torch gather rows (03)",
    "h200/decode_launch_path.json": "decode, GPU-side checks (06)",
    "h200/launch_path.json": "host µs in a Triton launch (06)",
    "h200/host_path.json": "planned call vs FlashInfer, B4 (06)",
    "h200/page_size.json": "block sizes 1-256 on B64_L4096 (06)",
    "h200/chunks.json": "split-KV chunk counts (05)",
    "h200/tune_configs.json": "Triton tile sweep (05)",
    "h200/prefill.json": "prefill suite (08)",
    "h200/prefill_quant.json": "prefill, FP8 / INT4 caches (10)",
    "h200/quant.json": "decode, FP8 / INT4 caches (10)",
    "h200/quant.png": "plot of quant.json",
    "h200/engine.json": "engine suite (09)",
    "h200/engine.png": "plot of engine.json",
    "h200/engine_multistep.json": "multi-step engine (09)",
    "h200/engine_smollm2_real.json": "engine, SmolLM2's real weights (09)",
    "h200/engine_smollm2_same_machine.json": "real vs random weights (09)",
    "h200/engine_formats.json": "engine per cache format (10)",
    "h200/format_step.json": "decode step per format (10)",
    "h200/quant_smollm2_bf16_auto.json": "SmolLM2 perplexity by format (10)",
    "h200/quant_smollm2_bf16_torch.json": "the same, torch (10)",
    "h200/quant_lm_layer_error.json": "error on SmolLM2's q/K/V (10)",
    "h200/offload.json": "host copy vs recompute (07)",
    "h200/fp8_triton_study.json": "why Triton FP8 / INT4 is not 2x (10a)",
    "h200/cuda_kernels_study.json": "CUDA kernels' design steps (10b)",
    "h200/short_calls_study.json": "timing short calls (10c)",
    "h200/serving.json": "latency vs request rate per policy (12)",
    "h200/serving.png": "plot of serving.json",
    "h200/warmup.json": "first vs second generate (09)",
    "h200/suite.log": "the suite on the H200",
    "h100/suite.log": "the whole suite on an H100, three shards (3,017 passed, 1 failed)",
    "h200x2/transfer.json": "KV blocks across two H200s (11)",
    "cpu/sharing.json": "sharing savings, simulated (07)",
    "cpu/sharing_engine.json": "measured in the engine (07)",
    "cpu/scheduling.json": "prefix-aware vs FCFS (12)",
    "cpu/quant_accuracy.json": "error per KV format (10)",
    "cpu/quant_smollm2.json": "SmolLM2 float32 per format (10)",
    "cpu/quant_smollm2_noise.json": "perplexity under noise (10)",
    "cpu/sm90_sass_mix.json": "SASS mix, sm_90 (10a)",
}
#: Listed once its GPU run is committed (``python -m paged_bench tiers`` on the H200).
TIERS = "h200/tiers.json"
if (RESULTS / TIERS).exists():
    FILES[TIERS] = "disk vs host vs recompute (09)"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def stamp(d: dict) -> str:
    versions = ", ".join(f"{k} {d[k]}" for k in ("torch", "triton", "flashinfer") if d.get(k))
    return f"*{d['gpu']}, {d['date']}, commit `{d.get('commit', '?')}`; {versions}.*"


def best(rows, case, backend):
    rows = [r for r in rows if r["case"] == case and r["backend"] == backend and not r.get("sweep")]
    return min(rows, key=lambda r: r["ms"]) if rows else None


def table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def cases_of(rows) -> list[str]:
    return list(dict.fromkeys(r["case"] for r in rows))


def decode_section() -> str:
    d = load("h200/decode.json")
    cols = ["auto", "auto_planned", "auto_graph", "sdpa_contiguous", "flashinfer"]
    older = d.get("rows_from_an_earlier_run")
    rows = []
    for case in cases_of(d["results"]):
        cells = []
        for b in cols:
            r = best(d["results"], case, b)
            cells.append("-" if r is None else f"{r['ms']:.4f} ({r['pct_copy_bw']:.0f} %)")
        rows.append([case, *cells])
    return (f"## Decode (`python -m paged_bench decode`)\n\n{stamp(d)} ms and % of copy bandwidth "
            f"({d['copy_bw_gbps']:.0f} GB/s). `auto`: the public call without a plan (checks "
            "included); `auto_planned`: with `plan_decode`; `auto_graph`: replayed from a CUDA "
            "graph; the peers on the same inputs." + (f" Note: {older}." if older else "")
            + "\n\n" + table(["case", *cols], rows))


def prefill_section() -> str:
    d = load("h200/prefill.json")
    cols = [b for b in ("auto", "auto_planned", "triton", "flashinfer", "sdpa_contiguous")
            if any(r["backend"] == b for r in d["results"])]  # (columns with a row)
    rows = []
    for case in cases_of(d["results"]):
        found = [best(d["results"], case, b) for b in cols]
        if not any(r and r.get("tflops") for r in found):
            continue
        rows.append([case, *("-" if r is None or not r.get("tflops") else f"{r['tflops']:.0f}"
                             for r in found)])
    return (f"## Prefill (`python -m paged_bench prefill`)\n\n{stamp(d)} TFLOP/s (causal FLOPs "
            f"counted exactly; dense bf16 matmul {d['matmul_tflops']:.0f}).\n\n"
            + table(["case", *cols], rows))


def quant_section() -> str:
    d = load("h200/quant.json")
    fams = [("bf16", "triton"), ("fp8", "triton"), ("fp8", "cuda"), ("int4", "triton"),
            ("int4", "cuda"), ("fp8", "flashinfer")]
    rows = []
    for case in cases_of(d["results"]):
        cells = []
        for fmt, who in fams:
            got = [r for r in d["results"] if r["case"] == case
                   and r.get("kv_format", "bf16") == fmt and r["backend"].startswith(who)
                   and not r.get("sweep")]
            cells.append(f"{min(r['ms'] for r in got):.4f}" if got else "-")
        rows.append([case, *cells])
    return (f"## Quantised caches (`python -m paged_bench quant`)\n\n{stamp(d)} ms per call, "
            "best row of each family.\n\n"
            + table(["case", *(f"{f} {w}" for f, w in fams)], rows))


def engine_section() -> str:
    d = load("h200/engine.json")
    rows = [[t["shape"], f"{t['engine']['output_tok_s']:,.0f}",
             f"{t['generate_batch']['output_tok_s']:,.0f}" if t.get("generate_batch") else "-",
             f"{t['static_generate']['output_tok_s']:,.0f}" if t.get("static_generate") else "-",
             f"{t['engine']['mean_ttft_s']:.2f}"] for t in d["throughput"]]
    steps = [[s["shape"], str(s["batch"]), f"{s['graph_ms']:.2f}", f"{s['roofline_ms']:.2f}",
              f"{s['x_roofline_graph']:.2f}"] for s in d["decode_step"] if s.get("graph_ms")]
    return (f"## Engine (`python -m paged_bench engine`)\n\n{stamp(d)} {d['num_requests']} "
            f"requests x {d['output_len']} new tokens, random bf16 weights; output tok/s.\n\n"
            + table(["shape", "engine", "generate_batch", "static batches", "engine TTFT s"],
                    rows) + busy_line()
            + "\n\nA decode step replayed from its CUDA graph vs its roofline (weights + KV "
              "at copy bandwidth):\n\n"
            + table(["shape", "batch", "ms", "roofline ms", "x roofline"], steps))


def busy_line() -> str:
    """The multi-step engine per ``max_num_batched_tokens`` and ``num_scheduler_steps``
    (h200/engine_multistep.json, one run): output tok/s, and wall / GPU busy where measured."""
    d = load("h200/engine_multistep.json")
    runs = [e for k, e in d["throughput"][0].items() if k.startswith("engine")
            and isinstance(e, dict)]
    measured = all(e.get("wall_over_gpu_busy") is not None for e in runs)
    parts = []
    for m in dict.fromkeys(e["max_num_batched_tokens"] for e in runs):
        mine = [e for e in runs if e["max_num_batched_tokens"] == m]
        parts.append("**" + "/".join(f"{e['output_tok_s']:,.0f}" for e in mine) + f"** ({m:,})"
                     + (", wall / busy " + "/".join(f"{e['wall_over_gpu_busy']:.2f}x"
                                                   for e in mine) if measured else ""))
    steps = "/".join(dict.fromkeys(str(e["num_scheduler_steps"]) for e in runs))
    return (f"\n\nMulti-step engine ({d['gpu'].split()[1]}, {d['date']}, `{d['commit']}`, cold "
            f"prefix cache), tok/s at `num_scheduler_steps` {steps} (tokens a step): "
            + "; ".join(parts) + "." + ("" if measured else
                                        " Wall / GPU busy: not measured (the JSON's note)."))


def serving_section() -> str:
    d = load("h200/serving.json")
    policies = list(dict.fromkeys(r["policy"] for r in d["results"]))
    rows = []
    for model, dataset in dict.fromkeys((r["model"], r["dataset"]) for r in d["results"]):
        recs = {r["policy"]: r for r in d["results"]
                if (r["model"], r["dataset"]) == (model, dataset)}
        cells = []
        for p in policies:
            r = recs.get(p)
            rate = r and r["sustained_rate_rps"]
            at_least = ">= " if r and r["sustained_is_lower_bound"] else ""
            cells.append("-" if rate is None else f"{at_least}{rate:,.1f}")
        bound = next(iter(recs.values()))["latency_bound_s"]
        rows.append([model, dataset, *cells, f"{bound * 1e3:.2f}"])
    return (f"## Serving under load (`python -m paged_bench serving`)\n\n{stamp(d)} Sustained "
            "rate (req/s): the highest Poisson rate under the latency bound (`>=`: all were).\n\n"
            + table(["model", "dataset", *policies, "bound ms/token"], rows))


def transfer_section() -> str:
    d = load("h200x2/transfer.json")
    rows = [[r["case"], r["backend"], f"{r['ms']:.3f}", f"{r['gbps']:.0f}",
             f"{r['pct_nccl_bw']:.0f}"] for r in d["results"]
            if r["backend"] == "transfer_packed"]
    return (f"## Two GPUs (`python -m paged_bench transfer`)\n\n{stamp(d)} NCCL send/recv "
            f"{d['nccl_sendrecv_gbps']:.0f} GB/s.\n\n"
            + table(["prompt", "how", "ms", "GB/s", "% of NCCL"], rows))


def sharing_section() -> str:
    d, e = load("cpu/sharing.json"), load("cpu/sharing_engine.json")
    mode = {"parallel sampling": "parallel", "beam search": "beam"}
    measured = {(r["dataset"], r["mode"], r["n"]): r["saved"] for r in e["results"]}
    rows = [[r["dataset"], mode[r["method"]], str(r["n / width"]), f"{r['saving %']:.1f}",
             f"{100 * measured[r['dataset'], mode[r['method']], r['n / width']]:.1f}",
             r["paper % (OPT-13B, n/width 2-6)"]] for r in d["savings"]]
    return ("## Sharing blocks (CPU)\n\n"
            f"*Simulated: {d['date']}, `{d.get('commit', '?')}`; engine: {e['date']}, "
            f"`{e['commit']}` (`paged_bench sharing`).* % saved."
            "\n\n" + table(["dataset", "forks", "n", "simulated", "engine", "paper"], rows))


def tiers_section() -> str:
    d = load(TIERS)
    cols = ["disk_cold", "disk_warm", "host", "recompute"]
    rows = []
    for case in cases_of(d["results"]):
        got = {b: best(d["results"], case, b) for b in cols}
        cold, again = got["disk_cold"], got["recompute"]
        rows.append([case, *("-" if got[b] is None else f"{got[b]['ms']:.2f}" for b in cols),
                     "-" if not (cold and again) else f"{again['ms'] / cold['ms']:.1f}"])
    disk = d["disk"]
    return (f"## Three tiers (`python -m paged_bench tiers`)\n\n{stamp(d)} ms to bring a cached "
            "prefix (Llama-3.2-1B shape) back: from disk (`cold`: pages dropped; `warm`: "
            "page cache), host memory, or recomputed. Disk: "
            f"{disk.get('fs_type', '?')}.\n\n"
            + table(["prefix", *cols, "recompute / disk cold"], rows))


def index_section() -> str:
    listed = sorted(FILES)
    return ("## Every file\n\n" + table(["file", "what (who reads it)"],
                                        [[f"`{f}`", FILES[f]] for f in listed]))


def page() -> str:
    parts = ["# Results\n\nThe measurements the lessons read, one JSON (+ plot) per suite and "
             "GPU kind, stamped with GPU, versions, date, commit; findings: "
             "[docs/lab_notes.md](../docs/lab_notes.md). Generated by "
             "`python tools/results_page.py`.",
             decode_section(), prefill_section(), quant_section(), engine_section(),
             serving_section(), transfer_section(), sharing_section(),
             *([tiers_section()] if TIERS in FILES else []), index_section()]
    return "\n\n".join(parts) + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if results/README.md is stale")
    args = p.parse_args()
    missing = sorted(set(FILES) - {str(f.relative_to(RESULTS)) for f in RESULTS.rglob("*")
                                   if f.is_file() and f.name != "README.md"})
    unlisted = sorted({str(f.relative_to(RESULTS)) for f in RESULTS.rglob("*")
                       if f.is_file() and f.name != "README.md"} - set(FILES))
    if missing or unlisted:
        print(f"results/ and FILES disagree: missing {missing}, unlisted {unlisted}",
              file=sys.stderr)
        return 1
    text = page()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print("results/README.md is stale: run `python tools/results_page.py`",
                  file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)} ({len(text.split())} words)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
