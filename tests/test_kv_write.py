"""``write_kv``: new tokens' K/V land in their slots (both backends), nothing else changes, and
bad input is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from paged_course.checks import assert_equal
from paged_ref.kv_write import write_kv


def _inputs(dtype=torch.float16, num_tokens=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(6, 5, 2, 24, generator=gen).to(dtype)  # block size 5: not a power of 2
    v_cache = torch.randn(6, 5, 2, 24, generator=gen).to(dtype)
    k = torch.randn(num_tokens, 2, 24, generator=gen).to(dtype)
    v = torch.randn(num_tokens, 2, 24, generator=gen).to(dtype)
    slots = torch.randperm(30, generator=gen)[:num_tokens].to(torch.int32)
    return k, v, k_cache, v_cache, slots


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_writes_exactly_the_slots(backend, dtype):
    k, v, k_cache, v_cache, slots = _inputs(dtype)
    want_k, want_v = k_cache.clone().view(30, 2, 24), v_cache.clone().view(30, 2, 24)
    want_k[slots.long()], want_v[slots.long()] = k, v
    write_kv(k, v, k_cache, v_cache, slots, backend=backend)
    assert_equal(k_cache.view(30, 2, 24), want_k, name="k_cache")
    assert_equal(v_cache.view(30, 2, 24), want_v, name="v_cache")


def test_triton_strided_k_and_no_tokens():
    k, v, k_cache, v_cache, slots = _inputs(torch.float32)
    wide = torch.randn(11, 4, 24)
    wide[:, 1:3] = k
    write_kv(wide[:, 1:3], v, k_cache, v_cache, slots, backend="triton")
    assert_equal(k_cache.view(30, 2, 24)[slots.long()], k, name="k rows")
    before = k_cache.clone()
    write_kv(k[:0], v[:0], k_cache, v_cache, slots[:0], backend="triton")
    assert_equal(k_cache, before, name="unchanged")


@pytest.mark.parametrize("change, error, words", [
    (lambda a: a.__setitem__(4, a[4].float()), TypeError, "slot_mapping"),
    (lambda a: a.__setitem__(4, torch.tensor([0, 1] * 5 + [2], dtype=torch.int32)),
     ValueError, "more than once"),
    (lambda a: a[4].__setitem__(3, 30), ValueError, "slot_mapping[3]"),
    (lambda a: a[4].__setitem__(0, -1), ValueError, "slot_mapping[0]"),
    (lambda a: a.__setitem__(4, a[4][:5]), ValueError, "slot_mapping"),
    (lambda a: a.__setitem__(0, a[0].float()), TypeError, "k dtype"),
    (lambda a: a.__setitem__(1, a[1][:, :1]), ValueError, "v must have shape"),
])
def test_bad_input_writes_nothing(change, error, words):
    args = list(_inputs())
    change(args)
    before = args[2].clone(), args[3].clone()
    with pytest.raises(error) as info:
        write_kv(*args)
    assert words in str(info.value)
    assert_equal(args[2], before[0], name="k_cache untouched")
    assert_equal(args[3], before[1], name="v_cache untouched")
