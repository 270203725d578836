"""Checks for lesson 11's exercises (pack / unpack a sequence's blocks), on random pools.

``pytest tests/exercises/test_ex11_transfer.py --impl exercises``; in the notebook:
``course.check("ex11_transfer")``.
"""

from __future__ import annotations

import pytest
import torch

from paged_ref import PagedKVCache, transfer
from tests.conftest import load_exercise


@pytest.fixture
def ex(request):
    return load_exercise(request.config, "ex11_transfer")


def _pool(seed: int, num_layers=3, num_blocks=16, block_size=4, heads=2, dim=8,
          dtype=torch.float32) -> PagedKVCache:
    cache = PagedKVCache(num_layers, num_blocks, block_size, heads, dim, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    for t in cache.k_caches + cache.v_caches:
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return cache


@pytest.mark.parametrize("ids", [[5], [9, 2, 14, 0], list(range(15, -1, -1))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_blocks_matches_the_library(ex, ids, dtype):
    cache = _pool(len(ids), dtype=dtype)
    got = ex.pack_blocks(cache, ids)
    expected = transfer.pack_blocks(cache, ids)
    assert got.shape == expected.shape, (
        f"shape {tuple(got.shape)}, expected {tuple(expected.shape)}")
    assert got.dtype == expected.dtype, f"dtype {got.dtype}, expected {expected.dtype}"
    for layer in range(cache.num_layers):
        for kv, name in ((0, "K"), (1, "V")):
            for j, b in enumerate(ids):
                assert torch.equal(got[layer, kv, j], expected[layer, kv, j]), (
                    f"layer {layer} {name}, packed block {j} should be block {b}'s")


def test_pack_blocks_is_a_copy(ex):
    cache = _pool(1)
    got = ex.pack_blocks(cache, [3, 1])
    before = got.clone()
    cache.k_caches[0].zero_()
    assert torch.equal(got, before), "pack_blocks must copy, not view the cache"


@pytest.mark.parametrize("src_ids, dst_ids", [([7, 2, 9], [0, 15, 4]), ([1], [1]),
                                              ([3, 4, 5, 6], [6, 5, 4, 3])])
def test_unpack_lands_each_block_in_the_receivers_id(ex, src_ids, dst_ids):
    src, dst = _pool(10), _pool(20)
    before = [t.clone() for t in dst.k_caches + dst.v_caches]
    ex.unpack_blocks(dst, dst_ids, transfer.pack_blocks(src, src_ids))
    for layer in range(src.num_layers):
        for j, (a, b) in enumerate(zip(src_ids, dst_ids, strict=True)):
            assert torch.equal(dst.k_caches[layer][b], src.k_caches[layer][a]), (
                f"layer {layer}: K of packed block {j} should land in block {b}")
            assert torch.equal(dst.v_caches[layer][b], src.v_caches[layer][a]), (
                f"layer {layer}: V of packed block {j} should land in block {b}")
    untouched = [b for b in range(dst.num_blocks) if b not in dst_ids]
    for t, old in zip(dst.k_caches + dst.v_caches, before, strict=True):
        assert torch.equal(t[untouched], old[untouched]), "a block outside block_ids changed"


def test_round_trip_through_both_exercises(ex):
    src, dst = _pool(3), _pool(4)
    packed = ex.pack_blocks(src, [8, 1, 12])
    ex.unpack_blocks(dst, [2, 10, 6], packed)
    assert torch.equal(transfer.pack_blocks(dst, [2, 10, 6]), transfer.pack_blocks(src, [8, 1, 12]))
