"""A Triton backend handed tensors it cannot run on is a ValueError that names the argument and
says what to do, before anything is launched: never Triton's own "Pointer argument (at 0)
cannot be accessed from Triton (cpu tensor?)".

The decision lives in one function, :func:`paged_ref._device.triton_runs_on`: in Triton's
interpreter CPU tensors only, compiled CUDA tensors only. Here (a CPU) the tests switch the
interpreter off in that function's eyes (``_device.INTERPRET = False``), which is what a GPU
machine looks like to a caller with CPU tensors; on a GPU machine they run as they are.
"""

from __future__ import annotations

import pytest
import torch

from paged_course.testing import make_paged_inputs, make_prefill_inputs
from paged_ref import _device, paged_attention, paged_prefill, plan_decode, write_kv
from tests.mutations.mutate import mutant_of

SHAPE = dict(num_q_heads=4, num_kv_heads=2, head_dim=16, block_size=4)


def as_compiled(monkeypatch) -> None:
    """Triton as on a GPU machine: compiled, so CPU tensors cannot be read."""
    monkeypatch.setattr(_device, "INTERPRET", False)
    monkeypatch.setattr(_device, "HAS_TRITON", True)


@pytest.fixture
def compiled(monkeypatch):
    as_compiled(monkeypatch)


def refusal(call) -> str:
    """The message of the ValueError ``call()`` raises, else what it did instead."""
    try:
        call()
    except ValueError as e:
        return str(e)
    except Exception as e:  # (Triton's own error, or a torch one)
        return f"not a ValueError: {type(e).__name__}: {e}"
    return "no error: it ran"


def _attention(backend):
    inp = make_paged_inputs([5, 9], seed=1, **SHAPE)
    return lambda: paged_attention(*inp.args(), backend=backend)


def _plan(backend):
    return lambda: plan_decode([5, 9], dtype=torch.float32, device="cpu", backend=backend,
                               **SHAPE)


def _prefill(backend):
    inp = make_prefill_inputs([7, 12], [3, 12], seed=2, **SHAPE)
    return lambda: paged_prefill(*inp.args(), backend=backend)


def _write(backend):
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 6, 4, 2, 16, generator=gen)
    k, v = torch.randn(2, 5, 2, 16, generator=gen)
    slots = torch.randperm(24, generator=gen)[:5]
    before = k_cache.clone(), v_cache.clone()

    def call():
        try:
            write_kv(k, v, k_cache, v_cache, slots, backend=backend)
        finally:
            assert torch.equal(k_cache, before[0]) and torch.equal(v_cache, before[1]), \
                "the caches were written"
    return call


def _fused(op):
    pytest.importorskip("transformers")
    from paged_ref.models import fused

    gen = torch.Generator().manual_seed(4)
    if op == "add_rms_norm":
        h, delta = torch.randn(2, 3, 24, generator=gen)
        return lambda: fused.add_rms_norm(h, delta, torch.ones(24), 1e-5, backend="triton")
    if op == "silu_mul":
        return lambda: fused.silu_mul(torch.randn(3, 32, generator=gen), backend="triton")
    qkv = torch.randn(3, (4 + 2 * 2) * 16, generator=gen)
    cos, sin = torch.randn(2, 3, 16, generator=gen)
    k_cache = torch.zeros(4, 4, 2, 16)
    return lambda: fused.rope_write_kv(qkv, cos, sin, k_cache, k_cache.clone(),
                                       torch.arange(3), 4, backend="triton")


# (id, call, the argument the message names)
CASES = [
    ("paged_attention_triton", lambda: _attention("triton"), "q"),
    ("paged_attention_triton_split", lambda: _attention("triton_split"), "q"),
    ("plan_decode_triton", lambda: _plan("triton"), "device"),
    ("plan_decode_triton_split", lambda: _plan("triton_split"), "device"),
    ("paged_prefill_triton", lambda: _prefill("triton"), "q"),
    ("write_kv_triton", lambda: _write("triton"), "k"),
    ("fused_add_rms_norm", lambda: _fused("add_rms_norm"), "h"),
    ("fused_rope_write_kv", lambda: _fused("rope_write_kv"), "qkv"),
    ("fused_silu_mul", lambda: _fused("silu_mul"), "gate_up"),
]


def assert_clear(message: str, name: str) -> None:
    assert f"{name} is on cpu" in message, message
    assert "move the tensors to the GPU" in message and "backend='torch'" in message, message


@pytest.mark.skipif(torch.cuda.is_available() and _device.INTERPRET,
                    reason="the interpreter is on with a GPU: CPU tensors are what it reads")
@pytest.mark.parametrize("case, name", [(c[1], c[2]) for c in CASES], ids=[c[0] for c in CASES])
def test_cpu_tensors_on_compiled_triton_are_a_clear_value_error(case, name, monkeypatch):
    if not (torch.cuda.is_available() and not _device.INTERPRET):
        as_compiled(monkeypatch)  # a CPU machine seen as a GPU one
    assert_clear(refusal(case()), name)


def test_auto_runs_torch_on_cpu_tensors(compiled):
    """``"auto"`` picks what runs on the tensors: torch, never the refused Triton."""
    inp = make_paged_inputs([5, 9], seed=5, **SHAPE)
    out = paged_attention(*inp.args(), backend="auto")
    torch.testing.assert_close(out.double(), inp.reference(), atol=1e-5, rtol=1e-5)
    pre = make_prefill_inputs([7, 12], [3, 12], seed=6, **SHAPE)
    torch.testing.assert_close(paged_prefill(*pre.args()).double(), pre.reference(),
                               atol=1e-5, rtol=1e-5)


def test_the_one_decision(monkeypatch):
    """In the interpreter: CPU tensors only; compiled: CUDA tensors only; no triton: none."""
    monkeypatch.setattr(_device, "HAS_TRITON", True)
    monkeypatch.setattr(_device, "INTERPRET", True)
    assert [_device.triton_runs_on(d) for d in ("cpu", "cuda", "cuda:1", "meta")] == \
        [True, False, False, False]
    monkeypatch.setattr(_device, "INTERPRET", False)
    assert [_device.triton_runs_on(torch.device(d)) for d in ("cpu", "cuda", "cuda:1", "meta")] \
        == [False, True, True, False]
    assert _device.compiled_triton_on("cuda:0") and not _device.compiled_triton_on("cpu")
    monkeypatch.setattr(_device, "HAS_TRITON", False)
    assert not any(_device.triton_runs_on(d) for d in ("cpu", "cuda"))
    with pytest.raises(RuntimeError, match="triton package"):
        _device.check_triton_device("triton", "q", "cpu")


def test_cuda_tensors_in_the_interpreter_are_refused_too(monkeypatch):
    """The interpreter on (TRITON_INTERPRET=1 on a GPU machine): CUDA tensors are refused
    with the other advice."""
    monkeypatch.setattr(_device, "HAS_TRITON", True)
    monkeypatch.setattr(_device, "INTERPRET", True)
    message = refusal(lambda: _device.check_triton_device("triton", "q", "cuda:0"))
    assert "q is on cuda:0" in message and "interpreter" in message and ".cpu()" in message


def test_planted_old_rule_is_caught(tmp_path, monkeypatch):
    """The rule before this fix: Triton takes CPU tensors whenever there is no GPU, whether or
    not the interpreter is on. On a machine whose Triton is compiled that lets CPU tensors
    through to the kernel: caught."""
    mutant = mutant_of(_device, [(
        'return torch.device(device).type == ("cpu" if INTERPRET else "cuda")',
        'return torch.device(device).type == triton_device()')], tmp_path, monkeypatch)
    as_compiled(monkeypatch)
    monkeypatch.setattr(mutant, "INTERPRET", False)
    monkeypatch.setattr(mutant, "HAS_CUDA", False)  # as here; on a GPU machine it is True
    monkeypatch.setattr(mutant, "HAS_TRITON", True)
    monkeypatch.setattr(_device, "triton_runs_on", mutant.triton_runs_on)
    if torch.cuda.is_available():
        pytest.skip("on a GPU machine the old rule gave the right answer for CPU tensors here")
    for _, case, name in CASES[:2] + CASES[4:7]:
        with pytest.raises(AssertionError):
            assert_clear(refusal(case()), name)
