"""What a quantised KV cache costs a real model: SmolLM2-135M-Instruct through the engine.

* perplexity of ``data/passage.txt`` (2,926 tokens) computed through the paged cache in each
  format (chunked prefill: every chunk's queries attend to the quantised K/V of the tokens
  before them and of themselves, exactly what decode sees);
* greedy agreement with the float32 cache, teacher-forced: the quantised cache's top-1 next
  token at each position of the passage, and at each position of the float32 cache's own
  greedy generations (``Engine.generate``): the same history, does it pick the same token?
* free-running: ``Engine.generate`` with the quantised cache, and how many tokens it generates
  before its first difference from the float32 cache's (after one, the texts part ways).

``python -m paged_course.quant_lm --out results/cpu/quant_smollm2.json`` (CPU, minutes). On a
GPU, ``--device cuda --dtype bfloat16 --backend auto`` runs the same measures through the
kernels: the Triton prefill kernel scores the passage and generations, and the engine decodes
with the CUDA decode kernels, each de-quantising in registers (the baseline is then the bf16
cache).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from paged_course.results import environment
from paged_ref.cache_math import blocks_needed
from paged_ref.prefill import paged_prefill

PASSAGE = Path(__file__).resolve().parents[1] / "data" / "passage.txt"
FORMATS = (None, "fp8", "int4", "fp8_token_head", "int4_g64")
PROMPT_LEN = 64  # tokens of each generation prompt (a slice of the passage)
FORMAT_NOTES = {  # what each row's cache is (written into the JSON)
    "float32": "the model's float32 K/V (the baseline)",
    "bfloat16": "the model's bfloat16 K/V (the baseline)",
    "fp8": "e4m3, one scale per layer (1.0, as vLLM's default)",
    "fp8_token_head": "e4m3, a float32 scale per token-head",
    "int4": "INT4, a float16 (scale, zero) per half head (32 channels)",
    "int4_g64": "INT4, one (scale, zero) per token-head (64 channels)",
}


def format_label(model, kv_format) -> str:
    """A row's name: the format, or for the baseline (None) the model's dtype ("float32")."""
    return kv_format or str(next(model.parameters()).dtype).removeprefix("torch.")


@torch.inference_mode()
def score_tokens(model, token_ids: list[int], *, kv_format=None, chunk: int = 512,
                 block_size: int = 16, backend: str = "torch", noise: float = 0.0,
                 seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log p(token[t+1] | tokens[:t+1]), argmax prediction at t)`` for every position but
    the last, float32 / int64 ``[n - 1]``, with the K/V cache stored in ``kv_format``
    (None: the model's dtype). Runs the engine's model runner over the paged cache in chunks;
    ``backend`` is ``paged_prefill``'s ("torch", or "auto": the Triton kernel on a GPU).
    ``noise`` > 0 multiplies every attention output element by ``1 + noise * N(0, 1)`` (seeded
    by ``seed``): rounding of about that relative size, as another kernel's would be."""
    from paged_ref.engine.runner import ModelRunner

    n = len(token_ids)
    num_blocks = blocks_needed(n, block_size)
    runner = ModelRunner(model, num_blocks, block_size, cuda_graphs=False, kv_format=kv_format,
                         max_model_len=num_blocks * block_size)
    device = runner.device
    table = torch.arange(num_blocks, dtype=torch.int32, device=device)[None]
    ids = torch.tensor(token_ids, device=device)
    logps, preds = [], []
    gen = torch.Generator().manual_seed(seed)
    for start in range(0, n, chunk):
        end = min(n, start + chunk)
        positions = torch.arange(start, end, device=device)
        seq_lens = torch.tensor([end], dtype=torch.int32, device=device)
        starts = torch.tensor([0, end - start], dtype=torch.int32, device=device)

        def attend(i, q, seq_lens=seq_lens, starts=starts):
            k_cache, v_cache = runner.cache.layer(i)
            out = paged_prefill(q, k_cache, v_cache, table, seq_lens, starts, scale=runner.scale,
                                backend=backend)
            if noise:
                jitter = torch.randn(out.shape, generator=gen).to(out.device)
                out = (out.float() * (1 + noise * jitter)).to(out.dtype)
            return out

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


def noise_sensitivity(model, tokenizer, *, formats=FORMATS, levels=(0.0, 0.002, 0.004),
                      seeds: int = 3, max_tokens: int = 2048) -> list[dict]:
    """How much each format's perplexity moves when attention's output is perturbed by relative
    noise of ``levels`` (bf16's rounding is ~0.2-0.4 %): one row per (format, level, seed),
    the passage's first ``max_tokens`` tokens. Tells a format's cost apart from rounding."""
    ids = tokenizer(PASSAGE.read_text()).input_ids[:max_tokens]
    rows = []
    for fmt in formats:
        for level in levels:
            for seed in range(seeds if level else 1):
                logps, _ = score_tokens(model, ids, kv_format=fmt, chunk=1024, noise=level,
                                        seed=seed)
                rows.append({"kv_format": format_label(model, fmt), "noise": level,
                             "seed": seed, "perplexity": perplexity(logps)})
                print(rows[-1], flush=True)
    return rows


def first_difference(ours: list[int], theirs: list[int]) -> int:
    """Tokens generated before the first that differs (``len`` when none does)."""
    return next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b),
                len(theirs))


def generation_agreement(model, prompts, baseline, outputs, kv_format=None,
                         backend: str = "torch") -> dict:
    """How a format's greedy generations compare with the baseline's (``baseline[i]`` and
    ``outputs[i]`` continue ``prompts[i]``, equal lengths):

    * ``generated_tokens``: tokens the baseline generated (all prompts);
    * ``step_agreement``: teacher-forced, the share of those tokens that the ``kv_format``
      cache also picks as top-1, given the baseline's history up to it;
    * ``mean_tokens_before_first_difference``: free-running, per prompt;
    * ``same_prefix_share``: the share of generated tokens before each prompt's first
      difference (1.0: identical generations)."""
    agree = total = 0
    for prompt, ref in zip(prompts, baseline, strict=True):
        _, preds = score_tokens(model, prompt + ref, kv_format=kv_format, chunk=1024,
                                backend=backend)
        picked = preds[len(prompt) - 1 :]  # the prediction after each token, from the prompt's last
        agree += int((picked == torch.tensor(ref, device=picked.device)).sum())
        total += len(ref)
    firsts = [first_difference(o, r) for o, r in zip(outputs, baseline, strict=True)]
    return {"generated_tokens": total, "step_agreement": agree / max(total, 1),
            "mean_tokens_before_first_difference": sum(firsts) / max(len(firsts), 1),
            "same_prefix_share": sum(firsts) / max(total, 1)}


def decode_kernel(model, kv_format: str, device: str) -> str:
    """Which kernels the engine's decode steps ran for ``kv_format``: "cuda" (the CUDA decode
    kernels), else why not (then the Triton or torch backend de-quantised)."""
    from paged_ref.kernels.cuda import cuda_refusal
    from paged_ref.quant import KVFormat

    if kv_format in ("float32", "bfloat16", "float16"):  # the baseline: the model's dtype
        return "plain cache: Triton on a GPU, torch on a CPU"
    cfg = model.config
    group = cfg.num_attention_heads // cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    why = cuda_refusal(KVFormat.parse(kv_format), next(model.parameters()).dtype, device,
                       head_dim=head_dim, group=group, block_size=16)  # (the runner's head_dim)
    return "cuda" if why is None else f"not cuda: {why}"


def measure(model, tokenizer, *, formats=FORMATS, max_tokens: int = 2048, num_prompts: int = 0,
            prompt_len: int = PROMPT_LEN, new_tokens: int = 0, on_row=None,
            backend: str = "torch") -> dict:
    """Per format (None = the model's dtype, the baseline, first): perplexity of the first
    ``max_tokens`` tokens of the passage and the top-1 (greedy) agreement with the baseline at
    each of its positions; with ``num_prompts`` > 0 also free-running greedy generation of
    ``new_tokens`` from passage slices, compared token by token with the baseline's.
    ``backend``: the scoring's prefill backend (generation uses the engine's own choice)."""
    ids = tokenizer(PASSAGE.read_text()).input_ids[:max_tokens]
    stride = len(ids) // max(num_prompts, 1)
    prompts = [ids[i * stride : i * stride + prompt_len] for i in range(num_prompts)]
    rows, base_pred, baseline = [], None, None
    for fmt in formats:
        logps, preds = score_tokens(model, ids, kv_format=fmt, chunk=1024, backend=backend)
        base_pred = preds if base_pred is None else base_pred
        row = {"kv_format": format_label(model, fmt),
               "perplexity": perplexity(logps), "passage_tokens": len(ids),
               "top1_agreement": float((preds == base_pred).double().mean()),
               "top1_positions": len(preds)}
        if num_prompts:
            outputs = generate(model, prompts, new_tokens, fmt)
            baseline = outputs if baseline is None else baseline
            row.update(generation_agreement(model, prompts, baseline, outputs, fmt, backend))
        rows.append(row)
        print(row, flush=True)
        if on_row:
            on_row(rows)
    return {"rows": rows, "num_prompts": num_prompts, "prompt_len": prompt_len,
            "new_tokens": new_tokens}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m paged_course.quant_lm",
                                description="SmolLM2 perplexity and greedy agreement per KV format")
    p.add_argument("--out", default="results/cpu/quant_smollm2.json")
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--prompts", type=int, default=0, help="free-running prompts (0: none)")
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--formats", default="base,fp8,int4,fp8_token_head,int4_g64",
                   help="'base' (or 'fp32'): the model's own dtype, the baseline")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--backend", default="torch", choices=("torch", "auto"),
                   help="the scoring's prefill backend: torch, or auto (the Triton kernel)")
    p.add_argument("--noise-levels", default="",
                   help="e.g. 0,0.002,0.004: perplexity under relative attention noise instead "
                        "(noise_sensitivity; 3 seeds a level)")
    args = p.parse_args(argv)
    from paged_ref.engine import load_smollm2

    model, tokenizer = load_smollm2(dtype=getattr(torch, args.dtype), device=args.device)
    formats = [None if f in ("base", "fp32") else f for f in args.formats.split(",")]
    if args.noise_levels:
        levels = [float(x) for x in args.noise_levels.split(",")]
        rows = noise_sensitivity(model, tokenizer, formats=formats, levels=levels,
                                 max_tokens=args.max_tokens)
        Path(args.out).write_text(json.dumps({
            "what": f"SmolLM2-135M-Instruct ({args.dtype} weights, {args.device}, torch "
                    "backend): perplexity of data/passage.txt's first tokens per KV format with "
                    "every attention output element multiplied by 1 + noise * N(0, 1)",
            **environment(), "passage_tokens": args.max_tokens, "results": rows}, indent=1))
        print(f"wrote {args.out}")
        return 0

    def write(rows):
        out = {"what": f"SmolLM2-135M-Instruct ({args.dtype} weights, {args.device}, scoring "
                       f"backend {args.backend}) through paged_ref.engine's "
                       "model runner; perplexity of the first tokens of data/passage.txt with "
                       "the KV cache in each format (chunked prefill over the paged cache); "
                       "top-1 agreement: the next-token argmax equal to the float32 cache's, "
                       "at every position of the passage; with prompts, greedy generations "
                       "(Engine.generate) from passage slices: step_agreement, the float32 "
                       "cache's generated tokens that the format also picks given the same "
                       "history; tokens generated before the first difference, free-running",
               **environment(),
               "generation": {"prompts": args.prompts, "prompt_tokens": PROMPT_LEN,
                              "new_tokens_each": args.new_tokens},
               "formats": {r["kv_format"]: FORMAT_NOTES.get(r["kv_format"], "") for r in rows},
               "decode_kernels": {r["kv_format"]: decode_kernel(model, r["kv_format"], args.device)
                                  for r in rows},
               "results": rows}
        Path(args.out).write_text(json.dumps(out, indent=1))

    measure(model, tokenizer, formats=formats, max_tokens=args.max_tokens,
            num_prompts=args.prompts, new_tokens=args.new_tokens, on_row=write,
            backend=args.backend)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
