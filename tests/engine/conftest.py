"""Fixtures of the engine tests: one torch thread, the tiny random Llama (checks in
``tests/engine/checks.py``).

One thread: the suite runs two test processes on two cores, and small models' matmuls gain
nothing from a second thread (they lose a lot when cores are busy)."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    """A random-weight Llama (2 layers, hidden 64, 4 / 2 heads of 16, vocabulary 256), float32,
    CPU; its EOS is id 2 (``model.config``)."""
    pytest.importorskip("transformers")
    from paged_bench.engine import build_model

    return build_model("tiny", dtype=torch.float32, device="cpu", seed=1)


@pytest.fixture(scope="module")
def varied():
    """``tiny``'s shape with weights 15x larger, so its greedy tokens vary (``tiny``'s repeat
    one token, which hides a token recorded one place off); no EOS in its generation config."""
    pytest.importorskip("transformers")
    from transformers import LlamaConfig, LlamaForCausalLM

    from paged_bench.engine import SHAPES

    cfg = LlamaConfig(**SHAPES["tiny"], max_position_embeddings=512, initializer_range=0.3,
                      rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model
