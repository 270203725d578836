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
FORMATS = (None, "fp8", "fp8_token_head", "int4", "int4_g32")


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


def measure(model, tokenizer, *, formats=FORMATS, num_prompts: int = 8, prompt_len: int = 64,
            new_tokens: int = 256) -> dict:
    """Perplexity and greedy agreement per format (None = the model's dtype, the baseline)."""
    ids = tokenizer(PASSAGE.read_text()).input_ids
    stride = len(ids) // num_prompts
    prompts = [ids[i * stride : i * stride + prompt_len] for i in range(num_prompts)]
    baseline = generate(model, prompts, new_tokens)
    rows = []
    for fmt in formats:
        logps, _ = score_tokens(model, ids, kv_format=fmt)
        outputs = generate(model, prompts, new_tokens, fmt) if fmt else baseline
        same = [sum(a == b for a, b in zip(o, r, strict=True)) for o, r in zip(outputs, baseline,
                                                                            strict=True)]
        first_diff = [next((i for i, (a, b) in enumerate(zip(o, r, strict=True)) if a != b),
                           len(r)) for o, r in zip(outputs, baseline, strict=True)]
        forced = [score_tokens(model, p + r, kv_format=fmt)[1][len(p) - 1 :]
                  for p, r in zip(prompts, baseline, strict=True)]
        forced_agree = sum(int((f == torch.tensor(r, device=f.device)).sum())
                           for f, r in zip(forced, baseline, strict=True))
        total = num_prompts * new_tokens
        rows.append({"kv_format": fmt or str(next(model.parameters()).dtype).removeprefix(
            "torch."), "perplexity": perplexity(logps), "passage_tokens": len(ids),
            "generated_tokens": total, "greedy_agreement": sum(same) / total,
            "mean_tokens_before_first_difference": sum(first_diff) / num_prompts,
            "teacher_forced_top1_agreement": forced_agree / total})
        print(rows[-1], flush=True)
    return {"rows": rows, "num_prompts": num_prompts, "prompt_len": prompt_len,
            "new_tokens": new_tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paged_ref.course.quant_lm",
                                description="SmolLM2 perplexity and greedy agreement per KV format")
    p.add_argument("--out", default="benchmarks/quant_smollm2.json")
    p.add_argument("--new-tokens", type=int, default=256)
    args = p.parse_args(argv)
    from paged_ref.engine import load_smollm2

    model, tokenizer = load_smollm2()
    result = measure(model, tokenizer, new_tokens=args.new_tokens)
    out = {"what": "SmolLM2-135M-Instruct (float32 weights, CPU) through paged_ref.engine; "
                   "perplexity of data/passage.txt with the KV cache in each format; greedy "
                   f"agreement with the float32 cache over {result['num_prompts']} prompts of "
                   f"{result['prompt_len']} passage tokens x {result['new_tokens']} generated",
           "torch": torch.__version__, "date": dt.date.today().isoformat(),
           "results": result["rows"]}
    Path(args.out).write_text(json.dumps(out, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
