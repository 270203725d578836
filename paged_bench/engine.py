"""``python -m paged_bench engine``: the serving engine against transformers (GPU).

One run, one workload (N requests; prompt lengths drawn from lesson 01's ShareGPT-like
lognormal, fixed seed; random token ids; the same prompts for every system), on random-weight
bf16 Llama models at two shapes (a Llama-3.2-1B-like one and SmolLM2-135M's), or on SmolLM2's
real weights in bf16 (``--shapes smollm2-135m-real``: ``load_smollm2``, which needs the GGUF
file and the ``gguf`` package; the speed should be that of the random-weight shape):

* ``engine``          this repo's :class:`paged_ref.engine.Engine` (paged KV, continuous
                      batching, CUDA graphs for decode);
* ``static_generate`` transformers ``model.generate`` in static batches: every request of a
                      batch reserves room for the longest, and the batch runs until its longest
                      request is done (the "reserve the maximum" baseline);
* ``generate_batch``  transformers' own paged continuous batching (``generate_batch``).

Reported per system: output tokens/s, mean time to first token, most requests held at once.
Then the decode step of the engine at batch 256 against its roofline, ``(weight bytes + KV
bytes read) / copy bandwidth``; prefill and mixed steps (``PREFILL_STEPS``) with piecewise
CUDA graphs and eager, wall time against the GPU's busy time; then "more requests fit": the
engine with a paged pool against the same engine reserving ``max_len`` tokens' blocks per
request (``reservation="reserve_max"``, Orca Max: ``budget // max_len`` requests at once),
across KV budgets, next to lesson 01's simulation.

Writes ``engine.json`` (+ ``engine.png``) to ``--out``. On a CPU it says so and stops.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter
from pathlib import Path

import torch

from paged_bench.common import name_list, suite_parser, sync
from paged_course.results import environment, write_result
from paged_ref.cache_math import blocks_needed, kv_bytes_per_token

SHAPES = {
    # hidden, intermediate, layers, q heads, kv heads, head_dim, vocab, rope theta
    "llama-3.2-1b-like": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                              num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                              vocab_size=128256, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                 rope_theta=10000.0),  # for CPU tests
    "micro": dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=8, vocab_size=256,
                  rope_theta=10000.0),  # block counting on a CPU (python -m paged_bench sharing)
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                         vocab_size=49152, rope_theta=100000.0),
}
#: SmolLM2-135M-Instruct's own weights (``paged_ref.engine.load_smollm2``), SHAPES' shape.
REAL_SMOLLM2 = "smollm2-135m-real"
#: What runs the workload: this repo's engine, then transformers' two ways.
SYSTEMS = ("engine", "static_generate", "generate_batch")


def build_model(shape: str, dtype=torch.bfloat16, device="cuda", seed: int = 0,
                attn_implementation: str = "sdpa"):
    """A random-weight ``LlamaForCausalLM`` at ``shape``, built directly on ``device``
    (``REAL_SMOLLM2``: SmolLM2-135M-Instruct's weights, through ``load_smollm2``)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if shape == REAL_SMOLLM2:
        from paged_ref.engine import load_smollm2

        model, _ = load_smollm2(dtype=dtype, device=device)
        model.set_attn_implementation(attn_implementation)
        model.generation_config.eos_token_id = None  # every system runs to max_new_tokens
        model.generation_config.pad_token_id = 0
        return model
    cfg = LlamaConfig(**SHAPES[shape], tie_word_embeddings=True, max_position_embeddings=8192,
                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.set_attn_implementation(attn_implementation)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def workload(n: int, vocab: int, seed: int = 0, prompt_mean: float = 161,
             output_mean: float | None = None, max_len: int = 1024):
    """``n`` prompts (random ids; lognormal lengths from lesson 01) and their output lengths
    (lognormal from lesson 01 when ``output_mean`` is given, else None)."""
    from paged_course.simulate import sample_requests

    req = sample_requests(n, seed=seed, prompt_mean=prompt_mean,
                          output_mean=output_mean or 128, max_len=max_len)
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (int(p),), generator=gen).tolist() for p in req.prompt]
    outputs = [int(o) for o in req.output] if output_mean else None
    return prompts, outputs


def weight_bytes(model) -> int:
    """Bytes a decode step reads of the weights: every parameter once (tied embeddings: the
    LM head reads the whole matrix; the embedding lookup reads only the batch's rows)."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ---------------------------------------------------------------------------- the systems


def run_engine(model, prompts, max_new, num_blocks, block_size=16, max_num_seqs=256, **kw):
    from paged_ref.engine import Engine

    engine = Engine(model, num_blocks=num_blocks, block_size=block_size,
                    max_num_seqs=max_num_seqs, **kw)
    # Warm-up on prompts of the same lengths (untimed): the prefill steps' shapes compile
    # Triton kernels and pick cuBLAS kernels once (the 2026-11-30 run warmed up on 8 prompts
    # only, and its first timed step still took ~1 s on the 1B shape). Each run gets token ids
    # of its own (``fresh``): the prefix cache holds none of its prompts, every prompt token
    # is computed (runs before 2026-12-07 repeated the prompts: ~94 % were prefix-cache hits).
    vocab = model.config.vocab_size
    rounds = itertools.count(0)  # (fresh prompts each generate)
    engine.generate(fresh(prompts, next(rounds), vocab), 2, ignore_eos=True)
    sync()
    runs = []  # three timed generates; the median one's stats are reported (host time varies)
    for _ in range(3):
        engine.generate(fresh(prompts, next(rounds), vocab), max_new, ignore_eos=True)
        runs.append(engine.stats)
    s = sorted(runs, key=lambda r: r.seconds)[1]
    # The GPU's busy time over the same work, profiled (the profiler slows the host, so the
    # wall time compared with it is the unprofiled runs'): wall / busy = 1 when the host is
    # never on the GPU's critical path.
    busy = busy_seconds(profiled_kernels(lambda: engine.generate(
        fresh(prompts, next(rounds), vocab), max_new, ignore_eos=True)))
    return engine, {"num_scheduler_steps": engine.num_scheduler_steps,
                    "seconds_of_each_run": [r.seconds for r in runs],
                    "prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens,
                    "max_num_batched_tokens": engine.scheduler.max_num_batched_tokens,
                    "output_tok_s": s.output_tokens_per_s, "seconds": s.seconds,
                    "gpu_busy_s": busy, "wall_over_gpu_busy": s.seconds / busy,
                    "profiled_cached_tokens": engine.stats.cached_tokens,
                    "output_tokens": s.output_tokens,
                    "mean_ttft_s": sum(s.ttft_s) / len(s.ttft_s),
                    "max_requests_held": s.max_running, "steps": s.steps,
                    "preemptions": s.preemptions, "num_blocks": num_blocks,
                    "max_num_seqs": max_num_seqs}


def fresh(prompts, round_: int, vocab: int) -> list[list[int]]:
    """``prompts`` with their ids moved (``round_`` 0: as they are): same lengths, no block
    alike, so a run with another ``round_`` finds nothing of them in the prefix cache."""
    return [[3 + (t - 3 + 7919 * round_) % (vocab - 3) for t in p] for p in prompts]


def run_static(model, prompts, max_new: int, batch_size: int):
    """transformers ``generate`` in static batches (left-padded), every request to ``max_new``."""
    model.generate(torch.ones(2, 8, dtype=torch.long, device=model.device), max_new_tokens=4,
                   min_new_tokens=4, do_sample=False)  # warm-up
    sync()
    start, ttft, tokens = time.perf_counter(), [], 0
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i:i + batch_size]
        width = max(len(p) for p in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                            device=model.device)
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False)
        sync()
        ttft += [t0 - start + time.perf_counter() - t0] * len(batch)  # batch start + prefill
        out = model.generate(ids, attention_mask=mask, max_new_tokens=max_new,
                             min_new_tokens=max_new, do_sample=False)
        tokens += (out.shape[1] - width) * len(batch)
    sync()
    seconds = time.perf_counter() - start
    return {"output_tok_s": tokens / seconds, "seconds": seconds, "output_tokens": tokens,
            "mean_ttft_s": sum(ttft) / len(ttft), "max_requests_held": batch_size,
            "batch_size": batch_size}


def run_generate_batch(model, prompts, max_new: int):
    """transformers' continuous batching, attention ``"paged|sdpa"``."""
    from transformers import GenerationConfig

    model.set_attn_implementation("paged|sdpa")
    cfg = GenerationConfig(max_new_tokens=max_new, do_sample=False, eos_token_id=None,
                           pad_token_id=0)
    model.generate_batch(inputs=prompts[:8], generation_config=cfg, progress_bar=False)
    sync()
    start = time.perf_counter()
    results = model.generate_batch(inputs=prompts, generation_config=cfg, progress_bar=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(r.generated_tokens) for r in results.values())
    model.set_attn_implementation("sdpa")
    return {"output_tok_s": tokens / seconds, "seconds": seconds, "output_tokens": tokens,
            "mean_ttft_s": None, "max_requests_held": None}


# ---------------------------------------------------------------------------- measurements


def profiled_kernels(fn) -> list:
    """The GPU work one call of ``fn`` does, in order: ``torch.profiler`` device events (kernels,
    also those a CUDA graph replays, and memory copies and sets), each with ``.name`` and
    ``.time_range`` (us). ``fn`` runs once before, so nothing compiles while profiled."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    return [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


def decode_step_events(runner, step) -> list:
    """The GPU work of one decode step, run eagerly (its CUDA graph holds the same kernels;
    piecewise graphs, which would take the step without its own, are set aside too)."""
    graphs, runner.graphs, piecewise, runner.piecewise = runner.graphs, {}, runner.piecewise, None
    try:
        return profiled_kernels(lambda: runner.execute(step))
    finally:
        runner.graphs, runner.piecewise = graphs, piecewise


def decode_step_kernels(runner, step) -> list[str]:
    """The kernels of one decode step (memory copies and sets left out)."""
    return [e.name for e in decode_step_events(runner, step)
            if not e.name.startswith(("Memcpy", "Memset"))]


def busy_seconds(events) -> float:
    """Seconds the GPU was busy: the union of the events' time ranges (overlaps counted once)."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted((e.time_range.start, e.time_range.end) for e in events):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy / 1e6


def step_roofline_ms(weight_bytes: int, kv_bytes: int, batch: int, copy_bw_gbps: float,
                     matmul_tflops: float, element_size: int = 2) -> float:
    """A decode step's lower bound, ms: its matmuls at whichever binds -- the weights read once
    at copy bandwidth, or ``2 x batch`` FLOPs per weight at the matmul rate (at batch 256 on an
    H200 the FLOPs do) -- plus the K/V read once at copy bandwidth."""
    weights_ms = weight_bytes / (copy_bw_gbps * 1e9) * 1e3
    flops_ms = 2 * batch * (weight_bytes / element_size) / (matmul_tflops * 1e12) * 1e3
    return max(weights_ms, flops_ms) + kv_bytes / (copy_bw_gbps * 1e9) * 1e3


def decode_step(engine, model, batch: int, seq_len: int, copy_bw_gbps: float,
                matmul_tflops: float | None = None) -> dict:
    """One CUDA-graph decode step of ``batch`` requests of ``seq_len`` tokens vs its roofline
    (``roofline_ms``: every byte once at copy bandwidth; with ``matmul_tflops``, also
    :func:`step_roofline_ms`'s, where the matmuls may be bound by FLOPs), and the kernels it
    launches (per step and per layer, the embedding and LM head included)."""
    from paged_course.timing import time_ms

    runner = engine.runner
    step = synthetic_step(engine, (), batch, seq_len)
    ms = time_ms(lambda: runner.execute(step))
    bucket = min((b for b in runner.graphs if b >= batch), default=None)
    graph_ms = time_ms(runner.graphs[bucket].replay) if bucket else None
    events = decode_step_events(runner, step)
    kernels = [e.name for e in events if not e.name.startswith(("Memcpy", "Memset"))]
    us_by_name = Counter()
    for e in events:
        us_by_name[e.name[:80]] += e.time_range.end - e.time_range.start
    cfg = model.config
    kv = batch * seq_len * kv_bytes_per_token(num_layers=cfg.num_hidden_layers,
                                              num_kv_heads=cfg.num_key_value_heads,
                                              head_dim=runner.head_dim, dtype=runner.dtype)
    w = weight_bytes(model)
    roofline_ms = (w + kv) / (copy_bw_gbps * 1e9) * 1e3
    bound = {}
    if matmul_tflops is not None:
        r = step_roofline_ms(w, kv, batch, copy_bw_gbps, matmul_tflops,
                             next(model.parameters()).element_size())
        bound = {"roofline_with_matmul_ms": r,
                 "x_roofline_with_matmul_graph": graph_ms / r if graph_ms else None}
    return {"batch": batch, "seq_len": seq_len, "ms": ms, "graph_ms": graph_ms, **bound,
            "x_roofline_graph": graph_ms / roofline_ms if graph_ms else None,
            "weight_bytes": w, "kv_bytes": kv,
            "roofline_ms": roofline_ms, "x_roofline": ms / roofline_ms,
            "cuda_graph": bool(runner.graphs), "kernels_per_step": len(kernels),
            "kernels_per_layer": len(kernels) / cfg.num_hidden_layers,
            "kernels_by_name": dict(Counter(name[:120] for name in kernels).most_common()),
            "kernel_ms_by_name": {k: v / 1e3 for k, v in us_by_name.most_common(12)}}


#: The prefill and mixed steps timed with and without piecewise graphs (``prefill_step``):
#: (name, prompt chunk lengths, decode rows). The last three are what a step under load mixes.
PREFILL_STEPS = (("prefill_2048", (2048,), 0), ("prefill_8x256", (256,) * 8, 0),
                 ("mixed_512_127", (512,), 127), ("mixed_64_63", (64,), 63),
                 ("mixed_16_15", (16,), 15))


def synthetic_step(engine, prompts: tuple[int, ...], decodes: int, decode_len: int):
    """A ``StepInputs`` for ``engine``: new prompts of ``prompts`` tokens, then ``decodes``
    decode rows at ``decode_len`` cached tokens (token 5 everywhere, every row sampled), on
    distinct blocks while the pool lasts (ids stay inside it: a planned call reads no value
    back, so an id outside the pool would be an illegal memory access)."""
    from paged_ref.engine.runner import StepInputs

    bs, block = engine.block_size, itertools.count()
    step = StepInputs([], [], [], [0], [], [], [])
    for n, start in [(n, 0) for n in prompts] + [(1, decode_len - 1)] * decodes:
        table = [next(block) % engine.num_blocks for _ in range(blocks_needed(start + n, bs))]
        step.input_ids += [5] * n
        step.positions += list(range(start, start + n))
        step.slot_mapping += [table[t // bs] * bs + t % bs for t in range(start, start + n)]
        step.query_start_loc.append(len(step.input_ids))
        step.seq_lens.append(start + n)
        step.block_tables.append(table)
    step.sample_rows = list(range(len(step.seq_lens)))
    return step


def prefill_step(engine, prompts: tuple[int, ...], decodes: int, decode_len: int = 284) -> dict:
    """One prefill or mixed step (:func:`synthetic_step`) through ``runner.execute``, as the
    engine calls it: the wall time per step (host included; each step reads its tokens back)
    and the GPU's busy time, with the runner's piecewise graphs and without (eager), and
    whether both gave the same tokens."""
    from paged_course.timing import wall_ms

    runner, step = engine.runner, synthetic_step(engine, prompts, decodes, decode_len)
    row, tokens, piecewise = {"tokens": len(step.input_ids), "requests": len(step.seq_lens)}, {}, \
        runner.piecewise
    try:
        for mode, graphs in (("piecewise", piecewise), ("eager", None)):
            runner.piecewise = graphs
            tokens[mode] = runner.execute(step)
            busy = busy_seconds(profiled_kernels(lambda: runner.execute(step)))
            row[mode] = {"wall_ms": wall_ms(lambda: runner.execute(step), repeat=20),
                         "busy_ms": busy * 1e3}
    finally:
        runner.piecewise = piecewise
    row["replayed"] = bool(piecewise and piecewise.bucket_of(step))
    row["same_tokens"] = tokens["piecewise"] == tokens["eager"]
    return row


def fit_sweep(model, budgets_tokens, n: int, seed: int, max_len: int, block_size: int = 16):
    """Paged vs reserve-max on the same engine: requests held at once and tok/s per budget."""
    from paged_course.simulate import sample_requests, simulate

    prompts, outputs = workload(n, model.config.vocab_size, seed, output_mean=128,
                                max_len=max_len)
    req = sample_requests(n, seed=seed, prompt_mean=161, output_mean=128, max_len=max_len)
    rows = []
    for budget in budgets_tokens:
        num_blocks = budget // block_size
        for mode in ("paged", "reserve_max"):  # (reserve_max: max_len tokens' blocks each)
            from paged_ref.engine import Engine

            engine = Engine(model, num_blocks=num_blocks, block_size=block_size,
                            max_num_seqs=256, max_model_len=max_len, reservation=mode)
            engine.generate(prompts, outputs, ignore_eos=True)
            s = engine.stats
            rows.append({"kv_budget_tokens": budget, "mode": mode, "max_num_seqs": 256,
                         "max_requests_held": s.max_running,
                         "output_tok_s": s.output_tokens_per_s, "preemptions": s.preemptions,
                         "simulated_mean_running": simulate(
                             "paged" if mode == "paged" else "max", req,
                             max(budget, max_len), block_size).mean_running})
            print(rows[-1], flush=True)
    return rows


def format_sweep(model, budget_mib: float, formats, n: int, seed: int, max_len: int,
                 max_new: int = 128, block_size: int = 16) -> list[dict]:
    """The same KV memory (``budget_mib`` MiB, every layer's K and V, scales included) in each
    cache format ("plain": the model's dtype, or a :class:`paged_ref.KVFormat` name): the blocks
    it buys, then the workload served in them: ``n`` prompts (lesson 01's lengths), ``max_new``
    tokens each, many more than fit at once, so the requests go through in waves. Per format:
    tokens of room, requests held at once, output tok/s, preemptions (lesson 10's "tokens that
    fit", measured), and one CUDA-graph decode step of 256 requests of ``max_len // 2`` tokens
    with the kernels it launches a layer (where a format's step time goes)."""
    from paged_course.timing import copy_bandwidth_gbps
    from paged_ref.engine import Engine
    from paged_ref.quant import KVFormat

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    prompts, _ = workload(n, cfg.vocab_size, seed, max_len=max_len - max_new)
    rows = []
    for name in formats:
        fmt = None if name == "plain" else KVFormat.parse(name)
        per_token = kv_bytes_per_token(num_layers=cfg.num_hidden_layers,
                                       num_kv_heads=cfg.num_key_value_heads, head_dim=head_dim,
                                       dtype=fmt or model.dtype)
        num_blocks = int(budget_mib * 2**20 // (per_token * block_size))
        engine = Engine(model, num_blocks=num_blocks, block_size=block_size, max_num_seqs=256,
                        max_model_len=max_len, kv_format=name if fmt else None)
        engine.generate(prompts[:16], 2, ignore_eos=True)  # compiles and captures (untimed)
        sync()
        engine.generate(prompts, max_new, ignore_eos=True)
        s = engine.stats
        label = name if fmt else str(model.dtype).removeprefix("torch.")
        rows.append({"kv_format": label, "kv_budget_mib": budget_mib,
                     "bytes_per_token": per_token, "num_blocks": num_blocks,
                     "tokens_of_room": num_blocks * block_size,
                     "max_requests_held": s.max_running, "output_tok_s": s.output_tokens_per_s,
                     "output_tokens": s.output_tokens, "preemptions": s.preemptions,
                     "steps": s.steps})
        if engine.runner.graphs and 256 * blocks_needed(max_len // 2, block_size) <= num_blocks:
            step = decode_step(engine, model, 256, max_len // 2, copy_bandwidth_gbps())
            rows[-1].update(decode_graph_ms=step["graph_ms"],
                            decode_kernels_per_layer=step["kernels_per_layer"])
        print(rows[-1], flush=True)
        del engine
    return rows


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), layout="constrained")
    shapes = [r for r in result["throughput"]]
    for j, sysname in enumerate(SYSTEMS):
        vals = [r.get(sysname, {}).get("output_tok_s") or 0 for r in shapes]
        axes[0].bar([i + 0.27 * (j - 1) for i in range(len(shapes))], vals, width=0.27,
                    label=sysname)
    axes[0].set_xticks(range(len(shapes)), [r["shape"] for r in shapes])
    axes[0].set_ylabel("output tokens / s")
    axes[0].set_yscale("log")
    axes[0].legend()
    axes[0].set_title(f"{result['num_requests']} requests, {result['output_len']} new tokens")
    sweep = result.get("fit_sweep", [])
    for mode in ("paged", "reserve_max"):
        rows = [r for r in sweep if r["mode"] == mode]
        axes[1].plot([r["kv_budget_tokens"] for r in rows],
                     [r["max_requests_held"] for r in rows], "o-", label=f"{mode}: held")
    axes[1].set_xlabel("KV budget (tokens)")
    axes[1].set_ylabel("requests held at once")
    axes[1].set_xscale("log", base=2)
    axes[1].legend()
    axes[1].set_title("more requests fit (SmolLM2 shape)")
    fig.suptitle(f"{result['gpu']} · {result['date']}")
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("engine", __doc__, out=".", out_help="folder for engine.json and engine.png")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--static-batch", type=int, default=64)
    p.add_argument("--shapes", type=name_list((*SHAPES, REAL_SMOLLM2), "shape"),
                   default="llama-3.2-1b-like,smollm2-135m",
                   help="from: " + ", ".join((*SHAPES, REAL_SMOLLM2)))
    p.add_argument("--systems", type=name_list(SYSTEMS, "system"), default=",".join(SYSTEMS),
                   help="from: " + ", ".join(SYSTEMS))
    p.add_argument("--scheduler-steps", default="1,8",
                   help="the engine's num_scheduler_steps, one run each (the first: 'engine', "
                        "the others 'engine_steps<K>')")
    p.add_argument("--max-num-batched-tokens", default="2048",
                   help="the engine's token budget per step, one run each with each "
                        "--scheduler-steps (a key after the first: 'engine_steps<K>_tokens<N>')")
    p.add_argument("--budgets", default="4096,8192,16384,32768")
    p.add_argument("--sweep-requests", type=int, default=128)
    p.add_argument("--format-budget-mib", type=float, default=0,
                   help="with > 0: the same KV memory in each of --kv-formats (SmolLM2 shape)")
    p.add_argument("--kv-formats", default="plain,fp8,int4",
                   help="for --format-budget-mib; plain: the model's dtype (bf16)")
    p.add_argument("--format-requests", type=int, default=1024,
                   help="for --format-budget-mib: requests, --output-len new tokens each")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA GPU here: the engine benchmark runs on a GPU (committed results: "
              "results/h200/engine.json)")
        return 0
    from paged_course.timing import copy_bandwidth_gbps, matmul_tflops

    args.out.mkdir(parents=True, exist_ok=True)
    result = {**environment(), "num_requests": args.num_requests,
              "output_len": args.output_len, "copy_bw_gbps": copy_bandwidth_gbps(),
              "matmul_tflops": matmul_tflops(),
              "throughput": [], "decode_step": [], "fit_sweep": []}
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError:
        pass

    def save():
        write_result(result, args.out / "engine.json")

    for shape in args.shapes:
        model = build_model(shape)
        prompts, _ = workload(args.num_requests, model.config.vocab_size, seed=0)
        longest = max(len(p) for p in prompts) + args.output_len
        num_blocks = sum(blocks_needed(len(p) + args.output_len, 16) for p in prompts) + 64
        row = {"shape": shape, "mean_prompt": sum(map(len, prompts)) / len(prompts),
               "kv_budget_tokens": num_blocks * 16}
        result["throughput"].append(row)
        for name in args.systems:
            try:
                if name == "engine":
                    budgets = [int(m) for m in args.max_num_batched_tokens.split(",")]
                    steps = [int(k) for k in args.scheduler_steps.split(",")]
                    for i, (m, k) in enumerate((m, k) for m in budgets for k in steps):
                        key = "engine" if i == 0 else f"engine_steps{k}" + (
                            f"_tokens{m}" if m != budgets[0] else "")
                        engine, row[key] = run_engine(
                            model, prompts, args.output_len, num_blocks, num_scheduler_steps=k,
                            max_num_batched_tokens=m)
                        print(shape, key, row[key], flush=True)
                    for batch in (64, 256):
                        result["decode_step"].append({"shape": shape, **decode_step(
                            engine, model, batch, int(row["mean_prompt"]) + args.output_len,
                            result["copy_bw_gbps"], result["matmul_tflops"])})
                    for step_name, chunks, decodes in PREFILL_STEPS:
                        result.setdefault("prefill_step", []).append(
                            {"shape": shape, "step": step_name,
                             **prefill_step(engine, chunks, decodes)})
                    del engine
                elif name == "static_generate":
                    row[name] = run_static(model, prompts, args.output_len, args.static_batch)
                    row[name]["reserved_tokens_per_request"] = longest
                elif name == "generate_batch":
                    row[name] = run_generate_batch(model, prompts, args.output_len)
            except Exception as err:  # keep the other systems' numbers
                row[name] = {"error": f"{type(err).__name__}: {err}"}
            print(shape, name, row[name], flush=True)
            torch.cuda.empty_cache()
            save()
        base = (row.get("generate_batch") or {}).get("output_tok_s")
        for key in [k for k in row if k.startswith("engine")]:
            if base and "output_tok_s" in row[key]:
                row[f"{key}_vs_generate_batch"] = row[key]["output_tok_s"] / base
        save()
        del model
        torch.cuda.empty_cache()
    if args.budgets:
        model = build_model("smollm2-135m")
        budgets = [int(b) for b in args.budgets.split(",")]
        result["fit_sweep"] = fit_sweep(model, budgets, args.sweep_requests, seed=1,
                                        max_len=512)
        save()
    if args.format_budget_mib > 0:
        model = build_model("smollm2-135m")
        result["format_sweep"] = format_sweep(model, args.format_budget_mib,
                                              args.kv_formats.split(","), args.format_requests,
                                              seed=2, max_len=1024, max_new=args.output_len)
        save()
    plot(result, args.out / "engine.png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
