"""Probe: host time per phase of the engine's steps on the GPU machine (256 x 128, 1B-like):
each phase wrapped in perf_counter, no sync added. ``python tools/gpu/engine_phases_probe.py``
on the H200 (PYTHONPATH=$PWD). Its finding: docs/lab_notes.md, "Engine"."""
import collections
import time

import torch

from paged_bench.engine import build_model, workload
from paged_ref.cache_math import blocks_needed
from paged_ref.engine import Engine
from paged_ref.engine import runner as runner_module

model = build_model("llama-3.2-1b-like")
prompts, _ = workload(256, model.config.vocab_size, seed=0)
nb = sum(blocks_needed(len(q) + 128, 16) for q in prompts) + 64
eng = Engine(model, num_blocks=nb, block_size=16, max_num_seqs=256)
T = collections.defaultdict(float)
N = collections.Counter()


def timed(obj, name, label):
    real = getattr(obj, name)

    def f(*a, **k):
        t = time.perf_counter()
        try:
            return real(*a, **k)
        finally:
            T[label] += time.perf_counter() - t
            N[label] += 1
    setattr(obj, name, f)


timed(eng.scheduler, "schedule", "schedule")
timed(eng.scheduler, "update", "update")
timed(eng, "_layout", "layout")
timed(eng.runner, "execute", "execute")
timed(eng.runner, "_run", "run")
timed(eng.runner, "_replay", "replay")
timed(eng.runner, "forward", "forward")
timed(runner_module, "padded_tables", "padded_tables")
timed(eng.cache if hasattr(eng, "cache") else eng.runner.cache, "apply_block_ops", "block_ops")
for g in eng.runner.graphs.values():
    timed(g, "replay", "graph.replay")

eng.generate(prompts, 128, ignore_eos=True, progress=False)
for _ in range(2):  # (the first of two: a warm-up)
    T.clear()
    N.clear()
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.generate(prompts, 128, ignore_eos=True, progress=False)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    print(f"wall {wall:.3f} s, steps {eng.stats.steps}")
    for k, v in sorted(T.items(), key=lambda kv: -kv[1]):
        print(f"  {k:>14}: {v * 1e3:8.1f} ms total, {N[k]:5d} calls, "
              f"{v / max(N[k], 1) * 1e3:.3f} ms/call")
