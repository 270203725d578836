"""The engine over a quantised KV cache (``Engine(..., kv_format=...)``), on a tiny random Llama.

A token's codes and scales depend on its own K/V only, so how the scheduler cuts the work
(block size, chunked prefill, prefix-cache hits, preemption) must not change the output."""

from __future__ import annotations

import copy

import pytest

from paged_ref import _device

pytest.importorskip("transformers")

from paged_bench.engine import workload  # noqa: E402
from paged_ref.engine import Engine  # noqa: E402


@pytest.mark.parametrize("fmt", ["fp8", "fp8_token_head", "int4"])
def test_quantised_cache_output_does_not_depend_on_scheduling(tiny, fmt):
    prompts, outputs = workload(6, tiny.config.vocab_size, seed=4, prompt_mean=20,
                                output_mean=8, max_len=40)
    prompts[1] = prompts[0][:16] + prompts[1]  # a shared first block: a prefix-cache hit
    runs = [Engine(tiny, kv_format=fmt, **config).generate(prompts, outputs, ignore_eos=True)
            for config in (dict(num_blocks=64, block_size=16),
                           dict(num_blocks=14, block_size=4, max_num_batched_tokens=24))]
    assert runs[0] == runs[1]
    assert [len(o) for o in runs[0]] == outputs


def test_quantised_cache_changes_little(tiny):
    prompts, outputs = workload(4, tiny.config.vocab_size, seed=5, prompt_mean=20,
                                output_mean=8, max_len=40)
    plain = Engine(tiny, num_blocks=64).generate(prompts, outputs, ignore_eos=True)
    fp8 = Engine(tiny, num_blocks=64, kv_format="fp8").generate(prompts, outputs,
                                                                ignore_eos=True)
    same = sum(a == b for p, q in zip(plain, fp8, strict=True) for a, b in zip(p, q, strict=True))
    assert same >= 0.5 * sum(outputs), f"fp8 cache: only {same} of {sum(outputs)} tokens agree"


@pytest.mark.parametrize("fmt", ["fp8", "fp8_token_head"])
def test_triton_kernels_on_a_quantised_cache_match_torch(tiny, fmt, monkeypatch):
    """Prefill and decode through the Triton kernels (the interpreter here), de-quantising in
    registers, give the tokens of the torch backend (which de-quantises the gathered cache)."""
    from paged_ref.kernels.triton import prefill as triton_prefill

    prompts, outputs = workload(3, tiny.config.vocab_size, seed=6, prompt_mean=20,
                                output_mean=4, max_len=30)
    calls = []
    run = triton_prefill.paged_prefill_triton
    monkeypatch.setattr(triton_prefill, "paged_prefill_triton",
                        lambda *a, **k: calls.append(1) or run(*a, **k))
    model = copy.deepcopy(tiny).to(_device.triton_device())  # (compiled kernels on a GPU)
    runs = [Engine(model, num_blocks=32, block_size=8, kv_format=fmt, attention_backend=backend)
            .generate(prompts, outputs, ignore_eos=True) for backend in ("torch", "triton")]
    assert calls, "the engine's prefill did not run the Triton kernel"
    assert runs[0] == runs[1]
