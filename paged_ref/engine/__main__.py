"""``python -m paged_ref.engine --prompt "..."``: chat with SmolLM2 through the engine.

Each ``--prompt`` is one user turn of its own conversation (several prompts run as one
continuously batched ``generate`` call); the answer streams to the terminal when there is one
prompt. ``--stats`` prints the run's steps, cache hits and preemptions.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m paged_ref.engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", action="append", required=True,
                   help="a user message (repeat for several conversations at once)")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--num-blocks", type=int, default=512)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--backend", default="auto", help="attention backend: auto, torch, triton")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--stats", action="store_true", help="print the engine's counters")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from paged_ref.engine import Engine, load_smollm2

    t0 = time.perf_counter()
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model, tokenizer = load_smollm2(dtype=dtype, device=args.device)
    engine = Engine(model, num_blocks=args.num_blocks, block_size=args.block_size,
                    attention_backend=args.backend)
    loaded = time.perf_counter() - t0
    prompts = []
    for text in args.prompt:
        turns = [{"role": "system", "content": args.system}] if args.system else []
        turns.append({"role": "user", "content": text})
        prompts.append(list(tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                                          tokenize=True, return_dict=False)))
    stream = len(prompts) == 1
    streamed: list[int] = []
    shown = [""]

    def show(event):  # print each new piece of the answer as its token arrives
        if 0 in event.new_tokens:
            streamed.append(event.new_tokens[0])
            text = tokenizer.decode(streamed, skip_special_tokens=True)
            print(text[len(shown[0]):], end="", flush=True)
            shown[0] = text

    for text in args.prompt:
        print(f"user> {text}")
    if stream:
        print("assistant> ", end="", flush=True)
    outputs = engine.generate(prompts, args.max_new_tokens, on_step=show if stream else None)
    if stream:
        print()
    else:
        for text, out in zip(args.prompt, outputs, strict=True):
            print(f"\n[{text}]\nassistant> {tokenizer.decode(out, skip_special_tokens=True)}")
    if args.stats:
        s = engine.stats
        print(f"[load {loaded:.1f} s; {s.output_tokens} tokens in {s.seconds:.2f} s "
              f"({s.output_tokens_per_s:.1f} tok/s), {s.steps} steps, {s.cached_tokens} prompt "
              f"tokens from the prefix cache, {s.preemptions} preemptions]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
