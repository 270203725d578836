"""Two CUDA GPUs (NCCL): a sequence moved between GPUs decodes exactly as on one GPU."""

from __future__ import annotations

import pytest
import torch

from paged_ref import transfer
from paged_ref.course import two_ranks

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")


def test_tiny_decode_after_nccl_transfer_equals_one_gpu():
    res = two_ranks.run_two_ranks(two_ranks.demo_tiny_disaggregated, backend="nccl",
                                  prompt_len=301, steps=8, block_size=16, modes=transfer.MODES)
    alone = two_ranks.tiny_single_process(prompt_len=301, steps=8, block_size=16,
                                          device="cuda:1")
    for mode in transfer.MODES:
        assert res[0][mode]["table"] != res[1][mode]["table"]
        assert torch.equal(res[1][mode]["outputs"], alone), mode
