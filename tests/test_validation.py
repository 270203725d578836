"""Bad inputs to ``paged_attention`` raise a clear exception that names the argument.

``TypeError`` for a wrong type or dtype, ``ValueError`` for a wrong shape, device, layout or
value (docs/contract.md). Each case starts from valid inputs and breaks exactly one thing.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from paged_course.checks import assert_close
from paged_course.testing import make_paged_inputs
from paged_ref import paged_attention
from tests.conftest import KERNEL_DEVICE

BLOCK_SIZE = 8
#: Where the Triton kernels take tensors here: CUDA on a GPU (compiled), the CPU otherwise.
DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)


def _valid(**kw):
    """Valid inputs as a dict: 3 sequences, 8 query heads, 2 KV heads, head_dim 64."""
    inp = make_paged_inputs([5, 16, 11], num_q_heads=8, num_kv_heads=2, head_dim=64,
                            block_size=BLOCK_SIZE, seed=3, **kw)
    return dict(q=inp.q, k_cache=inp.k_cache, v_cache=inp.v_cache,
                block_tables=inp.block_tables, seq_lens=inp.seq_lens)


def _call(args, scale=None):
    return paged_attention(args["q"], args["k_cache"], args["v_cache"], args["block_tables"],
                           args["seq_lens"], scale=scale, backend="torch")


def _non_contiguous(t: torch.Tensor) -> torch.Tensor:
    """Same shape and values, but a transposed memory layout."""
    return t.transpose(0, 1).contiguous().transpose(0, 1)


def _set(name, fn):
    def breaker(args):
        args[name] = fn(args)
        return args
    return breaker


def _table_entry(value):
    def breaker(args):
        t = args["block_tables"].clone()
        t[1, 1] = value(args) if callable(value) else value  # sequence 1 (16 tokens) uses 2
        args["block_tables"] = t
        return args
    return breaker


# (id, break one thing, exception type, the argument the message must name)
BAD_INPUTS = [
    # wrong type
    ("q_numpy", _set("q", lambda a: a["q"].numpy()), TypeError, "q"),
    ("k_cache_list", _set("k_cache", lambda a: a["k_cache"].tolist()), TypeError, "k_cache"),
    ("seq_lens_list", _set("seq_lens", lambda a: [5, 16, 11]), TypeError, "seq_lens"),
    ("block_tables_none", _set("block_tables", lambda a: None), TypeError, "block_tables"),
    # wrong rank
    ("q_rank4", _set("q", lambda a: a["q"][:, None]), ValueError, "q"),
    ("k_cache_rank3", _set("k_cache", lambda a: a["k_cache"].flatten(0, 1)), ValueError,
     "k_cache"),
    ("v_cache_rank5", _set("v_cache", lambda a: a["v_cache"][None]), ValueError, "v_cache"),
    ("block_tables_rank1", _set("block_tables", lambda a: a["block_tables"].flatten()),
     ValueError, "block_tables"),
    ("seq_lens_rank2", _set("seq_lens", lambda a: a["seq_lens"][:, None]), ValueError,
     "seq_lens"),
    # wrong shape
    ("q_head_dim", _set("q", lambda a: a["q"][..., :32].contiguous()), ValueError, "head_dim"),
    ("v_cache_shape", _set("v_cache", lambda a: a["v_cache"][:-1].contiguous()), ValueError,
     "v_cache"),
    ("block_tables_batch", _set("block_tables", lambda a: a["block_tables"][:2].contiguous()),
     ValueError, "block_tables"),
    ("seq_lens_batch", _set("seq_lens", lambda a: a["seq_lens"][:2].contiguous()), ValueError,
     "seq_lens"),
    # head counts that do not divide
    ("heads_not_divisible", _set("q", lambda a: a["q"][:, :5].contiguous()), ValueError,
     "num_kv_heads"),
    ("kv_heads_more_than_q",
     _set("q", lambda a: a["q"][:, :1].contiguous()), ValueError, "num_q_heads"),
    # wrong dtype
    ("k_cache_int8", _set("k_cache", lambda a: a["k_cache"].to(torch.int8)), TypeError,
     "k_cache"),
    ("caches_float64", lambda a: {**a, "q": a["q"].double(), "k_cache": a["k_cache"].double(),
                                  "v_cache": a["v_cache"].double()}, TypeError, "k_cache"),
    ("v_cache_dtype", _set("v_cache", lambda a: a["v_cache"].half()), TypeError, "v_cache"),
    ("q_dtype_mismatch", _set("q", lambda a: a["q"].half()), TypeError, "q dtype"),
    ("block_tables_int64", _set("block_tables", lambda a: a["block_tables"].long()), TypeError,
     "block_tables"),
    ("seq_lens_int64", _set("seq_lens", lambda a: a["seq_lens"].long()), TypeError, "seq_lens"),
    ("seq_lens_float", _set("seq_lens", lambda a: a["seq_lens"].float()), TypeError,
     "seq_lens"),
    # layout
    ("k_cache_non_contiguous", _set("k_cache", lambda a: _non_contiguous(a["k_cache"])),
     ValueError, "k_cache"),
    ("v_cache_non_contiguous", _set("v_cache", lambda a: _non_contiguous(a["v_cache"])),
     ValueError, "v_cache"),
    # values
    ("seq_len_too_long", _set("seq_lens", lambda a: torch.tensor(
        [5, a["block_tables"].shape[1] * BLOCK_SIZE + 1, 11], dtype=torch.int32)), ValueError,
     "seq_lens"),
    ("seq_len_negative", _set("seq_lens", lambda a: torch.tensor([5, -1, 11],
                                                                dtype=torch.int32)),
     ValueError, "seq_lens"),
    ("table_entry_minus_one", _table_entry(-1), ValueError, "block_tables"),
    ("table_entry_num_blocks", _table_entry(lambda a: a["k_cache"].shape[0]), ValueError,
     "block_tables"),
    ("table_entry_huge", _table_entry(2**31 - 1), ValueError, "block_tables"),
]


@pytest.mark.parametrize("break_, error, names", [c[1:] for c in BAD_INPUTS],
                         ids=[c[0] for c in BAD_INPUTS])
def test_bad_input_names_the_argument(break_, error, names):
    args = break_(_valid())
    with pytest.raises(error) as info:
        _call(args)
    assert names in str(info.value), f"message does not name {names!r}: {info.value}"


def test_device_mismatch_names_the_argument():
    """A tensor on another device (the "meta" device stands in for a GPU here)."""
    for name in ("k_cache", "v_cache", "block_tables", "seq_lens"):
        args = _valid()
        args[name] = args[name].to("meta")
        with pytest.raises(ValueError) as info:
            _call(args)
        assert name in str(info.value) and "meta" in str(info.value), str(info.value)


def test_q_on_another_device():
    args = _valid()
    args["q"] = args["q"].to("meta")
    with pytest.raises(ValueError, match="q is on meta"):
        _call(args)


@pytest.mark.parametrize("scale", [math.nan, math.inf, -math.inf], ids=str)
def test_non_finite_scale(scale):
    with pytest.raises(ValueError, match="scale"):
        _call(_valid(), scale=scale)


@pytest.mark.parametrize("scale", ["0.1", torch.tensor(0.1), True], ids=["str", "tensor", "bool"])
def test_scale_of_wrong_type(scale):
    with pytest.raises(TypeError, match="scale"):
        _call(_valid(), scale=scale)


def test_unused_entries_may_hold_anything():
    """Garbage past each sequence's used blocks (-1, huge, random ids) is fine."""
    args = _valid()
    t = args["block_tables"].clone()
    t[0, 1:] = -1  # sequence 0 has 5 tokens: one block
    t[2, 2:] = 2**31 - 1  # sequence 2 has 11 tokens: two blocks
    args["block_tables"] = t
    out = _call(args)
    assert out.shape == (3, 8, 64) and not out.isnan().any()


def test_zero_length_row_may_have_an_all_garbage_table_row():
    args = _valid()
    args["seq_lens"] = torch.tensor([5, 0, 11], dtype=torch.int32)
    t = args["block_tables"].clone()
    t[1] = -7
    args["block_tables"] = t
    out = _call(args)
    assert (out[1] == 0).all()


def test_a_failed_check_leaves_inputs_untouched():
    args = _valid()
    before = {k: v.clone() for k, v in args.items()}
    args["seq_lens"] = torch.tensor([5, -1, 11], dtype=torch.int32)
    with pytest.raises(ValueError):
        _call(args)
    for name in ("q", "k_cache", "v_cache", "block_tables"):
        assert torch.equal(args[name], before[name]), f"{name} was modified"


# ---- issue 36, scenario 12 -------------------------------------------------------------------


def _all_on_meta(args):
    return {name: t.to("meta") for name, t in args.items()}


@pytest.mark.parametrize("backend", ["torch", "triton", "triton_split", "auto"])
def test_every_tensor_on_meta_names_the_argument(backend):
    """Not "can't convert meta device type tensor to numpy": the call says which tensor."""
    args = _all_on_meta(_valid())
    with pytest.raises(ValueError, match="q is on meta, a device that holds no values"):
        paged_attention(*args.values(), backend=backend)


def test_meta_in_prefill_and_write_kv_names_the_argument():
    from paged_course.testing import make_prefill_inputs
    from paged_ref import paged_prefill, write_kv

    inp = make_prefill_inputs([9, 4], [3, 4], seed=5, num_q_heads=4, num_kv_heads=2,
                              head_dim=16, block_size=4)
    with pytest.raises(ValueError, match="q is on meta"):
        paged_prefill(*(t.to("meta") for t in inp.args()))
    k_cache = torch.zeros(4, 4, 2, 16, device="meta")
    k = torch.zeros(3, 2, 16, device="meta")
    slots = torch.arange(3, device="meta")
    with pytest.raises(ValueError, match="k_cache is on meta"):
        write_kv(k, k, k_cache, k_cache.clone(), slots)


@pytest.mark.parametrize("scale", [np.float32(0.25), np.float64(0.25), np.float16(0.25),
                                   np.int64(1), 1, 0.25], ids=repr)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_any_real_scalar_is_a_scale(scale, backend):
    """Python and NumPy real scalars alike (the same answer as the float)."""
    args = {name: t.to(DEVICE) for name, t in _valid().items()}
    out = paged_attention(*args.values(), scale=scale, backend=backend)
    assert_close(out, paged_attention(*args.values(), scale=float(scale), backend="torch")
                 .double(), name=f"scale={scale!r}")


@pytest.mark.parametrize("scale", [torch.tensor(0.25), np.array([0.25]), np.bool_(True), 1j],
                         ids=["0-d tensor", "1-d array", "np.bool_", "complex"])
def test_scale_that_is_no_real_scalar_is_a_type_error(scale):
    """A 0-d tensor too: reading it would be a read-back (a sync, and no CUDA graph)."""
    with pytest.raises(TypeError, match="scale"):
        _call(_valid(), scale=scale)


def test_numpy_scale_in_plan_and_prefill():
    from paged_course.testing import make_prefill_inputs
    from paged_ref import paged_prefill, plan_decode

    plan = plan_decode([5, 16, 11], num_q_heads=8, num_kv_heads=2, head_dim=64,
                       block_size=BLOCK_SIZE, dtype=torch.float32, device="cpu",
                       scale=np.float32(0.5))
    assert type(plan.scale) is float and plan.scale == 0.5
    inp = make_prefill_inputs([9, 4], [3, 4], seed=6, num_q_heads=4, num_kv_heads=2,
                              head_dim=16, block_size=4, device=DEVICE)
    for backend in ("torch", "triton"):
        out = paged_prefill(*inp.args(), scale=np.float32(0.5), backend=backend)
        assert_close(out, inp.reference(scale=0.5), name=backend)


def test_planted_python_only_scale_check_is_caught(tmp_path, monkeypatch):
    from paged_ref import attention, validation
    from tests.mutations.mutate import mutant_of

    mutant = mutant_of(validation, [("not isinstance(scale, numbers.Real)",
                                     "not isinstance(scale, (int, float))")], tmp_path,
                       monkeypatch)
    monkeypatch.setattr(attention, "check_scale", mutant.check_scale)
    with pytest.raises(TypeError):
        test_any_real_scalar_is_a_scale(np.float32(0.25), "torch")


def test_planted_missing_meta_check_is_caught(tmp_path, monkeypatch):
    """Scenario 12 planted back: without the device check a meta tensor gets torch's "can't
    convert meta device type tensor to numpy" (or runs), naming no argument."""
    from paged_ref import kv_write, validation
    from tests.mutations.mutate import mutant_of

    mutant = mutant_of(validation, [('if device.type == "meta":', "if False:")], tmp_path,
                       monkeypatch)
    for module in (validation, kv_write):
        monkeypatch.setattr(module, "check_device", mutant.check_device)
    for backend in ("torch", "triton"):
        with pytest.raises((AssertionError, pytest.fail.Exception, RuntimeError,
                            NotImplementedError, TypeError)):
            test_every_tensor_on_meta_names_the_argument(backend)
    with pytest.raises((AssertionError, pytest.fail.Exception, RuntimeError,
                        NotImplementedError, TypeError)):
        test_meta_in_prefill_and_write_kv_names_the_argument()
