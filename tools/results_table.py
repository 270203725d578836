"""Print a Markdown table of a committed benchmark JSON (best row per case and backend).

    python tools/results_table.py benchmarks/h200/bench.json
"""

from __future__ import annotations

import json
import sys

ORDER = ["torch", "triton", "triton_split", "auto", "auto_planned", "auto_graph",
         "sdpa_contiguous", "flashinfer"]


def main(path: str) -> None:
    data = json.load(open(path))
    rows = [r for r in data["results"] if r.get("best")]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    print(f"{data['gpu']}, copy bandwidth {data['copy_bw_gbps']:.0f} GB/s, torch {data['torch']}, "
          f"triton {data['triton']}, FlashInfer {data.get('flashinfer')}, {data['date']}.\n")
    print("| case | backend | ms | GB/s | % copy bw | rel err | ms (graph) | vs FlashInfer |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for case in cases:
        here = {r["backend"]: r for r in rows if r["case"] == case}
        fi = here.get("flashinfer")
        for backend in ORDER:
            r = here.get(backend)
            if r is None:
                continue
            label = r["label"] if backend == "flashinfer" else backend
            if backend == "auto":
                label += f" (→ {r.get('picked')}, no plan: checks included)"
            if r.get("fused_merge"):
                label += " [fused merge]"
            ratio = f"{fi['ms'] / r['ms']:.2f}x" if fi else "-"
            graph = "-" if r.get("ms_graph") is None else f"{r['ms_graph']:.4f}"
            print(f"| {case} | {label} | {r['ms']:.4f} | {r['gbps']:.0f} | "
                  f"{r['pct_copy_bw']:.1f} | {r['rel_err']:.1e} | {graph} | {ratio} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/h200/bench.json")
