"""The engine over three tiers on a CUDA GPU (skipped without one): warmed up at construction
(the disk tier left untouched), decode steps in CUDA graphs, blocks pushed from the GPU to
pinned host memory and on to the disk, read back on the tier's threads, and greedy tokens equal
to transformers' (float32, a random-weight SmolLM2-135M shape)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu  # (tests/conftest.py: skipped without a CUDA GPU)
pytest.importorskip("transformers")


def test_three_tiers_on_the_gpu_give_transformers_tokens(tmp_path):
    from paged_bench.engine import build_model
    from paged_ref.engine import Engine

    model = build_model("smollm2-135m", dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    heads = [torch.randint(3, 49152, (64,), generator=gen).tolist() for _ in range(4)]
    prompts = [h + torch.randint(3, 49152, (int(n),), generator=gen).tolist()
               for r in range(3) for h, n in zip(heads, torch.randint(1, 20, (4,)), strict=True)]
    n = 12
    expected = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False)
        expected.append(out[0, len(p):].tolist())
    engine = Engine(model, num_blocks=14, block_size=16, max_num_seqs=2,
                    max_num_batched_tokens=96, num_host_blocks=2, disk_path=tmp_path,
                    num_disk_blocks=64)  # (on a CPU: 512 of the hits come from the disk)
    disk = engine.disk_tier
    assert engine.warmup_seconds > 0 and engine.runner.graphs and disk.pin_memory
    assert (len(disk), disk.bytes_written, disk.bytes_read) == (0, 0, 0)  # (warm-up's dummies)
    assert engine.generate(prompts, n, ignore_eos=True) == expected
    st = engine.scheduler.manager.stats()
    print(st)
    assert st.prefix_disk_hit_tokens > 0
    assert st.disk_read_errors == st.disk_write_errors == 0
    assert engine.generate(prompts, n, ignore_eos=True) == expected
    disk.close()
