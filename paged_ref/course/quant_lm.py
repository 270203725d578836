"""What a quantised KV cache costs a real model: SmolLM2-135M-Instruct through the engine.

* perplexity of ``data/passage.txt`` (2,926 tokens) computed through the paged cache in each
  format (chunked prefill: every chunk's queries attend to the quantised K/V of the tokens
  before them and of themselves, exactly what decode sees);
* greedy agreement with the float32 cache: free-running (``Engine.generate`` with the
  quantised cache, token by token against the float32 cache's output) and teacher-forced (the
  quantised cache's top-1 prediction at each position of the float32 cache's generations).

``python -m paged_ref.course.quant_lm --out benchmarks/quant_smollm2.json`` (CPU, minutes).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import sys
from pathlib import Path

import torch

from paged_ref.cache_math import blocks_needed

PASSAGE = Path(__file__).resolve().parents[2] / "data" / "passage.txt"
FORMATS = (None, "fp8", "int4", "fp8_token_head", "int4_g64")


@torch.inference_mode()
def score_tokens(model, token_ids: list[int], *, kv_format=None, chunk: int = 512,
                 block_size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(token[t+1] | tokens[:t+1]), argmax prediction at t)`` for every position but
    the last, float32 / int64 ``[n - 1]``, with the K/V cache stored in ``kv_format``
    (None: the model's dtype). Runs the engine's model runner over the paged cache in chunks."""
    from paged_ref.engine import ops
    from paged_ref.engine.runner import ModelRunner

    n = len(token_ids)
    num_blocks = blocks_needed(n, block_size)
    runner = ModelRunner(model, num_blocks, block_size, cuda_graphs=False, kv_format=kv_format,
                         max_model_len=num_blocks * block_size)
    device = runner.device
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
    ids = torch.tensor(token_ids, device=device)
    logps, preds = [], []
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        positions = torch.arange(start, end, device=device)
        seq_lens = torch.tensor([end], dtype=torch.int32, device=device)
        starts = torch.tensor([0, end - start], dtype=torch.int32, device=device)

        def attend(i, q, seq_lens=seq_lens, starts=starts):
            k_cache, v_cache = runner.cache.layer(i)
            return ops.prefill_attention(q, k_cache, v_cache, table, seq_lens, starts,
                                         scale=runner.scale, backend="torch")

        hidden = runner.forward(ids[start:end], positions, positions, attend)  # slot = position
        logits = model.lm_head(hidden).float()
        targets = ids[start + 1 : end + 1]
        logps.append(logits[: len(targets)].log_softmax(-1).gather(1, targets[:, None])[:, 0])
        preds.append(logits[: len(targets)].argmax(-1))
    return torch.cat(logps), torch.cat(preds)


def perplexity(logps: torch.Tensor) -> float:
    """``exp(-mean log p)``."""
    return math.exp(-float(logps.double().mean()))


def generate(model, prompts: list[list[int]], max_new_tokens: int, kv_format=None):
    """Greedy continuations (``ignore_eos``) through ``paged_ref.engine.Engine``."""
    from paged_ref.engine import Engine

    need = sum(blocks_needed(len(p) + max_new_tokens, 16) for p in prompts)
    engine = Engine(model, num_blocks=need + 8, block_size=16, kv_format=kv_format,
                    cuda_graphs=False)
    return engine.generate(prompts, max_new_tokens, ignore_eos=True)


def measure(model, tokenizer, *, formats=FORMATS, max_tokens: int = 2048, num_prompts: int = 0,
            prompt_len: int = 64, new_tokens: int = 0, on_row=None) -> dict:
    """Per format (None = the model's dtype, the baseline, first): perplexity of the first
    ``max_tokens`` tokens of the passage and the top-1 (greedy) agreement with the baseline at
    each of its positions; with ``num_prompts`` > 0 also free-running greedy generation of
    ``new_tokens`` from passage slices, compared token by token with the baseline's."""
    ids = tokenizer(PASSAGE.read_text()).input_ids[:max_tokens]
    stride = len(ids) // max(num_prompts, 1)
    prompts = [ids[i * stride : i * stride + prompt_len] for i in range(num_prompts)]
    rows, base_pred, baseline = [], None, None
    for fmt in formats:
        logps, preds = score_tokens(model, ids, kv_format=fmt, chunk=1024)
        base_pred = preds if base_pred is None else base_pred
        row = {"kv_format": fmt or str(next(model.parameters()).dtype).removeprefix("torch."),
               "perplexity": perplexity(logps), "passage_tokens": len(ids),
               "top1_agreement": float((preds == base_pred).double().mean()),
               "top1_positions": len(preds)}
        if num_prompts:
            outputs = generate(model, prompts, new_tokens, fmt)
            baseline = outputs if baseline is None else baseline
            pairs = list(zip(outputs, baseline, strict=True))
            row["generated_tokens"] = num_prompts * new_tokens
            row["greedy_agreement"] = sum(a == b for o, r in pairs for a, b in zip(
                o, r, strict=True)) / row["generated_tokens"]
            row["mean_tokens_before_first_difference"] = sum(next(
                (i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b), len(r))
                for o, r in pairs) / num_prompts
        rows.append(row)
        print(row, flush=True)
        if on_row:
            on_row(rows)
    return {"rows": rows, "num_prompts": num_prompts, "prompt_len": prompt_len,
            "new_tokens": new_tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paged_ref.course.quant_lm",
                                description="SmolLM2 perplexity and greedy agreement per KV format")
    p.add_argument("--out", default="benchmarks/quant_smollm2.json")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=0, help="free-running prompts (0: none)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--formats", default="fp32,fp8,int4,fp8_token_head,int4_g64")
    args = p.parse_args(argv)
    from paged_ref.engine import load_smollm2

    model, tokenizer = load_smollm2()
    formats = [None if f == "fp32" else f for f in args.formats.split(",")]

    def write(rows):
        out = {"what": "SmolLM2-135M-Instruct (float32 weights, CPU) through paged_ref.engine's "
                       "model runner; perplexity of the first tokens of data/passage.txt with "
                       "the KV cache in each format (chunked prefill over the paged cache); "
                       "top-1 agreement: the next-token argmax equal to the float32 cache's, "
                       "at every position of the passage",
               "torch": torch.__version__, "date": dt.date.today().isoformat(), "results": rows}
        Path(args.out).write_text(json.dumps(out, indent=1))

    measure(model, tokenizer, formats=formats, max_tokens=args.max_tokens,
            num_prompts=args.prompts, new_tokens=args.new_tokens, on_row=write)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
