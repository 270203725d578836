"""Where a quantised cache's engine step goes (SmolLM2 shape, random bf16 weights, GPU): one
decode step of 256 requests (eager and CUDA graph, its kernels by name) and one prefill step of
8 prompts x 256 tokens, per KV format. Asks why the same KV memory in FP8 / INT4 holds 2-2.4x
the requests (`format_sweep`) and yet makes about the same tokens per second.

    python3 tools/gpu/format_step_probe.py --out $OUT/format_step_probe.json
"""

from __future__ import annotations

import argparse
import json

import torch

from paged_bench.engine import build_model, decode_step
from paged_course.results import environment
from paged_course.timing import copy_bandwidth_gbps, time_ms
from paged_ref.engine import Engine
from paged_ref.engine.runner import StepInputs


def prefill_step(prompts: int, length: int, block_size: int) -> StepInputs:
    """``prompts`` fresh prompts of ``length`` tokens in one step, each in its own blocks."""
    per = -(-length // block_size)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(prompts)]
    slots = [t[p // block_size] * block_size + p % block_size for t in tables
             for p in range(length)]
    return StepInputs(input_ids=[7] * (prompts * length), positions=list(range(length)) * prompts,
                      slot_mapping=slots, query_start_loc=[i * length for i in range(prompts + 1)],
                      seq_lens=[length] * prompts, block_tables=tables,
                      sample_rows=list(range(prompts)))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--formats", default="plain,fp8,int4")
    args = p.parse_args()
    model = build_model("smollm2-135m")
    bw = copy_bandwidth_gbps()
    rows = []
    for name in args.formats.split(","):
        fmt = None if name == "plain" else name
        engine = Engine(model, num_blocks=5000, block_size=16, max_num_seqs=256, kv_format=fmt)
        engine.generate([[5] * 40] * 256, 2, ignore_eos=True)  # compile, capture the graphs
        dec = decode_step(engine, model, 256, 284, bw)
        step = prefill_step(8, 256, 16)
        engine.runner.execute(step)
        row = {"kv_format": name, "decode_ms": dec["ms"], "decode_graph_ms": dec["graph_ms"],
               "decode_kernels_per_layer": dec["kernels_per_layer"],
               "decode_kernels_by_name": dec["kernels_by_name"],
               "prefill_2048_tokens_ms": time_ms(lambda s=step, r=engine.runner: r.execute(s))}
        rows.append(row)
        print({k: v for k, v in row.items() if k != "decode_kernels_by_name"}, flush=True)
        del engine
        torch.cuda.empty_cache()
    with open(args.out, "w") as f:
        json.dump({**environment(), "what": __doc__.split("\n\n")[0], "results": rows}, f,
                  indent=1)


if __name__ == "__main__":
    main()
