"""``python -m paged_ref.engine --prompt "..."``: chat with SmolLM2 through the engine.

Each ``--prompt`` is one user turn of its own conversation (several prompts run as one
continuously batched ``generate`` call); the answer streams to the terminal when there is one
prompt. ``--stats`` prints the run's steps, cache hits and preemptions. Every flag is checked
before the model loads: a bad one prints one line and exits with status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch


def parse_args(argv) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m paged_ref.engine", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.error = lambda message: fail(message)  # (one line, not the usage text)
    positive = dict(type=int, metavar="N")
    p.add_argument("--prompt", action="append", required=True,
                   help="a user message (repeat for several conversations at once)")
    p.add_argument("--system", default=None, help="optional system message")
    p.add_argument("--max-new-tokens", default=128, **positive)
    p.add_argument("--num-blocks", default=512, **positive)
    p.add_argument("--block-size", default=16, **positive)
    p.add_argument("--backend", default="auto", choices=("auto", "torch", "triton"),
                   help="attention backend")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", default=None, help="torch CPU threads (default: the idle "
                   "cores, at most 4)", **positive)
    p.add_argument("--stats", action="store_true", help="print the engine's counters")
    args = p.parse_args(argv)
    for flag in ("max_new_tokens", "num_blocks", "block_size", "threads"):
        if getattr(args, flag) is not None and getattr(args, flag) < 1:
            fail(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        fail(f"--device {args.device}: no CUDA GPU here (use --device cpu)")
    return args


def fail(message: str):
    print(f"python -m paged_ref.engine: error: {message}", file=sys.stderr)
    raise SystemExit(2)


def cpu_threads() -> int:
    """Torch threads for a CPU run: the cores not busy now (load average), 1 to 4.

    NOTE: torch's default (every core) collapses on a busy machine: on a shared 2-core box
    the CLI made 0.4-0.5 tok/s with 2 threads and 7.0 with 1 (OpenMP threads waiting on cores
    that other processes hold); beyond 4 a 135M model gains little."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, int((cores or 1) - os.getloadavg()[0] + 0.5)))


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from transformers import AutoTokenizer

    from paged_ref.cache_math import blocks_needed
    from paged_ref.engine import Engine, load_smollm2
    from paged_ref.engine.loader import converted_folder

    if "OMP_NUM_THREADS" not in os.environ or args.threads:
        torch.set_num_threads(args.threads or cpu_threads())
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(converted_folder())
    prompts = []
    for text in args.prompt:
        turns = [{"role": "system", "content": args.system}] if args.system else []
        turns.append({"role": "user", "content": text})
        prompts.append(list(tokenizer.apply_chat_template(turns, add_generation_prompt=True,
                                                          tokenize=True, return_dict=False)))
    need = max(blocks_needed(len(p) + args.max_new_tokens - 1, args.block_size) for p in prompts)
    if need > args.num_blocks:
        fail(f"--num-blocks {args.num_blocks} is too small: the longest prompt and "
             f"--max-new-tokens {args.max_new_tokens} need {need} blocks of {args.block_size}")
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    model, tokenizer = load_smollm2(dtype=dtype, device=args.device)
    try:
        engine = Engine(model, num_blocks=args.num_blocks, block_size=args.block_size,
                        attention_backend=args.backend)
    except (TypeError, ValueError) as err:
        fail(str(err))
    loaded = time.perf_counter() - t0
    stream, streamed, shown = len(prompts) == 1, [], [""]

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
    try:
        outputs = engine.generate(prompts, args.max_new_tokens, on_step=show if stream else None)
    except ValueError as err:  # (longer than the model's context)
        fail(str(err))
    if stream:
        print()
    else:
        for text, out in zip(args.prompt, outputs, strict=True):
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
