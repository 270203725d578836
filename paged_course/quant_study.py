"""Lesson 10's measurements that need no GPU: what FP8 and INT4 can represent, what they cost
in attention error, and how many tokens fit in a memory budget.

    representable_values("fp8")            # every finite e4m3 value (253 distinct)
    attention_error_table()                # rows: format x distribution -> relative errors
    tokens_that_fit(budget_gib=1.0, num_layers=30, num_kv_heads=3, head_dim=64)

``python -m paged_course.quant_study --out results/cpu/quant_accuracy.json`` writes the
committed table (CPU, deterministic seeds).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from paged_course import ROOT
from paged_course.checks import relative_error
from paged_course.results import environment, write_result
from paged_course.testing import make_paged_inputs
from paged_ref.quant import FP8_DTYPE, KVFormat, dequantize, quantize
from paged_ref.reference import paged_attention_torch

FORMATS = ("fp8", "fp8_token_head", "int4", "int4_g128")
#: Random K/V distributions: unit normal; K with a few outlier channels (as real models have:
#: a handful of K channels ~10-20x the others, see the SmolLM2 samples in data/).
DISTRIBUTIONS = ("normal", "k_outlier_channels")


def representable_values(kind: str) -> torch.Tensor:
    """Sorted float32 values a code can hold at scale 1: every finite e4m3 value (``"fp8"``),
    or the 16 INT4 codes ``0..15`` (``"int4"``; with a scale and zero: ``zero + scale * c``)."""
    if kind == "fp8":
        codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(FP8_DTYPE).float()
        return codes[torch.isfinite(codes)].unique()
    if kind == "int4":
        return torch.arange(16, dtype=torch.float32)
    raise ValueError(f"kind must be 'fp8' or 'int4', got {kind!r}")


def with_outlier_channels(x: torch.Tensor, channels=(5, 37, 100), factor: float = 15.0,
                          offset: float = 3.0) -> torch.Tensor:
    """``x`` [..., D] with a few channels scaled by ``factor`` and shifted by ``offset`` times
    ``factor`` (a large, one-signed channel, as in the K of real models)."""
    x = x.clone()
    for c in channels:
        if c < x.shape[-1]:
            x[..., c] = (x[..., c].float() * factor + offset * factor).to(x.dtype)
    return x


def attention_error_table(formats=FORMATS, distributions=DISTRIBUTIONS, *, seed: int = 0,
                          seq_lens=(700, 1500, 333, 1024), num_q_heads: int = 32,
                          num_kv_heads: int = 8, head_dim: int = 128) -> list[dict]:
    """For each distribution and format: the relative error of decode attention with the
    quantised cache against the float64 answer for the bf16 cache, and the round-trip error
    of K and V. q, K, V are bf16 (as a model writes them); attention runs on the torch backend
    (the kernels compute the same values, see the tests)."""
    rows = []
    for dist in distributions:
        inp = make_paged_inputs(list(seq_lens), num_q_heads=num_q_heads,
                                num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16,
                                dtype=torch.bfloat16, seed=seed)
        if dist == "k_outlier_channels":
            inp.k_cache = with_outlier_channels(inp.k_cache)
        ref = inp.reference()
        max_len = max(seq_lens)
        for fmt in ("bf16", *formats):
            q_inp = inp if fmt == "bf16" else inp.quantized(fmt)
            out = paged_attention_torch(*q_inp.args(), max_len=max_len)
            row = {"distribution": dist, "kv_format": fmt,
                   "attention_rel_err": relative_error(out, ref)}
            if fmt != "bf16":
                for name, plain, q in (("k", inp.k_cache, q_inp.k_cache),
                                       ("v", inp.v_cache, q_inp.v_cache)):
                    used = _used_slots(inp)
                    back = dequantize(q).flatten(0, 1)[used]
                    row[f"{name}_rel_err"] = relative_error(back, plain.flatten(0, 1)[used])
                per = KVFormat.parse(fmt).bytes_per_token_head(head_dim)
            else:
                row["k_rel_err"] = row["v_rel_err"] = 0.0
                per = 2 * head_dim
            row["bytes_per_token_head"] = per
            rows.append(row)
    return rows


def _used_slots(inp) -> torch.Tensor:
    """Slots that hold a sequence's token (never the poisoned spare ones)."""
    block_size = inp.k_cache.shape[1]
    slots = []
    for b, n in enumerate(inp.seq_lens.tolist()):
        table = inp.block_tables[b].tolist()
        slots += [table[t // block_size] * block_size + t % block_size for t in range(n)]
    return torch.tensor(slots, dtype=torch.long)


def tokens_that_fit(budget_gib: float, *, num_layers: int, num_kv_heads: int, head_dim: int,
                    formats=("bf16", *FORMATS)) -> dict[str, int]:
    """Tokens whose K and V (all layers, codes + scales) fit in ``budget_gib`` GiB."""
    fit = {}
    for fmt in formats:
        per_head = 2 * head_dim if fmt == "bf16" else KVFormat.parse(fmt).bytes_per_token_head(
            head_dim)
        per_token = 2 * num_layers * num_kv_heads * per_head
        fit[fmt] = int(budget_gib * 2**30 // per_token)
    return fit


def quantise_samples(x: torch.Tensor, formats=FORMATS) -> dict[str, float]:
    """Round-trip relative error of real K or V samples ``[tokens, heads, D]`` per format."""
    return {fmt: relative_error(dequantize(quantize(x, fmt)), x) for fmt in formats}


# ---- real K/V of SmolLM2 and the pictures of lesson 10 ---------------------------------------

SAMPLES = Path(__file__).resolve().parents[1] / "data" / "smollm2_kv_sample.npz"


def bf16_perplexity_rows(root: Path = ROOT) -> list[dict]:
    """SmolLM2 in bf16, per KV format, from three committed runs: the H200 through the kernels
    (``results/h200/quant_smollm2_bf16_auto.json``: Triton prefill scores, the engine
    generates), the H200 with the torch backend scoring (``..._torch.json``), and a CPU with
    relative noise of 0.2-0.4 % on attention's output (``results/cpu/quant_smollm2_noise.json``).
    Perplexities as % above the same run's bf16 cache; ``noise_band`` is (lowest, highest)."""
    results = root / "results"
    runs = {name: {r["kv_format"]: r for r in
                   json.loads((results / "h200" / f"quant_smollm2_bf16_{name}.json").read_text())
                   ["results"]} for name in ("auto", "torch")}
    noise = json.loads((results / "cpu" / "quant_smollm2_noise.json").read_text())["results"]
    base_cpu = next(r["perplexity"] for r in noise if r["kv_format"] == "bfloat16"
                    and r["noise"] == 0)

    def pct(ppl, base):
        return 100 * (ppl / base - 1)

    rows = []
    for fmt, kern in runs["auto"].items():
        row = {"kv_format": fmt,
               "kernels_pct": pct(kern["perplexity"], runs["auto"]["bfloat16"]["perplexity"]),
               "step_agreement": kern.get("step_agreement"),
               "torch_pct": pct(runs["torch"][fmt]["perplexity"],
                                runs["torch"]["bfloat16"]["perplexity"])}
        band = [pct(r["perplexity"], base_cpu) for r in noise
                if r["kv_format"] == fmt and r["noise"] > 0]
        row["noise_band"] = (min(band), max(band)) if band else None
        rows.append(row)
    return rows


def engine_format_rows(root: Path = ROOT) -> list[dict]:
    """The same 360 MiB of KV memory in each format, in the engine (H200, SmolLM2's shape,
    random bf16 weights; ``results/h200/engine_formats.json``), with
    each format's decode step of 256 requests and its kernels a layer
    (``results/h200/format_step.json``). Both ran with the quantising write as torch ops,
    before ``paged_ref/kernels/triton/quant_write.py``."""
    h200 = root / "results" / "h200"
    sweep = json.loads((h200 / "engine_formats.json").read_text())
    probe = json.loads((h200 / "format_step.json").read_text())
    steps = {("bfloat16" if r["kv_format"] == "plain" else r["kv_format"]): r
             for r in probe["results"]}
    rows = []
    for r in sweep["format_sweep"]:
        step = steps.get(r["kv_format"], {})
        rows.append({**{k: r[k] for k in ("kv_format", "tokens_of_room", "max_requests_held",
                                          "preemptions", "steps", "output_tok_s")},
                     "decode_graph_ms": step.get("decode_graph_ms"),
                     "kernels_per_layer": step.get("decode_kernels_per_layer")})
    return rows


def load_smollm2_samples(path: Path = SAMPLES) -> dict:
    """The committed SmolLM2-135M K/V samples (see tools/extract_smollm2_kv.py) as tensors:
    ``k``, ``v`` float32 [3 layers, 256 tokens, 3 kv heads, 64]; ``layers``; ``k_amax``,
    ``v_amax`` [30 layers, 3 heads, 64] per-channel max |value| over the passage's start."""
    import numpy as np

    data = np.load(path)
    return {name: torch.from_numpy(data[name].astype("float32" if data[name].dtype.kind == "f"
                                                      else data[name].dtype))
            for name in data.files}


def plot_codes_vs_values(samples: dict, layer_index: int = 1, head: int = 0):
    """Three panels: (1) a histogram of one layer's |K| and |V| with the values an e4m3 code
    can take at the per-tensor scale ``amax / 448``; (2) max |K| and max |V| per channel:
    K's outlier channels; (3) one token-head's K against its 16 INT4 levels (two halves)."""
    from matplotlib.figure import Figure

    k, v = samples["k"][layer_index], samples["v"][layer_index]
    layer = int(samples["layers"][layer_index])
    fig = Figure(figsize=(13, 3.6))
    ax1, ax2, ax3 = fig.subplots(1, 3)
    edges = torch.logspace(-4, 1.5, 60)
    for name, x in (("|K|", k), ("|V|", v)):
        ax1.hist(x.abs().flatten().numpy(), bins=edges.numpy(), alpha=0.6, label=name)
    grid = representable_values("fp8") * float(k.abs().max()) / 448
    grid = grid[(grid > 1e-4)]
    ax1.vlines(grid.numpy(), 0, ax1.get_ylim()[1] * 0.15, color="k", lw=0.5,
               label="e4m3 values at K's scale")
    ax1.set_xscale("log")
    ax1.set(title=f"layer {layer}: values vs FP8 (per-tensor scale)", xlabel="|value|")
    ax1.legend(fontsize=7)
    for name, amax in (("max |K|", samples["k_amax"][layer, head]),
                       ("max |V|", samples["v_amax"][layer, head])):
        ax2.plot(amax.numpy(), marker=".", lw=0.8, label=name)
    ax2.set(title=f"layer {layer}, kv head {head}: per channel", xlabel="channel")
    ax2.legend(fontsize=7)
    token = k[7, head]
    from paged_ref.quant import quantize

    q4 = quantize(token[None], KVFormat.int4(token.shape[-1] // 2))
    half = token.shape[-1] // 2
    for h in range(2):
        levels = q4.zero[0, h].float() + q4.scale[0, h].float() * representable_values("int4")
        ax3.hlines(levels.numpy(), h * half, (h + 1) * half - 1, color="0.8", lw=0.6)
    ax3.plot(token.numpy(), ".", label="K of token 7")
    ax3.plot(dequantize(q4)[0].numpy(), "x", ms=4, label="its INT4 value")
    ax3.set(title="one token-head: 16 levels per half", xlabel="channel")
    ax3.legend(fontsize=7)
    fig.tight_layout()
    return fig


def format_layout(head_dim: int = 128, formats=("bf16", *FORMATS)) -> list[dict]:
    """Per format, the tensors one cache holds and their bytes per token-head, counted on a
    small quantised cache: ``{"format", "tensors": [(name, dtype, bytes), ...], "total"}``
    (``fp8``'s one scale per layer is 0 bytes a token)."""
    x = torch.randn(2, 16, 2, head_dim, dtype=torch.bfloat16)  # [blocks, block, heads, D]
    per = x.shape[0] * x.shape[1] * x.shape[2]                  # token-heads in it
    rows = []
    for fmt in formats:
        if fmt == "bf16":
            tensors = [("values", "bfloat16", x.nbytes / per)]
        else:
            q = quantize(x, fmt)
            tensors = [("codes", str(q.data.dtype).removeprefix("torch."), q.data.nbytes / per)]
            for name in ("scale", "zero"):
                t = getattr(q, name)
                if t is not None and t.dim() > 0:  # (a 0-dim scale: one for the layer)
                    tensors.append((name, str(t.dtype).removeprefix("torch."), t.nbytes / per))
        rows.append({"format": fmt, "tensors": tensors,
                     "total": sum(b for _, _, b in tensors)})
    return rows


def plot_format_bytes(head_dim: int = 128):
    """One token-head of each format as a ribbon of its bytes: the codes (for INT4, channel
    ``i`` in a byte's low nibble and ``i + D/2`` in its high one) and, stored beside them in
    their own tensors, the scales (and zeros)."""
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    rows = format_layout(head_dim)
    colours = {"values": "#7f7f7f", "codes": "#1f77b4", "scale": "#ff7f0e", "zero": "#2ca02c"}
    fig = Figure(figsize=(11, 3.8))
    ax = fig.subplots()
    for y, row in enumerate(reversed(rows)):
        x = 0.0
        for i, (name, dtype, nbytes) in enumerate(row["tensors"]):
            x += 8 if i else 0  # a tensor of its own: drawn apart
            ax.barh(y, nbytes, left=x, color=colours[name], edgecolor="k", lw=0.5)
            if i == 0:
                ax.text(x + nbytes / 2, y, dtype, ha="center", va="center", fontsize=8,
                        color="w")
            x += nbytes
        note = {"fp8": "  + one float32 scale for the whole layer",
                "int4": "  (a (scale, zero) pair per half head)",
                "int4_g128": "  (one pair per head)"}.get(row["format"], "")
        ax.text(x + 2, y, f"{row['total']:.0f} B{note}", va="center", fontsize=8)
    ax.set_yticks(range(len(rows)), [r["format"] for r in reversed(rows)])
    ax.set(xlabel=f"bytes per token and KV head (head_dim {head_dim})", xlim=(0, 2 * head_dim + 90),
           title="one token-head: its codes, and beside them (own tensors) its scales and zeros")
    ax.legend(handles=[Patch(color=c, label=n) for n, c in colours.items()], fontsize=7,
              loc="lower right")
    fig.tight_layout()
    return fig


def decode_points(quant: dict, case: str = "B64_L4096") -> list[dict]:
    """The committed quant run's best row of each (kernel family, format) on ``case``:
    ``{"who", "kv_format", "mb", "ms", "pct"}`` (``who``: Triton, CUDA or FlashInfer)."""
    from paged_course.quant_deep import family

    return [{"who": family(r), "kv_format": r["kv_format"], "mb": r["bytes"] / 1e6,
             "ms": r["ms"], "pct": r["pct_copy_bw"]}
            for r in quant["results"] if r["case"] == case and r["best"]]


def plot_time_vs_bytes(quant: dict, case: str = "B64_L4096"):
    """Decode time against the bytes a format makes the step read, one point per kernel
    family and format, with the lines a step at 100 % and 85 % of copy bandwidth follows."""
    from matplotlib.figure import Figure

    points = decode_points(quant, case)
    fig = Figure(figsize=(7.5, 4.2))
    ax = fig.subplots()
    top = 1.1 * max(p["mb"] for p in points)
    for share, style in ((1.0, "-"), (0.85, ":")):
        ax.plot([0, top], [0, top / (share * quant["copy_bw_gbps"])], "k", ls=style, lw=0.8,
                label=f"{share:.0%} of copy bandwidth")
    marks = {"Triton": "o", "CUDA": "s", "FlashInfer": "^"}
    colours = {"bf16": "#7f7f7f", "fp8": "#1f77b4", "fp8_token_head": "#17becf",
               "int4": "#d62728", "int4_g128": "#ff7f0e"}
    for p in points:
        ax.plot(p["mb"], p["ms"], marks[p["who"]], ms=8, color=colours[p["kv_format"]],
                label=f"{p['who']} {p['kv_format']}")
    ax.set(xlabel=f"MB of K/V (codes + scales) a step reads, {case}", ylabel="ms per step",
           xlim=(0, top), ylim=(0, None),
           title=f"{quant['gpu']}, {quant['date']}: time follows bytes only near the line")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paged_course.quant_study",
                                description="Attention error of quantised KV caches (CPU).")
    p.add_argument("--out", default="results/cpu/quant_accuracy.json")
    args = p.parse_args(argv)
    rows = attention_error_table()
    from tabulate import tabulate

    print(tabulate([[r["distribution"], r["kv_format"], f"{r['bytes_per_token_head']:.0f}",
                     f"{r['k_rel_err']:.2e}", f"{r['v_rel_err']:.2e}",
                     f"{r['attention_rel_err']:.2e}"] for r in rows],
                   headers=["K/V", "format", "B/token-head", "K err", "V err", "attention err"]))
    result = {"what": "decode attention with a quantised cache vs the float64 answer for the "
                      "bf16 cache; q/K/V bf16, 32 q / 8 kv heads, head_dim 128, block 16, "
                      "lengths 700/1500/333/1024, seed 0; torch backend on CPU",
              **environment(), "results": rows}
    write_result(result, args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
