"""Two CUDA GPUs (NCCL): a sequence moved between GPUs decodes exactly as on one GPU."""

from __future__ import annotations

import pytest
import torch

from paged_course import two_ranks
from paged_ref import transfer

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def test_tiny_decode_after_nccl_transfer_equals_one_gpu():
    res = two_ranks.run_two_ranks(two_ranks.demo_tiny_disaggregated, backend="nccl",
                                  prompt_len=301, steps=8, block_size=16, modes=transfer.MODES)
    alone = two_ranks.tiny_single_process(prompt_len=301, steps=8, block_size=16,
                                          device="cuda:1")
    for mode in transfer.MODES:
        assert res[0][mode]["table"] != res[1][mode]["table"]
        assert torch.equal(res[1][mode]["outputs"], alone), mode


def test_engine_tokens_after_nccl_transfer_equal_one_gpu():
    """A SmolLM2-shaped random-weight model in bf16: rank 0's engine prefills, the blocks move
    to cuda:1 through NCCL, rank 1's engine decodes; tokens equal one engine on cuda:1."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in (700, 129, 1500)]
    kw = dict(prompts=prompts, max_new_tokens=32, model_fn=two_ranks.smollm2_shape_random,
              num_blocks=512)
    res = two_ranks.run_two_ranks(two_ranks.demo_engine_disaggregated, backend="nccl", **kw)
    alone = two_ranks.engine_single_process(device="cuda:1", **kw)
    assert res[1]["outputs"] == alone
    assert res[1]["cached_tokens"] == sum((n - 1) // 16 * 16 for n in (700, 129, 1500))
