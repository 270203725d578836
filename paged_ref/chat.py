"""``python -m paged_ref.chat --prompt "..."``: chat with SmolLM2 through the engine.

Each ``--prompt`` is one user turn of its own conversation (several run as one continuously
batched ``generate`` call); with one prompt the answer streams. ``--stats`` prints the run's
counters. Every flag is checked before the model loads: a bad one prints one line, status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def fail(message: str):
    print(f"python -m paged_ref.chat: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m paged_ref.chat", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = fail  # (one line, not the usage text)
    p.add_argument("--prompt", action="append", required=True,
                   help="a user message (repeat for several conversations at once)")
    p.add_argument("--system", default=None, help="optional system message")
    for flag, default in (("--max-new-tokens", 128), ("--num-blocks", 512), ("--block-size", 16),
                          ("--threads", None)):
        p.add_argument(flag, type=int, default=default, metavar="N")
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                   help="attention backend")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--stats", action="store_true", help="print the engine's counters")
    args = p.parse_args(argv)
    for flag, value in vars(args).items():
        if flag in ("max_new_tokens", "num_blocks", "block_size", "threads") and (
                value is not None and value < 1):
            fail(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {args.device}: no CUDA GPU here (use --device cpu)")
    return args


def cpu_threads() -> int:
    """Torch threads for a CPU run: the cores not busy now (load average), 1 to 4.

    NOTE: torch's default (a thread per core) collapses on a busy machine: on a shared 2-core
    box the CLI made 0.4-0.5 tok/s with 2 threads and 7.0 with 1 (each step waits for the
    thread whose core another process holds); beyond 4 a 135M model gains little."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, int((cores or 1) - os.getloadavg()[0] + 0.5)))


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from transformers import AutoTokenizer

    from paged_ref.cache_math import blocks_needed
    from paged_ref.engine import Engine, load_smollm2
    from paged_ref.models.loader import converted_folder

    if args.threads or "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(args.threads or cpu_threads())
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(converted_folder())  # (before the model: checks)
    prompts = []
    for text in args.prompt:
        turns = [{"role": "system", "content": args.system}] if args.system else []
        prompts.append(list(tokenizer.apply_chat_template(
            [*turns, {"role": "user", "content": text}], add_generation_prompt=True,
            tokenize=True, return_dict=False)))
    need = max(blocks_needed(len(p) + args.max_new_tokens - 1, args.block_size) for p in prompts)
    if need > args.num_blocks:
        fail(f"--num-blocks {args.num_blocks} is too small: the longest prompt and "
             f"--max-new-tokens {args.max_new_tokens} need {need} blocks of {args.block_size}")
    model, tokenizer = load_smollm2(dtype=torch.bfloat16 if args.device.startswith("cuda")
                                    else torch.float32, device=args.device)
    try:
        engine = Engine(model, num_blocks=args.num_blocks, block_size=args.block_size,
                        attention_backend=args.backend)
    except (TypeError, ValueError) as err:  # (e.g. a backend that cannot run here)
        fail(str(err))
    loaded, streamed, shown = time.perf_counter() - t0, [], [""]

    def show(event):  # print each new piece of the answer as its token arrives
        if 0 in event.new_tokens:
            streamed.append(event.new_tokens[0])
            text = tokenizer.decode(streamed, skip_special_tokens=True)
            print(text[len(shown[0]):], end="", flush=True)
            shown[0] = text

    for text in args.prompt:
        print(f"user> {text}")
    stream = len(prompts) == 1
    print("assistant> " if stream else "", end="", flush=True)
    try:
        outputs = engine.generate(prompts, args.max_new_tokens, on_step=show if stream else None)
    except ValueError as err:  # (longer than the model's context)
        fail(str(err))
    if stream:
        print()
    for text, out in zip(args.prompt, outputs, strict=True) if not stream else ():
        print(f"\n[{text}]\nassistant> {tokenizer.decode(out, skip_special_tokens=True)}")
    if args.stats:
        s = engine.stats
        print(f"[load {loaded:.1f} s; {s.output_tokens} tokens in {s.seconds:.2f} s "
              f"({s.output_tokens_per_s:.1f} tok/s, {torch.get_num_threads()} threads), "
              f"{s.steps} steps, {s.cached_tokens} prompt tokens from the prefix cache, "
              f"{s.preemptions} preemptions]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
