"""No first-call stall on a CUDA GPU (skipped without one): an engine built in a fresh process
with an empty Triton cache compiles everything while it is built (CUDA graphs, then
``warmup``), so its first ``generate`` writes nothing to Triton's cache (no kernel compiled),
whatever its steps' shapes: long prompts, chunked ones, short ones, mixed with decodes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = """
import json, sys
import torch
from paged_bench.engine import build_model
from paged_bench.warmup import timed_generate, triton_cache_files
from paged_ref.engine import Engine

warm = sys.argv[1] == "warm"
model = build_model("smollm2-135m", dtype=torch.bfloat16)
gen = torch.Generator().manual_seed(0)
lens = [1, 2, 3, 5, 16, 17, 40, 130, 300, 700]  # short and long; 700 > the budget: chunked
prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lens * 3]
engine = Engine(model, num_blocks=1200, block_size=16, max_num_seqs=16,
                max_num_batched_tokens=512, warmup=warm)
built = len(triton_cache_files())
first = timed_generate(engine, prompts, 24)
second = timed_generate(engine, prompts, 24)
print(json.dumps({"warmup_s": engine.warmup_seconds, "files_after_build": built,
                  "first": first, "second": second}))
"""


def _run(mode: str, tmp_path: Path) -> dict:
    cache = tmp_path / f"triton_cache_{mode}"
    cache.mkdir()
    env = {**os.environ, "TRITON_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", SCRIPT, mode], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_gpu_first_generate_compiles_nothing_after_warmup(tmp_path):
    r = _run("warm", tmp_path)
    print(f"warm-up {r['warmup_s']:.2f} s; first {r['first']['seconds']:.2f} s, second "
          f"{r['second']['seconds']:.2f} s")
    assert r["warmup_s"] > 0 and r["files_after_build"] > 0
    assert r["first"]["triton_files_written"] == 0, r["first"]["triton_files"]
    assert r["second"]["triton_files_written"] == 0


def test_gpu_without_warmup_the_first_generate_compiles(tmp_path):
    """The check above can fail: without warm-up the first generate compiles prefill kernels."""
    r = _run("cold", tmp_path)
    assert r["warmup_s"] == 0.0
    assert r["first"]["triton_files_written"] > 0
    assert r["second"]["triton_files_written"] == 0
