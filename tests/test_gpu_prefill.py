"""The Triton prefill and store kernels compiled on a CUDA GPU (skipped without one), against
float64: the kinds of cases of the interpreter tests, plus GPU-only sizes (long prompts, a
cached prefix of thousands of tokens, offsets past 2^31 elements) and every swept tile shape."""

from __future__ import annotations

import pytest
import torch

from paged_bench.prefill import SWEEP
from paged_course.checks import assert_close, assert_equal
from paged_course.testing import make_prefill_inputs
from paged_ref import KVFormat, QuantizedKV, paged_prefill, write_kv
from paged_ref.kernels.triton.prefill import PrefillConfig, paged_prefill_triton
from paged_ref.prefill import prefill_attention_torch

pytestmark = pytest.mark.gpu  # (tests/conftest.py: skipped without a CUDA GPU)

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
CASES = [
    # seq_lens, query_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, causal
    ([0, 1, 31, 32, 33, 300, 17], [0, 1, 31, 32, 33, 129, 1], 32, 8, 128, 16, BF16, True),
    ([700, 65, 64], [63, 65, 1], 8, 8, 64, 1, F16, True),
    ([200, 99], [100, 98], 6, 2, 80, 5, F32, True),
    ([513, 128], [257, 128], 16, 2, 96, 16, BF16, True),
    ([300, 40], [150, 40], 4, 2, 256, 16, BF16, True),
    ([400, 90, 1], [130, 7, 1], 32, 8, 128, 32, BF16, False),
    ([5000], [2000], 32, 8, 128, 16, BF16, True),
]


def float64_answer(inp, causal=True):
    """The torch backend in float64 on the GPU (checked against the CPU float64 loop by the
    interpreter tests): fast enough for thousands of rows. A quantised cache: the answer for
    the values it stands for."""
    k, v = (c.dequantize(torch.float64) if isinstance(c, QuantizedKV) else c.double()
            for c in (inp.k_cache, inp.v_cache))
    return prefill_attention_torch(inp.q.double(), k, v, inp.block_tables, inp.seq_lens,
                                   inp.query_start_loc, causal=causal)


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("poison", ["large", "nan"])
def test_gpu_prefill_matches_float64(case, poison):
    lens, qlens, hq, hkv, d, bs, dtype, causal = CASES[case]
    inp = make_prefill_inputs(lens, qlens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                              block_size=bs, dtype=dtype, device="cuda", seed=case,
                              poison=poison)
    out = paged_prefill(*inp.args(), causal=causal, backend="auto")
    assert_close(out, float64_answer(inp, causal), name=f"case {case}")


@pytest.mark.parametrize("config", [*SWEEP, (16, 64, 4, 3)], ids=str)
def test_gpu_every_tile_shape(config):
    inp = make_prefill_inputs([2100, 700, 130], [1100, 700, 3], num_q_heads=32, num_kv_heads=8,
                              head_dim=128, dtype=BF16, device="cuda", seed=1, poison="nan")
    out = paged_prefill_triton(*inp.args(), config=PrefillConfig(*config))
    assert_close(out, float64_answer(inp), name=str(config))


def test_gpu_offsets_past_2_to_the_31():
    """A cache of more than 2^31 elements: block id x block stride overflows int32."""
    hkv, d, bs = 8, 128, 16
    num_blocks = (2**31) // (bs * hkv * d) + 64
    k = torch.randn(num_blocks, bs, hkv, d, dtype=BF16, device="cuda")
    v = torch.randn_like(k)
    table = torch.arange(num_blocks - 40, num_blocks, dtype=torch.int32, device="cuda")
    table = table.flip(0)[None].contiguous()
    seq_lens = torch.tensor([40 * bs - 3], dtype=torch.int32, device="cuda")
    q = torch.randn(300, 32, d, dtype=BF16, device="cuda")
    starts = torch.tensor([0, 300], dtype=torch.int32, device="cuda")
    out = paged_prefill(q, k, v, table, seq_lens, starts, backend="triton")
    compact = torch.arange(40, dtype=torch.int32, device="cuda")[None]
    kk, vv = k[table[0].long()].double(), v[table[0].long()].double()
    ref = prefill_attention_torch(q.double(), kk, vv, compact, seq_lens, starts)
    assert_close(out, ref)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_gpu_write_kv(backend):
    k_cache = torch.randn(64, 16, 8, 128, dtype=BF16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    k = torch.randn(300, 8, 128, dtype=BF16, device="cuda")
    v = torch.randn_like(k)
    slots = torch.randperm(1024, device="cuda")[:300].to(torch.int32)
    write_kv(k, v, k_cache, v_cache, slots, backend=backend)
    assert_equal(k_cache.view(-1, 8, 128)[slots.long()], k, name="k rows")
    assert_equal(v_cache.view(-1, 8, 128)[slots.long()], v, name="v rows")


@pytest.mark.parametrize("lens", [[1, 300, 4097, 17], [30000, 5]])
def test_gpu_one_row_per_sequence_is_decode(lens):
    """backend="auto" hands a batch of single query rows to the decode kernels."""
    inp = make_prefill_inputs(lens, [1] * len(lens), num_q_heads=32, num_kv_heads=8,
                              head_dim=128, dtype=BF16, device="cuda", seed=3, poison="nan")
    for backend in ("auto", "triton"):
        out = paged_prefill(*inp.args(), backend=backend)
        assert_close(out, float64_answer(inp), name=backend)


def test_gpu_negative_scale():
    inp = make_prefill_inputs([300, 40], [200, 40], num_q_heads=32, num_kv_heads=8,
                              head_dim=128, dtype=BF16, device="cuda", seed=4)
    out = paged_prefill(*inp.args(), scale=-0.05)
    ref = prefill_attention_torch(inp.q.double(), inp.k_cache.double(), inp.v_cache.double(),
                                  inp.block_tables, inp.seq_lens, inp.query_start_loc,
                                  scale=-0.05)
    assert_close(out, ref)


QUANT_FORMATS = ["fp8", "fp8_token_head", "int4", "int4_g64"]


def _storable(fmt: str, head_dim: int) -> bool:
    try:
        KVFormat.parse(fmt).check_head_dim(head_dim)  # int4_g64 cannot hold head_dim 96
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("fmt, case", [(f, c) for f in QUANT_FORMATS for c in (0, 1, 3, 5, 6)
                                       if _storable(f, CASES[c][4])])
def test_gpu_prefill_over_quantised_cache(case, fmt):
    """The kernel compiled, de-quantising FP8 / INT4 tiles in registers (case 3's head_dim 96
    is not an INT4 one the kernels read: ``auto`` takes the torch backend there)."""
    lens, qlens, hq, hkv, d, bs, dtype, causal = CASES[case]
    inp = make_prefill_inputs(lens, qlens, num_q_heads=hq, num_kv_heads=hkv, head_dim=d,
                              block_size=bs, dtype=dtype, device="cuda", seed=case,
                              poison="nan").quantized(fmt)
    out = paged_prefill(*inp.args(), causal=causal, backend="auto")
    assert_close(out, float64_answer(inp, causal), name=f"{fmt} case {case}")


@pytest.mark.parametrize("config", [*SWEEP, (16, 64, 4, 3)], ids=str)
@pytest.mark.parametrize("fmt", ["fp8_token_head", "int4"])
def test_gpu_quantised_every_tile_shape(config, fmt):
    inp = make_prefill_inputs([2100, 700, 130], [1100, 700, 3], num_q_heads=32, num_kv_heads=8,
                              head_dim=128, dtype=BF16, device="cuda", seed=2,
                              poison="nan").quantized(fmt)
    out = paged_prefill_triton(*inp.args(), config=PrefillConfig(*config))
    assert_close(out, float64_answer(inp), name=f"{fmt} {config}")


@pytest.mark.parametrize("fmt", ["fp8", "int4"])
def test_gpu_one_row_per_sequence_over_quantised_cache_runs_cuda_decode(fmt, monkeypatch):
    """backend="auto" hands single query rows over an FP8 / INT4 cache to the decode kernels
    that read it fastest (the CUDA ones); "triton" keeps them in the prefill kernel."""
    from paged_ref.kernels.cuda import CudaDecodePlan, cuda_kernels_available

    if not cuda_kernels_available():
        pytest.skip("no nvcc for the CUDA FP8 / INT4 kernels")
    inp = make_prefill_inputs([1, 300, 4097, 17], [1] * 4, num_q_heads=32, num_kv_heads=8,
                              head_dim=128, dtype=BF16, device="cuda", seed=4,
                              poison="nan").quantized(fmt)
    calls = []
    run = CudaDecodePlan.run
    monkeypatch.setattr(CudaDecodePlan, "run",
                        lambda self, *a, **k: calls.append(1) or run(self, *a, **k))
    for backend in ("auto", "triton"):
        out = paged_prefill(*inp.args(), backend=backend)
        assert_close(out, float64_answer(inp), name=f"{fmt} {backend}")
    assert len(calls) == 1, "auto should run the CUDA decode kernel once, triton never"
