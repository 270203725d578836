"""``write_kv``: new tokens' K/V land in their slots (both backends), nothing else changes, and
bad input is refused before anything is written."""

from __future__ import annotations

import pytest
import torch

from paged_course.checks import assert_equal
from paged_ref.kv_write import write_kv
from tests.conftest import KERNEL_DEVICE
from tests.mutations.mutate import mutant_of

#: Where the Triton kernels take tensors here: CUDA on a GPU (compiled), the CPU otherwise.
DEVICE = KERNEL_DEVICE  # (tests/conftest.py: "cuda" where the kernels compile)


def _inputs(dtype=torch.float16, num_tokens=11, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(6, 5, 2, 24, generator=gen).to(DEVICE, dtype)  # block size 5
    v_cache = torch.randn(6, 5, 2, 24, generator=gen).to(DEVICE, dtype)
    k = torch.randn(num_tokens, 2, 24, generator=gen).to(DEVICE, dtype)
    v = torch.randn(num_tokens, 2, 24, generator=gen).to(DEVICE, dtype)
    slots = torch.randperm(30, generator=gen)[:num_tokens].to(DEVICE, torch.int32)
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
    wide = torch.randn(11, 4, 24, device=DEVICE)
    wide[:, 1:3] = k
    write_kv(wide[:, 1:3], v, k_cache, v_cache, slots, backend="triton")
    assert_equal(k_cache.view(30, 2, 24)[slots.long()], k, name="k rows")
    before = k_cache.clone()
    write_kv(k[:0], v[:0], k_cache, v_cache, slots[:0], backend="triton")
    assert_equal(k_cache, before, name="unchanged")


@pytest.mark.parametrize("change, error, words", [
    (lambda a: a.__setitem__(4, a[4].float()), TypeError, "slot_mapping"),
    (lambda a: a.__setitem__(4, torch.tensor([0, 1] * 5 + [2], dtype=torch.int32,
                                             device=DEVICE)),
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


# ---- aliasing (issue 36, scenario 7) -------------------------------------------------------


def _rows(cache):
    return cache.view(-1, *cache.shape[2:])


def _expected(k, v, k_cache, v_cache, slots):
    want_k, want_v = _rows(k_cache).clone(), _rows(v_cache).clone()
    want_k[slots.long()], want_v[slots.long()] = k.clone(), v.clone()
    return want_k, want_v


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_one_tensor_as_both_caches_is_refused(backend):
    k, v, k_cache, _, slots = _inputs(torch.float32, seed=21)
    before = k_cache.clone()
    with pytest.raises(ValueError, match="k_cache and v_cache share memory"):
        write_kv(k, v, k_cache, k_cache, slots, backend=backend)
    assert_equal(k_cache, before, name="k_cache untouched")


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_k_and_v_halves_of_one_buffer_are_fine(backend):
    """``kv[0]``, ``kv[1]`` of one ``[2, ...]`` tensor share a storage but no byte."""
    k, v, k_cache, _, slots = _inputs(torch.float32, seed=22)
    kv = torch.randn(2, *k_cache.shape, generator=torch.Generator().manual_seed(22)).to(DEVICE)
    want_k, want_v = _expected(k, v, kv[0], kv[1], slots)
    write_kv(k, v, kv[0], kv[1], slots, backend=backend)
    assert_equal(_rows(kv[0]), want_k, name="k_cache")
    assert_equal(_rows(kv[1]), want_v, name="v_cache")


# (id, which source is a view of which cache, its first row): slots 3, 4, 5, ... are written
OVERLAPS = [("k_of_k_cache", "k", "k_cache", 1), ("v_of_v_cache", "v", "v_cache", 5),
            ("k_of_v_cache", "k", "v_cache", 0), ("v_of_k_cache_last", "v", "k_cache", 8)]


def _aliased(src, cache_name, first, seed):
    """Inputs where ``src`` is rows ``first .. first + 4`` of ``cache_name`` (a view); slots
    3 .. 7 are written (rows 0 .. 7 overlap them, rows 8 .. are apart)."""
    k, v, k_cache, v_cache, _ = _inputs(torch.float32, num_tokens=5, seed=seed)
    caches = {"k_cache": k_cache, "v_cache": v_cache}
    view = _rows(caches[cache_name])[first : first + 5]
    k, v = (view, v) if src == "k" else (k, view)
    return k, v, k_cache, v_cache, torch.arange(3, 8, dtype=torch.int32, device=DEVICE)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("case, src, cache_name, first", OVERLAPS, ids=[c[0] for c in OVERLAPS])
def test_source_that_overlaps_its_destination(backend, case, src, cache_name, first):
    """Overlapping the slots written: refused, nothing written. Apart from them (rows 8 ..): the
    right answer on both backends (torch's index_copy_ refuses any shared memory: a copy)."""
    args = _aliased(src, cache_name, first, seed=23 + first)
    before = [t.clone() for t in args[2:4]]
    if first + 5 > 3 and first < 8:
        with pytest.raises(ValueError) as info:
            write_kv(*args, backend=backend)
        message = str(info.value)
        assert f"{src} is a view of {cache_name}" in message and "slot_mapping[" in message
        assert_equal(args[2], before[0], name="k_cache untouched")
        assert_equal(args[3], before[1], name="v_cache untouched")
        return
    want_k, want_v = _expected(*args)
    write_kv(*args, backend=backend)
    assert_equal(_rows(args[2]), want_k, name="k_cache")
    assert_equal(_rows(args[3]), want_v, name="v_cache")


def test_planted_missing_aliasing_check_is_caught(tmp_path, monkeypatch):
    from paged_ref import kv_write

    mutant = mutant_of(kv_write, [("    check_aliasing(k, v, k_cache, v_cache, slots)\n",
                                   "")], tmp_path, monkeypatch)
    monkeypatch.setitem(globals(), "write_kv", mutant.write_kv)
    for backend in ("torch", "triton"):
        with pytest.raises((AssertionError, pytest.fail.Exception, RuntimeError)):
            test_one_tensor_as_both_caches_is_refused(backend)
        for case in OVERLAPS[:3]:
            with pytest.raises((AssertionError, pytest.fail.Exception, RuntimeError)):
                test_source_that_overlaps_its_destination(backend, *case)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_no_tokens_into_a_pool_of_no_blocks(backend):
    k_cache = torch.zeros(0, 4, 2, 8, device=DEVICE)
    k = torch.zeros(0, 2, 8, device=DEVICE)
    write_kv(k, k, k_cache, k_cache.clone(), torch.zeros(0, dtype=torch.int32, device=DEVICE),
             backend=backend)
