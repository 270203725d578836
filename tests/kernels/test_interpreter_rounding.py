"""What docs/troubleshooting.md says of Triton's interpreter, checked: it rounds float32 ->
bfloat16 toward zero (a GPU rounds to nearest even), which doubles a bfloat16 kernel's error on
a CPU. If a Triton upgrade changes that, this fails and that note must change."""

from __future__ import annotations

import pytest
import torch

from paged_ref import _device

pytestmark = pytest.mark.skipif(not _device.INTERPRET, reason="about the interpreter (CPU)")


def test_interpreter_rounds_float32_to_bfloat16_toward_zero():
    import triton
    import triton.language as tl

    @triton.jit
    def to_bf16(x_ptr, y_ptr, N: tl.constexpr):
        offs = tl.arange(0, N)
        tl.store(y_ptr + offs, tl.load(x_ptr + offs).to(tl.bfloat16))

    x = torch.randn(4096, generator=torch.Generator().manual_seed(0))
    y = torch.empty(4096, dtype=torch.bfloat16)
    to_bf16[(1,)](x, y, N=4096)
    toward_zero = (x.view(torch.int32) & ~0xFFFF).view(torch.float32).to(torch.bfloat16)
    assert torch.equal(y, toward_zero)
    assert not torch.equal(y, x.to(torch.bfloat16))  # torch (and a GPU) round to nearest
