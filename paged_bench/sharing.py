"""``python -m paged_bench sharing``: KV memory saved by sharing blocks, measured in the engine.

Parallel sampling (``SamplingParams(n=k)``: the prompt's blocks forked into ``k`` samples, the
shared last block copied on write) and beam search (``Engine.beam_search``: survivors forked,
dropped beams freed) for ``n`` / width 2, 4, 6 on ShareGPT-like and Alpaca-like lengths
(:data:`paged_course.sharing_sim.DATASETS`, the PagedAttention paper's means). After every step
of the run, as it computes, the suite reads the engine's block manager:

    blocks_shared    the blocks the live sequences hold (a shared block counted once)
    blocks_unshared  what they would hold with a copy each: sum of ceil(seq_len / block_size)

summed over the steps (a time average, as lesson 07's simulation and the paper's Fig. 15:
"the number of blocks we saved by sharing divided by the number of total blocks without
sharing"); ``saved = 1 - blocks_shared / blocks_unshared``. Block counts do not depend on the
weights, so the model is a micro random-weight Llama on the CPU (``paged_bench.engine.SHAPES
["micro"]``: one layer, two heads of 8; the outputs are random tokens; which beams survive
comes from its real scores). Every request runs to its output length
(``ignore_eos``); the samples of one request all decode that length. Prefix caching is off:
only the forks share. Each record keeps lesson 07's simulated saving for the same dataset,
method and size (``results/cpu/sharing.json``) and the paper's range beside it.

Writes ``sharing_engine.json`` (``results/cpu/sharing.json`` is lesson 07's simulation):
records ``{"mode": "parallel" | "beam", "n", "dataset", "requests", "steps", "blocks_shared",
"blocks_unshared", "saved", "peak_blocks_shared", "peak_blocks_unshared", "copies_on_write",
"simulated_saved", "paper_saved_range"}``. About two minutes on one CPU core.
"""

from __future__ import annotations

import time

import torch

from paged_bench.common import name_list, suite_parser
from paged_course import sharing_sim
from paged_course.results import environment, load_results, write_result

MODES = ("parallel", "beam")
DATASETS = tuple(sharing_sim.DATASETS)
#: Requests per dataset (Alpaca-like ones are short: more of them).
REQUESTS = {"ShareGPT-like": 24, "Alpaca-like": 64}
#: lesson 07's names of the modes (``results/cpu/sharing.json``'s ``method``).
METHODS = {"parallel": "parallel sampling", "beam": "beam search"}


def log(msg: str) -> None:
    print(msg, flush=True)


def measure(engine, run, key=lambda request: None) -> dict:
    """Run ``run()`` on ``engine`` and count, in every step as it computes (right after its
    schedule took the slots), the blocks the live sequences hold (a shared one once) and would
    hold unshared, and the copies-on-write; per ``key(request)`` of the running requests
    (their groups share no block: prefix caching is off). Returns ``{key: counts}``."""
    sched, m = engine.scheduler, engine.scheduler.manager
    schedule, totals = sched.schedule, {}

    def counted_schedule(*args):
        out = schedule(*args)
        tables: dict = {}
        for r in sched.running:
            tables.setdefault(key(r), []).append(m.block_table(r.req_id))
        copies = {d for _, d in out.block_ops.copies}
        for k, held in tables.items():
            c = totals.setdefault(k, dict(steps=0, blocks_shared=0, blocks_unshared=0,
                                          peak_blocks_shared=0, peak_blocks_unshared=0,
                                          copies_on_write=0))
            shared, unshared = len({b for t in held for b in t}), sum(map(len, held))
            c["steps"] += 1
            c["blocks_shared"] += shared
            c["blocks_unshared"] += unshared
            c["peak_blocks_shared"] = max(c["peak_blocks_shared"], shared)
            c["peak_blocks_unshared"] = max(c["peak_blocks_unshared"], unshared)
            c["copies_on_write"] += sum(t[-1] in copies for t in held)
        return out

    sched.schedule = counted_schedule
    try:
        run()
    finally:
        del sched.schedule
    for c in totals.values():
        c["saved"] = 1 - c["blocks_shared"] / max(1, c["blocks_unshared"])
    return totals


def run_mode(model, mode: str, sizes: list[int], dataset: str, requests: int,
             args) -> list[dict]:
    """One mode on one dataset's requests, a fresh engine each: parallel sampling serves every
    request once per ``n`` in one run (all at once); beam search one run per width (it starts
    prompts while their worst case fits)."""
    from paged_bench.engine import workload
    from paged_ref.engine import Engine, SamplingParams

    prompt_mean, output_mean = sharing_sim.DATASETS[dataset]
    prompts, outputs = workload(requests, model.config.vocab_size, seed=args.seed,
                                prompt_mean=prompt_mean, output_mean=output_mean,
                                max_len=args.max_len)

    def engine():
        return Engine(model, num_blocks=args.num_blocks, block_size=args.block_size,
                      enable_prefix_caching=False, max_num_seqs=4096,
                      max_num_batched_tokens=16384)

    if mode == "parallel":
        e = engine()
        params = [SamplingParams(max_tokens=o, n=n, temperature=1.0, seed=args.seed + i,
                                 ignore_eos=True) for n in sizes for i, o in enumerate(outputs)]
        counts = measure(e, lambda: e.generate(prompts * len(sizes), params=params,
                                               progress=False),
                         key=lambda r: (r.parent or r).params.n)
    else:
        counts = {}
        for n in sizes:
            e = engine()
            counts.update(measure(e, lambda e=e, n=n: e.beam_search(prompts, n, outputs,
                                                                   ignore_eos=True),
                                  key=lambda r, n=n: n))
    return [{"mode": mode, "n": n, "dataset": dataset, "requests": requests,
             "prompt_tokens": sum(map(len, prompts)), "output_tokens": sum(outputs),
             **counts[n]} for n in sizes]


def with_lesson_07(record: dict, simulated: dict | None) -> dict:
    """``record`` with lesson 07's simulated saving for its dataset, method and size (None if
    the committed simulation has no such row) and the paper's range (fractions)."""
    method = METHODS[record["mode"]]
    lo, hi = sharing_sim.PAPER_SAVING[record["dataset"]][method]
    rows = (simulated or {}).get("savings", [])
    sim = next((r["saving %"] / 100 for r in rows if r["dataset"] == record["dataset"]
                and r["method"] == method and r["n / width"] == record["n"]), None)
    return {**record, "simulated_saved": sim, "paper_saved_range": [lo / 100, hi / 100]}


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("sharing", __doc__, out="sharing_engine.json")
    p.add_argument("--modes", type=name_list(MODES, "mode"), default=",".join(MODES))
    p.add_argument("--datasets", type=name_list(DATASETS, "dataset"), default=",".join(DATASETS))
    p.add_argument("--sizes", type=lambda s: [int(x) for x in s.split(",")], default="2,4,6",
                   help="n (parallel sampling) and width (beam search), comma-separated")
    p.add_argument("--requests", type=float, default=1.0,
                   help="a multiple of the default requests per dataset " + str(REQUESTS))
    p.add_argument("--max-len", type=int, default=1024, help="clip prompt + output")
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from paged_bench.engine import build_model

    torch.set_num_threads(1)  # (tiny matmuls: a second thread only costs)
    start = time.perf_counter()
    model = build_model("micro", dtype=torch.float32, device="cpu", seed=args.seed)
    try:
        simulated = load_results("cpu/sharing")
    except FileNotFoundError:
        simulated = None
    result = {**environment(), "suite": "sharing", "model": "micro random-weight Llama "
              "(1 layer, 2 heads of 8, CPU): block counts do not depend on the weights",
              "block_size": args.block_size, "max_len": args.max_len,
              "datasets": sharing_sim.DATASETS, "prefix_caching": False,
              "simulated_from": "results/cpu/sharing.json (lesson 07)", "results": []}
    for dataset in args.datasets:
        requests = max(1, round(REQUESTS[dataset] * args.requests))
        for mode in args.modes:
            t0 = time.perf_counter()
            for rec in run_mode(model, mode, args.sizes, dataset, requests, args):
                rec = with_lesson_07(rec, simulated)
                result["results"].append(rec)
                sim = ("-" if rec["simulated_saved"] is None
                       else f"{rec['simulated_saved']:.1%}")
                log(f"{dataset:13s} {mode:8s} n={rec['n']}: saved {rec['saved']:.1%} (lesson "
                    f"07 simulated {sim}; paper {rec['paper_saved_range'][0]:.1%}-"
                    f"{rec['paper_saved_range'][1]:.1%})")
            write_result(result, args.out)
            log(f"  ({time.perf_counter() - t0:.0f} s)")
    log(f"wrote {args.out} in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
