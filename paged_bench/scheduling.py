"""``python -m paged_bench scheduling``: prefix-aware admission against first come, first served.

The engine's ``scheduling_policy="prefix"`` (:func:`paged_ref.engine.policy.admission_order`:
the waiting request with the most prompt tokens in the prefix cache first, SGLang's
longest-prefix-first; one overtaken by ``max_overtakes`` later arrivals goes first) against
``"fcfs"`` on a shared-prefix workload (:func:`paged_course.serving.workload.
make_shared_prefix_trace`: 4 system prompts of 200-800 tokens, multi-turn chats, Poisson
arrivals). The engine's real scheduler and block manager with prefix caching, a null model and
the simulated clock (:mod:`paged_course.serving.driver`), each step lasting what the committed
per-step cost model says (:func:`paged_course.serving.cost_model.committed`: the H200 fit of
``python -m paged_bench serving``, or ``PRIOR_H200`` until there is one). Runs on a CPU.

Pools: ``--num-blocks`` (256 blocks of 16 = 4,096 tokens: the system prompts alone take half,
so what stays cached depends on what runs together) and ``--roomy-blocks`` (every prefix stays
cached: there the order cannot change what hits, and the two policies should agree). Rates:
``--factors`` x the FCFS saturation rate of the tight pool (every request at once). At each
rate: FCFS and the prefix policy at ``--max-overtakes`` (the engine's default); at each of
``--sweep-factors`` also the prefix policy at each of ``--sweep`` (the aging bound; ``none``:
no bound, a request with nothing cached may wait for ever behind a stream of hits).

Per run: ``hit_rate`` (prompt tokens found cached at admission / prompt tokens admitted,
re-admissions after a preemption included), ``requests_per_s`` and ``throughput_tok_s``
(finished requests / output tokens over first arrival to last finish), ``p50_ttft_s``,
``p99_ttft_s``, ``max_ttft_s``, ``preemptions``, ``host_ms_per_step`` (the host's own time
per step on this machine: the scheduler's bookkeeping, the policy's lookups included). Per
(pool, rate), ``comparisons``: the default prefix policy over FCFS and whether it meets the
bar (hit rate and throughput higher, p99 TTFT at most 10 % higher).
"""

from __future__ import annotations

import math
import time

from paged_bench.common import suite_parser
from paged_course.results import environment, write_result
from paged_course.serving import cost_model as cm
from paged_course.serving import driver, workload
from paged_course.serving.runners import simulation_engine

#: The bar of issue 38: prefix beats FCFS on hit rate and throughput, p99 TTFT <= +10 %.
P99_SLACK = 1.10
BLOCK_SIZE, MAX_MODEL_LEN = 16, 2048


def log(msg: str) -> None:
    print(msg, flush=True)


def count_hits(engine) -> dict:
    """Wrap ``engine.scheduler.schedule`` to add up, over every step, the prompt tokens found
    cached at admission (``"cached"``) and the tokens of the requests admitted
    (``"admitted"``). Returns the dict it keeps up to date."""
    sched, box = engine.scheduler, {"cached": 0, "admitted": 0}
    schedule = sched.schedule

    def counted(*args):
        out = schedule(*args)
        box["cached"] += out.cached_tokens
        box["admitted"] += sum(r.num_tokens for r in out.admitted)
        return out

    sched.schedule = counted
    return box


def measure(trace, cost, num_blocks: int, policy: str, max_overtakes: int | None = None,
            **extra) -> dict:
    """Serve ``trace`` once on a fresh simulation engine (prefix caching on, ``num_blocks``
    blocks) under ``policy`` against the simulated clock of ``cost``; the run's record (see
    the module doc). ``max_overtakes`` None: the engine's default for ``"prefix"``; for the
    unbounded sweep point pass ``math.inf``-like ``10**9``."""
    options = {} if max_overtakes is None else {"max_overtakes": max_overtakes}
    engine = simulation_engine(num_blocks=num_blocks, block_size=BLOCK_SIZE,
                               max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True,
                               scheduling_policy=policy, **options)
    hits = count_hits(engine)
    t0 = time.perf_counter()
    result = driver.run(engine, trace, driver.SimulatedClock(cost))
    host = time.perf_counter() - t0
    s = driver.summarize(result)
    done = [r for r in result.requests if r.finished_s is not None]
    span = max(r.finished_s for r in done) - min(r.arrival_s for r in done)
    ttft = [r.ttft for r in result.requests if r.ttft is not None]
    return {**extra, "num_blocks": num_blocks, "rate_rps": trace.rate_rps, "policy": policy,
            "max_overtakes": engine.scheduler.max_overtakes if policy == "prefix" else None,
            "hit_rate": hits["cached"] / max(1, hits["admitted"]),
            "cached_tokens": hits["cached"], "admitted_tokens": hits["admitted"],
            "requests_per_s": len(done) / span, "throughput_tok_s": s["throughput_tok_s"],
            "p50_ttft_s": s["p50_ttft_s"], "p99_ttft_s": s["p99_ttft_s"],
            "max_ttft_s": max(ttft), "mean_normalized_latency_s": s["mean_normalized_latency_s"],
            "preemptions": engine.scheduler.num_preemptions, "steps": s["steps"],
            "finished": s["finished"], "requests": s["requests"],
            "host_ms_per_step": 1e3 * host / max(1, s["steps"])}


def compare(fcfs: dict, prefix: dict) -> dict:
    """The prefix run against the FCFS run of the same pool and rate, and the bar."""
    out = {"pool": fcfs["pool"], "rate_rps": fcfs["rate_rps"], "factor": fcfs["factor"],
           "max_overtakes": prefix["max_overtakes"],
           "hit_rate_fcfs": fcfs["hit_rate"], "hit_rate_prefix": prefix["hit_rate"],
           "x_requests_per_s": prefix["requests_per_s"] / fcfs["requests_per_s"],
           "x_throughput_tok_s": prefix["throughput_tok_s"] / fcfs["throughput_tok_s"],
           "x_p99_ttft": prefix["p99_ttft_s"] / fcfs["p99_ttft_s"]}
    out["meets_bar"] = bool(out["hit_rate_prefix"] > out["hit_rate_fcfs"]
                            and out["x_requests_per_s"] > 1 and out["x_p99_ttft"] <= P99_SLACK)
    return out


def parse_sweep(text: str) -> list[int | None]:
    """``"4,64,none"`` -> ``[4, 64, None]`` (None: no aging bound)."""
    return [None if v.strip().lower() == "none" else int(v) for v in text.split(",") if v.strip()]


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("scheduling", __doc__, out="scheduling.json")
    p.add_argument("--requests", type=int, default=300)
    p.add_argument("--factors", type=lambda s: [float(x) for x in s.split(",")],
                   default="0.5,0.9,1.1,1.5",
                   help="rates, as multiples of the tight pool's FCFS saturation rate")
    p.add_argument("--num-blocks", type=int, default=256, help="the tight pool")
    p.add_argument("--roomy-blocks", type=int, default=2048, help="the roomy pool (0: skip)")
    p.add_argument("--roomy-factors", type=lambda s: [float(x) for x in s.split(",") if x],
                   default="1.5", help="the roomy pool's rates (multiples as above)")
    p.add_argument("--max-overtakes", type=int, default=None,
                   help="the prefix policy's aging bound (default: the engine's)")
    p.add_argument("--sweep", type=parse_sweep, default="4,32,none",
                   help="more aging bounds for the tight pool ('none': unbounded)")
    p.add_argument("--sweep-factors", type=lambda s: [float(x) for x in s.split(",") if x],
                   default="0.9,1.1,1.5", help="the tight pool's rates that the sweep runs at")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    start = time.perf_counter()
    cost, source = cm.committed()
    trace = workload.make_shared_prefix_trace(args.requests, 1.0, seed=args.seed,
                                              max_len=MAX_MODEL_LEN)
    sat = measure(trace.at_rate(1e6), cost, args.num_blocks, "fcfs")["requests_per_s"]
    log(f"shared-prefix trace: {len(trace)} requests, systems {trace.system_lens} tokens; "
        f"cost model: {source}; FCFS saturates the {args.num_blocks}-block pool at "
        f"{sat:.1f} req/s")
    runs, comparisons = [], []
    pools = [("tight", args.num_blocks, args.factors)]
    if args.roomy_blocks:
        pools.append(("roomy", args.roomy_blocks, args.roomy_factors))
    for pool, blocks, factors in pools:
        for f in factors:
            sweep = args.sweep if pool == "tight" and f in args.sweep_factors else []
            t = trace.at_rate(float(f"{sat * f:.3g}"))
            tag = {"pool": pool, "factor": f}
            fcfs = measure(t, cost, blocks, "fcfs", **tag)
            prefix = measure(t, cost, blocks, "prefix", args.max_overtakes, **tag, default=True)
            point = [fcfs, prefix] + [
                measure(t, cost, blocks, "prefix", 10**9 if k is None else k, **tag,
                        default=False) for k in sweep]
            runs += point
            comparisons.append(compare(fcfs, prefix))
            for r in point:
                log(f"{pool:5} {blocks:5} blocks {t.rate_rps:7.3g} req/s {r['policy']:6} "
                    f"K={str(r['max_overtakes']):>10}: hit {r['hit_rate']:.3f}, "
                    f"{r['requests_per_s']:6.2f} req/s, {r['throughput_tok_s']:7.0f} tok/s, "
                    f"TTFT p50 {r['p50_ttft_s']:.3f} p99 {r['p99_ttft_s']:.3f} s, "
                    f"{r['preemptions']} preempted, host {r['host_ms_per_step']:.2f} ms/step")
            c = comparisons[-1]
            log(f"  prefix/fcfs: hit {c['hit_rate_prefix']:.3f} vs {c['hit_rate_fcfs']:.3f}, "
                f"req/s x{c['x_requests_per_s']:.3f}, p99 TTFT x{c['x_p99_ttft']:.3f}: "
                + ("meets the bar" if c["meets_bar"] else "misses the bar"))
    result = {**environment(), "suite": "scheduling", "simulated": True,
              "cost_model": cost.to_dict(), "cost_model_source": source,
              "workload": {"name": trace.dataset, "requests": len(trace), "seed": args.seed,
                           "system_lens": list(trace.system_lens), "max_len": MAX_MODEL_LEN,
                           "mean_prompt": sum(r.prompt_len for r in trace.requests) / len(trace),
                           "mean_output": sum(r.output_len for r in trace.requests) / len(trace)},
              "block_size": BLOCK_SIZE, "fcfs_saturation_rps": sat,
              "bar": f"prefix hit rate and requests/s > fcfs, p99 TTFT <= {P99_SLACK} x fcfs",
              "results": runs, "comparisons": comparisons,
              "seconds": time.perf_counter() - start}
    write_result(result, args.out)
    log(f"wrote {args.out} in {result['seconds']:.0f} s")
    return 0 if all(math.isfinite(r["p99_ttft_s"]) for r in runs) else 1
