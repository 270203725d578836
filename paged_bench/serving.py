"""``python -m paged_bench serving``: latency against request rate, paging vs reservation (GPU).

The PagedAttention paper's Fig. 12 on one GPU: Poisson arrivals of ShareGPT-like and
Alpaca-like requests (:mod:`paged_course.serving.workload`) served by this repo's online engine
against the wall clock (:mod:`paged_course.serving.driver`), once per reservation policy --
``paged`` (blocks on demand) and the Orca baselines ``reserve_max`` / ``reserve_pow2`` /
``reserve_oracle`` (the same model, kernels and scheduler otherwise) -- at rates around each
policy's knee. Models: SmolLM2-135M-Instruct's real weights in bf16 (when its GGUF file and the
``gguf`` package are there) and the Llama-3.2-1B-like shape with random weights.

The KV budget binds: ``--num-blocks`` 1,024 blocks of 16 = 16,384 tokens with
``--max-model-len`` 1,024, so ``reserve_max`` holds 16 requests at once where paging holds
several times more. The bound: 2 x the unloaded latency (the lowest-rate point's mean normalized
latency, minimum over the policies, per model and dataset); the sustained rate is interpolated
where a curve crosses it (:mod:`paged_course.serving.sweep`).

Per model: a calibration run (paged, every request at once) fits the per-step cost model
``a + b*tokens + c*seqs + d*kv_tokens`` (:mod:`paged_course.serving.cost_model`). With the
first model's, the CPU simulation (the real scheduler, a null runner, that cost model's time)
estimates each policy's knee (scaled for the second model by the ratio of its step cost). Each
curve is then found on the GPU (:func:`paged_course.serving.sweep.sweep_to_knee`): from
``--start-factor`` x that knee (moved down while its first point is not unloaded), ``--growth``
x a point until one is past the bound, each curve given an equal share of what is left of
``--budget-s``. Each point's requests arrive over ``--span-s`` seconds (at least
``MIN_POINT_REQUESTS``). Each record keeps the simulated knee beside the measured sustained
rate. Every step of every run (tokens, seqs, KV tokens, wall seconds; GPU seconds of the runner
from CUDA events) feeds the committed cost model, which lesson 12 uses for its simulated clock.

Writes ``serving.json`` (+ ``serving.png``) to ``--out``: records ``{"model", "policy",
"dataset", "sustained_rate_rps", "curve": [{"rate_rps", "mean_normalized_latency_s",
"p50_ttft_s", "p99_ttft_s", "p50_tpot_s", "p99_tpot_s", "throughput_tok_s", ...}], ...}`` and
``cost_models``. On a CPU it says so and runs the simulated version of a tiny config instead
(``--simulate`` runs that version on a GPU machine too).
"""

from __future__ import annotations

import time
from pathlib import Path

from paged_bench.common import name_list, suite_parser
from paged_course.results import environment, write_result
from paged_course.serving import cost_model as cm
from paged_course.serving import driver, sweep, workload
from paged_course.serving.runners import instrument

MODELS = ("smollm2-135m-real", "llama-3.2-1b-like")
DATASETS = tuple(workload.LENGTHS)
FACTORS = "0.5,0.8,1.0,1.2,1.5"
#: On a GPU each curve is found (``sweep.sweep_to_knee``): from START_FACTOR x the simulated
#: knee (the 2026-12-02 run's simulated knees were up to 2x the measured ones), GROWTH x a
#: point until one is past the bound.
START_FACTOR, GROWTH = 0.3, 1.6
#: The simulated search for each knee: multiples of the analytic capacity.
KNEE_FACTORS = (0.3, 0.6, 0.9, 1.2)
#: Requests of the calibration run (all at once), twice: the first compiles.
WARM_REQUESTS = 48
#: Requests per dataset of the simulated knee search's trace.
REQUESTS = {"ShareGPT-like": 80, "Alpaca-like": 160}
#: Each GPU point's requests arrive over this many seconds (``--span-s``): ``rate x span``
#: requests, so that a high rate is not one burst (2026-12-02: 160 Alpaca-like requests at
#: the knee arrived in 0.09-0.7 s and the curves measured how fast a burst drains).
SPAN_S = 6.0
#: The fewest requests a GPU point has (a low rate's span is longer).
MIN_POINT_REQUESTS = 30
#: The most requests one point takes (its trace is cut there, span or not).
MAX_REQUESTS = 2000
#: The CPU's tiny simulated config: a 2,048-token pool, reservations of 512 tokens (4 held);
#: requests per dataset in DATASETS' order.
TINY = dict(num_blocks=128, block_size=16, max_model_len=512, requests=(24, 48))


def log(msg: str) -> None:
    print(msg, flush=True)


def simulated_knees(traces: dict, policies, cost: cm.CostModel, num_blocks: int,
                    block_size: int, factors=KNEE_FACTORS) -> dict[tuple[str, str], float]:
    """Per (policy, dataset): the sustained rate the CPU simulation predicts -- the real
    scheduler with a null runner, ``cost``'s time, the GPU run's pool -- where the GPU grid is
    centred (the analytic capacity misses where head-of-line blocking puts the knee)."""
    knees = {}
    for name, trace in traces.items():
        curves, _ = sweep.simulated_curves(trace, cost, num_blocks=num_blocks,
                                           block_size=block_size, factors=factors,
                                           policies=policies)
        for rec in sweep.records(curves, name):
            rate = rec["sustained_rate_rps"]
            lowest = min(p["rate_rps"] for p in rec["curve"])
            knees[rec["policy"], name] = rate if rate is not None else lowest / 2
    return knees


def gpu_engine(model, policy: str, args):
    from paged_ref.engine import Engine

    return instrument(Engine(model, num_blocks=args.num_blocks, block_size=args.block_size,
                             enable_prefix_caching=False, max_model_len=args.max_model_len,
                             max_num_seqs=args.max_num_seqs, reservation=policy))


def step_rows(results: list[driver.RunResult]) -> list[tuple]:
    return [(s.shape.tokens, s.shape.seqs, s.shape.kv_tokens, s.seconds)
            for res in results for s in res.steps if s.shape.tokens]


def fitted(rows: list[tuple]) -> dict:
    model = cm.fit(rows)
    return {**model.to_dict(), **cm.fit_error(model, rows)}


def run_model(name: str, model, args, result: dict, save, deadline: float, knees: dict) -> None:
    """Calibrate, then find every policy x dataset curve for one model; records into ``result``.
    ``knees`` (filled by the first model, reused by the next, scaled by their step costs):
    ``{"step_s": the first model's decode step at batch 16, "rates": {(policy, dataset):
    simulated knee}}``."""
    t0 = time.perf_counter()
    paged = gpu_engine(model, "paged", args)
    warm = workload.make_trace("ShareGPT-like", WARM_REQUESTS, 1e4, seed=99,
                               max_len=args.max_model_len)
    calib = [driver.run(paged, warm, driver.WallClock()) for _ in range(2)]  # 1st compiles
    cost = cm.fit(step_rows(calib[1:]))
    log(f"{name}: engine ready and calibrated in {time.perf_counter() - t0:.0f} s; cost model "
        f"a={cost.a * 1e3:.2f} ms b={cost.b * 1e6:.2f} us/token c={cost.c * 1e6:.2f} us/seq "
        f"d={cost.d * 1e9:.2f} ns/KV token")
    traces = {d: workload.make_trace(d, args.requests[d], 1.0, seed=args.seed,
                                     max_len=args.max_model_len) for d in args.datasets}
    batch = sweep.decode_step_seconds(cost, traces[args.datasets[0]])(16)
    if not knees:
        t1 = time.perf_counter()
        knees.update(step_s=batch, rates=simulated_knees(traces, args.policies, cost,
                                                         args.num_blocks, args.block_size))
        log(f"  simulated knees in {time.perf_counter() - t1:.0f} s: " + ", ".join(
            f"{p}/{d} {k:.3g}" for (p, d), k in knees["rates"].items()))
    scale = knees["step_s"] / batch  # (this model's steps against the first model's)
    traces = {d: workload.make_trace(d, MAX_REQUESTS, 1.0, seed=args.seed,
                                     max_len=args.max_model_len) for d in traces}
    curves: dict[str, dict[str, list]] = {d: {} for d in traces}
    runs, gpu_times, left = calib[1:], [], len(args.policies) * len(traces)
    for policy in args.policies:
        engine = paged if policy == "paged" else gpu_engine(model, policy, args)
        for d, trace in traces.items():
            knee = knees["rates"][policy, d] * scale
            share = (deadline - time.perf_counter()) / left  # (this curve's part of the time)
            left -= 1
            if share < 5:
                log(f"  {policy} / {d}: skipped (out of time)")
                continue
            log(f"{name} {policy} {d}: simulated knee ~{knee:.3g} req/s, from "
                f"{knee * args.start_factor:.3g} req/s, ~{share:.0f} s")
            curves[d][policy] = sweep.sweep_to_knee(
                lambda e=engine: e, trace, knee * args.start_factor, driver.WallClock,
                unloaded_s=sweep.decode_step_seconds(cost, trace)(1), growth=args.growth,
                deadline=time.perf_counter() + share, max_seconds=args.max_point_s,
                progress=log, keep=runs, span_s=args.span_s,
                min_requests=MIN_POINT_REQUESTS)
        gpu_times += [(s.tokens, s.seqs, s.kv_tokens, g) for s, g in engine.runner.times]
        del engine
    del paged
    for d, c in curves.items():
        for rec in sweep.records(c, d) if c else []:
            result["results"].append({"model": name, **rec, "simulated_knee_rps":
                                      knees["rates"][rec["policy"], d] * scale})
    result["cost_models"][name] = {"wall": fitted(step_rows(runs)), "gpu": fitted(gpu_times),
                                   "calibration": cost.to_dict()}
    save()


def simulate_tiny(args) -> dict:
    """The CPU's version: the real scheduler with a null runner, simulated time
    (:data:`paged_course.serving.cost_model.PRIOR_H200`), a tiny config."""
    cost, out = cm.PRIOR_H200, []
    for name, n in zip(DATASETS, TINY["requests"], strict=True):
        if name in args.datasets:
            trace = workload.make_trace(name, n, 1.0, seed=args.seed,
                                        max_len=TINY["max_model_len"])
            curves, _ = sweep.simulated_curves(trace, cost, num_blocks=TINY["num_blocks"],
                                               block_size=TINY["block_size"],
                                               factors=args.factors, policies=args.policies,
                                               progress=log)
            out += sweep.records(curves, name)
    return {"simulated": True, "cost_model": cost.to_dict(), **TINY, "results": out}


def write_png(result: dict, path: Path, simulated: bool) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from paged_course.serving.plot import plot_curves

    fig = plot_curves(result["results"], simulated=simulated, title=f"{result['gpu']}, "
                      f"{result['date']}" + (" (simulated: the cost model's time)"
                                             if simulated else ""))
    fig.savefig(path, dpi=110)


def parse_requests(text: str) -> dict[str, int]:
    pairs = dict(kv.split("=") for kv in text.split(",") if kv)
    return {**REQUESTS, **{k: int(v) for k, v in pairs.items() if k in REQUESTS}}


def main(argv: list[str] | None = None) -> int:
    import torch

    p = suite_parser("serving", __doc__, out="serving.json")
    p.add_argument("--models", type=name_list(MODELS, "model"), default=",".join(MODELS))
    p.add_argument("--datasets", type=name_list(DATASETS, "dataset"), default=",".join(DATASETS))
    p.add_argument("--policies", type=name_list(sweep.POLICIES, "policy"),
                   default=",".join(sweep.POLICIES))
    p.add_argument("--requests", type=parse_requests, default="",
                   help="per dataset, e.g. ShareGPT-like=80,Alpaca-like=160 (the defaults)")
    p.add_argument("--factors", type=lambda s: [float(x) for x in s.split(",")], default=FACTORS,
                   help="the CPU's simulated run: each policy's rates, as multiples of its "
                   "estimated capacity (a GPU finds its rates: --start-factor, --growth)")
    p.add_argument("--start-factor", type=float, default=START_FACTOR,
                   help="on a GPU each curve starts at this x the simulated knee")
    p.add_argument("--growth", type=float, default=GROWTH,
                   help="on a GPU each next rate is this x the last (until past the bound)")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--span-s", type=float, default=SPAN_S,
                   help="each point's arrivals span this many seconds (rate x span requests, "
                   "at least --requests' count)")
    p.add_argument("--max-point-s", type=float, default=40.0,
                   help="a point still running then is stopped (marked truncated)")
    p.add_argument("--budget-s", type=float, default=420.0, help="the whole run's wall time")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--simulate", action="store_true",
                   help="the CPU's simulated run of a tiny config, even with a GPU here")
    args = p.parse_args(argv)
    start = time.perf_counter()
    result = {**environment(), "suite": "serving", "bound": f"{sweep.BOUND_FACTOR} x the "
              "lowest-rate mean normalized latency (minimum over policies), per model and "
              "dataset", "factors": args.factors, "seed": args.seed, "results": []}
    if args.simulate or not torch.cuda.is_available():
        why = "--simulate" if args.simulate else "no CUDA GPU here"
        log(f"{why}: the serving suite measures on a GPU (committed results: "
            "results/h200/serving.json). Running the simulated version of a tiny config "
            "instead (the real scheduler, a null model, simulated time):")
        result.update(simulate_tiny(args))
        write_result(result, args.out)
        write_png(result, args.out.with_suffix(".png"), simulated=True)
        log(f"wrote {args.out} in {time.perf_counter() - start:.1f} s")
        return 0
    from paged_bench.engine import build_model

    result.update({"num_blocks": args.num_blocks, "block_size": args.block_size,
                   "kv_budget_tokens": args.num_blocks * args.block_size,
                   "max_model_len": args.max_model_len, "max_num_seqs": args.max_num_seqs,
                   "requests": args.requests, "span_s": args.span_s, "cost_models": {},
                   "start_factor": args.start_factor, "growth": args.growth})
    models = [m for m in args.models if m != "smollm2-135m-real" or has_gguf()]
    knees: dict = {}
    for i, name in enumerate(models):
        t0 = time.perf_counter()
        model = build_model(name, dtype=torch.bfloat16, device="cuda")
        log(f"{name}: loaded in {time.perf_counter() - t0:.0f} s")
        share = (args.budget_s - (time.perf_counter() - start)) / (len(models) - i)
        run_model(name, model, args, result, lambda: write_result(result, args.out),
                  time.perf_counter() + share, knees)
        del model
        torch.cuda.empty_cache()
    write_png(result, args.out.with_suffix(".png"), simulated=False)
    log(f"wrote {args.out} in {time.perf_counter() - start:.0f} s")
    return 0


def has_gguf() -> bool:
    try:
        from paged_ref.models.loader import gguf_path

        gguf_path()
        import gguf  # noqa: F401
    except ImportError as err:
        log(f"skipping smollm2-135m-real: {err}")
        return False
    return True
