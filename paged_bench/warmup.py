"""``python -m paged_bench warmup``: the engine's first ``generate`` against its second (GPU).

Issue 35: in a fresh process the engine compiled its Triton kernels inside the user's first
``generate`` (256 requests x 128 tokens, Llama-3.2-1B shape: 10,539 output tok/s and a TTFT
p50 of 2.0 s, against 22,185 tok/s and 0.28 s once the kernels were compiled). The engine
now compiles them when it is built (``Engine(..., warmup=True)``, the default on a GPU).
This suite builds the engine as a user does, then runs the same workload twice, timed:

* the seconds to build the engine, and of them ``engine.warmup_seconds``;
* each ``generate``: output tok/s, TTFT p50, seconds, and the files Triton wrote into its
  cache meanwhile (each a compiled kernel or launcher: none expected inside a ``generate``);
* ``first_over_second``: the first call's tok/s over the second's (the bar: >= 0.9); the
  second call's prompts are other ids of the same lengths (no prefix-cache hit), and each
  call records the tokens it computed and found cached, and the pauses of Python's cyclic
  collector inside it (``--unfreeze`` undoes the warm-up's ``gc.freeze()``, to see its part).

Run it in a fresh process with an empty Triton cache, so that nothing was compiled before::

    TRITON_CACHE_DIR=$(mktemp -d) python -m paged_bench warmup
    TRITON_CACHE_DIR=$(mktemp -d) python -m paged_bench warmup --no-warmup   # the stall

The workload is the engine suite's (:func:`paged_bench.engine.workload`, random-weight bf16
model). Writes ``warmup.json`` (``--out``). On a CPU it says so and stops.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from paged_bench.common import suite_parser, sync
from paged_bench.engine import SHAPES, build_model, workload
from paged_ref.cache_math import blocks_needed


def triton_cache_files() -> set[str]:
    """The files under Triton's cache folder now (``TRITON_CACHE_DIR`` or its default)."""
    from triton import knobs

    root = Path(os.environ.get("TRITON_CACHE_DIR") or knobs.cache.dir)
    return {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()} if (
        root.exists()) else set()


class CollectorPauses:
    """Python's cyclic-collector passes while it is active (a ``with`` block): how many per
    generation and the seconds they took (``gc.callbacks``)."""

    def __enter__(self):
        self.count, self.seconds, self.longest, self._start = [0, 0, 0], 0.0, 0.0, 0.0
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self._callback)

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        pause = time.perf_counter() - self._start
        self.count[info["generation"]] += 1
        self.seconds += pause
        self.longest = max(self.longest, pause)

    def as_dict(self) -> dict:
        return {"gc_passes_by_generation": self.count, "gc_pause_s": self.seconds,
                "gc_longest_pause_s": self.longest}


def timed_generate(engine, prompts, max_new: int) -> dict:
    """One timed ``generate``: tok/s, TTFT p50, seconds, the Triton cache files it wrote and
    the cyclic collector's pauses inside it."""
    before = triton_cache_files()
    sync()
    with CollectorPauses() as pauses:
        start = time.perf_counter()
        engine.generate(prompts, max_new, ignore_eos=True)
        sync()
        seconds = time.perf_counter() - start
    s = engine.stats
    written = sorted(triton_cache_files() - before)
    return {"seconds": seconds, "output_tok_s": s.output_tokens / seconds,
            "ttft_p50_s": statistics.median(s.ttft_s), "steps": s.steps,
            "computed_tokens": s.computed_tokens, "cached_tokens": s.cached_tokens,
            "triton_files_written": len(written), "triton_files": written[:20],
            **pauses.as_dict()}


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("warmup", __doc__, out="warmup.json")
    p.add_argument("--shape", default="llama-3.2-1b-like", choices=SHAPES)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--no-warmup", action="store_true",
                   help="build the engine with warmup=False (to measure the first-call stall)")
    p.add_argument("--unfreeze", action="store_true",
                   help="gc.unfreeze() after the build (undo warm-up's gc.freeze: its effect)")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU here: the first-call stall is Triton compiling kernels for a GPU "
              "(on a CPU the interpreter compiles nothing)")
        return 0
    from paged_course.results import environment, write_result
    from paged_ref.engine import Engine

    empty_at_start = not triton_cache_files()
    if not empty_at_start:
        print("note: Triton's cache is not empty (set TRITON_CACHE_DIR=$(mktemp -d)): kernels "
              "compiled by earlier runs are loaded from it, not compiled")
    model = build_model(args.shape)
    prompts, _ = workload(args.num_requests, model.config.vocab_size, seed=0)
    num_blocks = sum(blocks_needed(len(q) + args.output_len, 16) for q in prompts) + 64
    start = time.perf_counter()
    engine = Engine(model, num_blocks=num_blocks, block_size=16,
                    max_num_seqs=args.max_num_seqs, warmup=not args.no_warmup)
    sync()
    if args.unfreeze:
        gc.unfreeze()
    result = {**environment(), "shape": args.shape, "num_requests": args.num_requests,
              "output_len": args.output_len, "num_blocks": num_blocks,
              "warmup": not args.no_warmup, "gc_frozen": not args.unfreeze,
              "triton_cache_empty_at_start": empty_at_start,
              "build_s": time.perf_counter() - start, "warmup_s": engine.warmup_seconds}
    print(f"engine built in {result['build_s']:.2f} s (warm-up {result['warmup_s']:.2f} s)")
    # The second call gets other ids of the same lengths: the same steps' shapes, and no hit
    # in the prefix cache (the first call's blocks stay cached; the same prompts would skip
    # their prefill and make the second call look faster than a first can be).
    gen = torch.Generator().manual_seed(1)
    others = [torch.randint(3, model.config.vocab_size, (len(q),), generator=gen).tolist()
              for q in prompts]
    for name, batch in (("first", prompts), ("second", others)):
        result[name] = timed_generate(engine, batch, args.output_len)
        r = result[name]
        print(f"{name} generate: {r['output_tok_s']:,.0f} tok/s, TTFT p50 {r['ttft_p50_s']:.3f} "
              f"s, {r['seconds']:.2f} s, {r['triton_files_written']} Triton cache files written, "
              f"gc {r['gc_passes_by_generation']} passes {r['gc_pause_s']:.3f} s")
        write_result(result, args.out)
    result["first_over_second"] = (result["first"]["output_tok_s"]
                                   / result["second"]["output_tok_s"])
    print(f"first / second: {result['first_over_second']:.3f} (bar >= 0.9)")
    print(f"wrote {write_result(result, args.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
