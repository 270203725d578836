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
