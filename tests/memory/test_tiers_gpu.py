"""The three tiers on a CUDA GPU (skipped without one): blocks pushed from the GPU to the disk,
read back into pinned memory on the tier's threads and copied to the GPU bit for bit; and the
tiers suite's quick run there."""

from __future__ import annotations

import json

import pytest
import torch

from paged_ref import KVCacheManager, PagedKVCache
from paged_ref.memory.disk_tier import DiskTier

pytestmark = pytest.mark.gpu  # (tests/conftest.py: skipped without a CUDA GPU)


@pytest.mark.parametrize("workers", [0, 4])
def test_a_prefix_goes_down_to_the_disk_and_comes_back_to_the_gpu(tmp_path, workers):
    layers, bs, heads, dim, n = 4, 16, 2, 64, 40
    with DiskTier(tmp_path, n, (2, layers, bs, heads, dim), torch.bfloat16,
                  workers=workers) as disk:
        assert disk.pin_memory
        m = KVCacheManager(n + 2, bs, enable_prefix_caching=True, num_host_blocks=1,
                           disk_tier=disk)
        cache = PagedKVCache(layers, n + 2, bs, heads, dim, dtype=torch.bfloat16, device="cuda",
                             num_host_blocks=1, disk_tier=disk)
        prompt = torch.randint(0, 50000, (n * bs + 1,)).tolist()
        m.add_sequence("a", token_ids=prompt)
        cache.apply_block_ops(m.take_block_ops())
        table = m.block_table("a")[:n]
        cache.kv[:, :, table] = torch.randn_like(cache.kv[:, :, table])
        written = cache.kv[:, :, table].clone()
        m.free_sequence("a")
        m.add_sequence("hog", (n + 2) * bs)
        ops = m.take_block_ops()
        assert len(ops.device_to_disk) == n - 1  # all but the most recent: pushed off the host
        cache.apply_block_ops(ops)
        m.free_sequence("hog")
        disk.drop_page_cache()
        assert m.prefetch(prompt) == (n - 1 if workers else 0)
        assert m.add_sequence("b", token_ids=prompt) == n * bs
        ops = m.take_block_ops()
        assert all(block.is_pinned() for block, _ in ops.from_disk)
        cache.apply_block_ops(ops)
        torch.cuda.synchronize()
        assert torch.equal(cache.kv[:, :, m.block_table("b")[:n]], written)
        st = m.stats()
        assert st.prefix_disk_hit_tokens == (n - 1) * bs and st.prefix_host_hit_tokens == bs


def test_the_tiers_suite_quick_run_on_the_gpu(tmp_path):
    from paged_bench import tiers

    out = tmp_path / "tiers.json"
    assert tiers.main(["--quick", "--prefixes", "256,1024", "--reps", "2", "--out", str(out),
                       "--disk-path", str(tmp_path)]) == 0
    data = json.loads(out.read_text())
    assert data["gpu"] == torch.cuda.get_device_name()
    assert {r["backend"] for r in data["results"]} >= {"disk_cold", "host", "recompute"}
