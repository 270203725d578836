"""PagedKVCache: write/gather round trips on fresh random data; errors leave the cache alone."""

from __future__ import annotations

import random

import pytest
import torch

from paged_course.checks import assert_equal
from paged_ref import KVCacheManager, PagedKVCache

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def random_cache(seed: int = 0, dtype=torch.float32, **sizes) -> PagedKVCache:
    """A cache whose every slot already holds random values (so stale data is visible)."""
    shape = dict(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, head_dim=8)
    shape.update(sizes)
    cache = PagedKVCache(**shape, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    for t in cache.k_caches + cache.v_caches:
        t.copy_(torch.randn(t.shape, generator=gen))
    return cache


def random_kv(cache: PagedKVCache, num_tokens: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    shape = (num_tokens, cache.num_kv_heads, cache.head_dim)
    k = torch.randn(shape, generator=gen).to(cache.dtype)
    v = torch.randn(shape, generator=gen).to(cache.dtype)
    return k, v


def clone_all(cache: PagedKVCache) -> list[torch.Tensor]:
    return [t.clone() for t in cache.k_caches + cache.v_caches]


def assert_unchanged(cache: PagedKVCache, before: list[torch.Tensor]) -> None:
    for i, (now, then) in enumerate(zip(cache.k_caches + cache.v_caches, before, strict=True)):
        assert torch.equal(now, then), f"tensor {i} changed after an error"


def test_layout_and_sizes():
    cache = PagedKVCache(3, 10, 16, 4, 32, dtype=torch.bfloat16)
    assert len(cache.k_caches) == len(cache.v_caches) == 3
    k, v = cache.layer(2)
    assert tuple(k.shape) == tuple(v.shape) == (10, 16, 4, 32)
    assert k.dtype == torch.bfloat16 and k.is_contiguous()
    assert k is cache.k_caches[2] and v is cache.v_caches[2]
    assert cache.bytes_per_token == 2 * 3 * 4 * 32 * 2
    assert cache.nbytes == 10 * 16 * cache.bytes_per_token
    assert cache.num_slots == 160


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("seed", range(4))
def test_write_then_gather_round_trips_through_a_manager(dtype, seed):
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 5])
    # 3 sequences of at most 5 + 8 tokens fit in 40 blocks whatever the block size
    m = KVCacheManager(num_blocks=40, block_size=block_size)
    cache = random_cache(seed, dtype, num_blocks=40, block_size=block_size)
    written = {}
    for seq_id in range(3):
        m.add_sequence(seq_id, rng.randint(0, 5))
    # grow the sequences in interleaved order, so their blocks are not contiguous
    for _step in range(rng.randint(0, 8)):
        for seq_id in range(3):
            if rng.random() < 0.6:
                m.append_slot(seq_id)
    layer = rng.randrange(cache.num_layers)
    for seq_id in range(3):
        n = m.seq_len(seq_id)
        k, v = random_kv(cache, n, seed * 10 + seq_id)
        cache.write(layer, k, v, m.slot_mapping(seq_id))
        written[seq_id] = (k, v)
    for seq_id, (k, v) in written.items():
        got_k, got_v = cache.gather(layer, m.block_table(seq_id), m.seq_len(seq_id))
        assert_equal(got_k, k, name=f"k of sequence {seq_id}")
        assert_equal(got_v, v, name=f"v of sequence {seq_id}")


def test_write_lands_in_the_documented_slot():
    cache = random_cache(1)
    k, v = random_kv(cache, 3, 5)
    slots = [13, 2, 31]  # block 3 offset 1, block 0 offset 2, block 7 offset 3
    cache.write(1, k, v, torch.tensor(slots, dtype=torch.int32))
    for i, s in enumerate(slots):
        block, offset = divmod(s, cache.block_size)
        assert torch.equal(cache.k_caches[1][block, offset], k[i])
        assert torch.equal(cache.v_caches[1][block, offset], v[i])


def test_write_touches_only_the_given_slots_of_the_given_layer():
    cache = random_cache(2)
    before = clone_all(cache)
    k, v = random_kv(cache, 2, 6)
    cache.write(0, k, v, [5, 9])
    for t, (now, then) in enumerate(zip(cache.k_caches + cache.v_caches, before, strict=True)):
        changed = (now != then).flatten(0, 1).any(dim=(1, 2)).nonzero().flatten().tolist()
        expected = [5, 9] if t in (0, cache.num_layers) else []
        assert changed == expected, f"tensor {t}: slots {changed} changed, expected {expected}"


def test_gather_ignores_unused_table_entries():
    cache = random_cache(3)
    k, v = random_kv(cache, 5, 7)
    cache.write(0, k, v, [8, 9, 10, 11, 20])  # blocks 2 and 5
    got_k, got_v = cache.gather(0, [2, 5, -1, 10**9], 5)
    assert_equal(got_k, k, name="k")
    assert_equal(got_v, v, name="v")
    empty_k, _ = cache.gather(0, [], 0)
    assert tuple(empty_k.shape) == (0, 2, 8)


def _bad_writes(cache):
    k, v = random_kv(cache, 3, 0)
    ok = [0, 1, 2]
    return [
        # (layer, k, v, slot_mapping, error, text)
        (5, k, v, ok, ValueError, "layer 5 is outside"),
        (-1, k, v, ok, ValueError, "layer -1"),
        ("0", k, v, ok, TypeError, "layer must be an int"),
        (0, k.numpy(), v, ok, TypeError, "k must be a torch.Tensor"),
        (0, k, v[:, :1], ok, ValueError, "v must have shape"),
        (0, k[0], v[0], ok, ValueError, "k must have shape"),
        (0, k, v[:2], ok, ValueError, "v shape"),
        (0, k.double(), v, ok, TypeError, "k dtype torch.float64 must match"),
        (0, k, v.half(), ok, TypeError, "v dtype torch.float16 must match"),
        (0, k, v, [0, 1], ValueError, "slot_mapping has 2 entries but k and v have 3"),
        (0, k, v, [0, 1, 32], ValueError, r"slot_mapping\[2\] = 32 is outside"),
        (0, k, v, [0, -1, 2], ValueError, r"slot_mapping\[1\] = -1"),
        (0, k, v, [4, 7, 4], ValueError, "writes slot 4 more than once"),
        (0, k, v, [0, 1.0, 2], TypeError, r"slot_mapping\[1\] must be an int"),
        (0, k, v, torch.tensor([0.0, 1.0, 2.0]), TypeError, "must hold integers"),
        (0, k, v, torch.tensor([[0, 1, 2]]), ValueError, "slot_mapping must be 1-D"),
        (0, k, v, "012", TypeError, "slot_mapping must be a list"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_writes(random_cache()))))
def test_bad_write_names_the_argument_and_writes_nothing(case):
    cache = random_cache(4)
    layer, k, v, slots, error, text = _bad_writes(cache)[case]
    before = clone_all(cache)
    with pytest.raises(error, match=text):
        cache.write(layer, k, v, slots)
    assert_unchanged(cache, before)


@pytest.mark.parametrize(
    "table, seq_len, error, text",
    [
        ([0, 1], 9, ValueError, "seq_len 9 needs 3 blocks of 4 tokens but block_table has 2"),
        ([0, 8], 5, ValueError, r"block_table\[1\] = 8 is outside"),
        ([-1], 1, ValueError, r"block_table\[0\] = -1"),
        ([0], -1, ValueError, "seq_len must be >= 0"),
        ([0], 1.0, TypeError, "seq_len must be an int"),
        ((0, "1"), 5, TypeError, r"block_table\[1\] must be an int"),
    ],
)
def test_bad_gather_arguments(table, seq_len, error, text):
    cache = random_cache(5)
    with pytest.raises(error, match=text):
        cache.gather(0, table, seq_len)


@pytest.mark.parametrize(
    "args, kwargs, error, name",
    [
        ((0, 8, 4, 2, 8), {}, ValueError, "num_layers"),
        ((1, -8, 4, 2, 8), {}, ValueError, "num_blocks"),
        ((1, 8, 0, 2, 8), {}, ValueError, "block_size"),
        ((1, 8, 4, 2.0, 8), {}, TypeError, "num_kv_heads"),
        ((1, 8, 4, 2, None), {}, TypeError, "head_dim"),
        ((1, 8, 4, 2, 8), {"dtype": torch.int32}, TypeError, "dtype"),
    ],
)
def test_bad_constructor_arguments(args, kwargs, error, name):
    with pytest.raises(error, match=name):
        PagedKVCache(*args, **kwargs)
