"""Attention's error on SmolLM2's own q, K and V, per KV format, Triton prefill kernel against
the torch backend (bf16 model, GPU): is a format's bf16 perplexity through the kernels a
kernel's error or rounding? Both are compared with float32 attention over the same de-quantised
cache, at a few layers, while the passage is scored through the torch backend.

    python3 tools/gpu/quant_lm_layer_probe.py --out $OUT/quant_lm_layer_probe.json
(needs SmolLM2: tools/gpu/smollm2.sh sets it up; on a CPU, TRITON_INTERPRET=1 runs it slowly)
"""

from __future__ import annotations

import argparse
import json

import torch

from paged_course import quant_lm
from paged_course.results import environment
from paged_ref.engine import load_smollm2
from paged_ref.quant import QuantizedKV, dequantize

LAYERS = (0, 10, 20, 29)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--formats", default="base,fp8,fp8_token_head,int4")
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok = load_smollm2(dtype=torch.bfloat16, device=device)
    ids = tok(quant_lm.PASSAGE.read_text()).input_ids[: args.tokens]
    attention = quant_lm.paged_prefill
    rows = []
    for name in args.formats.split(","):
        fmt = None if name == "base" else name
        layer = [0]

        def compare(q, k, v, *a, fmt=fmt, layer=layer, **kw):
            i = layer[0]
            layer[0] += 1
            ours = attention(q, k, v, *a, **kw)  # the torch backend carries the model on
            if i not in LAYERS:
                return ours
            kernel = attention(q, k, v, *a, **{**kw, "backend": "triton"}).float()
            k32 = dequantize(k) if isinstance(k, QuantizedKV) else k.float()
            v32 = dequantize(v) if isinstance(v, QuantizedKV) else v.float()
            ref = attention(q.float(), k32, v32, *a, **kw).float()
            row = {"kv_format": fmt or "bfloat16", "layer": i}
            for label, out in (("triton", kernel), ("torch", ours.float())):
                err = out - ref
                row[f"{label}_rel"] = float(err.norm() / ref.norm())
                row[f"{label}_bias"] = float(err.mean() / ref.abs().mean())
                row[f"{label}_worst_token"] = float(
                    (err.norm(dim=(1, 2)) / ref.norm(dim=(1, 2))).max())
            rows.append(row)
            print(row, flush=True)
            return ours

        quant_lm.paged_prefill = compare
        try:
            quant_lm.score_tokens(model, ids, kv_format=fmt, chunk=args.tokens, backend="torch")
        finally:
            quant_lm.paged_prefill = attention
    with open(args.out, "w") as f:
        json.dump({**environment(), "what": __doc__.split("\n\n")[0], "tokens": len(ids),
                   "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
