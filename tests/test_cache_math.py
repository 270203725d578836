"""paged_ref.cache_math: the cache's arithmetic, against brute force and on bad input."""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from paged_ref import cache_math as cm


@given(st.integers(0, 10**6), st.integers(1, 10**4))
def test_cdiv_and_blocks_needed_are_ceil(a, b):
    assert cm.cdiv(a, b) == math.ceil(a / b) == cm.blocks_needed(a, b)


def test_cdiv_and_slot_of_elementwise_on_arrays():
    lens = [0, 1, 15, 16, 17, 33]
    want = [cm.cdiv(n, 16) for n in lens]
    assert cm.cdiv(np.array(lens), 16).tolist() == want
    assert cm.cdiv(torch.tensor(lens), 16).tolist() == want
    blocks, tokens = torch.tensor([3, 0, 7]), torch.tensor([5, 17, 34])
    assert cm.slot_of(blocks, tokens, 16).tolist() == [3 * 16 + 5, 0 * 16 + 1, 7 * 16 + 2]


@given(st.integers(0, 200), st.integers(1, 32))
def test_tokens_in_block_sum_to_length(seq_len, block_size):
    held = [cm.tokens_in_block(seq_len, j, block_size) for j in range(seq_len // block_size + 3)]
    assert sum(held) == seq_len
    assert all(0 <= h <= block_size for h in held)
    assert sum(h > 0 for h in held) == cm.blocks_needed(seq_len, block_size)


@given(st.integers(1, 40), st.integers(1, 8), st.randoms(use_true_random=False))
def test_token_slots_visit_each_used_slot_once(seq_len, block_size, rnd):
    table = rnd.sample(range(100), cm.blocks_needed(seq_len, block_size))
    slots = cm.token_slots(table, seq_len, block_size)
    assert len(set(slots)) == seq_len
    for t, s in enumerate(slots):
        assert s == cm.token_slot(table, t, block_size)
        assert divmod(s, block_size) == (table[t // block_size], t % block_size)
    assert cm.token_slots(table, seq_len, block_size, start=seq_len // 2) == slots[seq_len // 2:]


def test_default_scale_and_bytes():
    assert cm.default_scale(64) == 0.125 and cm.default_scale(64, 2) == 2.0
    assert cm.dtype_bytes(torch.bfloat16) == 2 == cm.dtype_bytes("float16")
    assert cm.dtype_bytes(torch.float32) == 4 and cm.dtype_bytes(1) == 1
    per_token = cm.kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128,
                                      dtype="bfloat16")
    assert per_token == 131072


@pytest.mark.parametrize("name, per_head", [("fp8", 128), ("fp8_token_head", 132),
                                            ("int4", 64 + 2 * 4), ("int4_g128", 64 + 4)])
def test_bytes_per_token_of_a_quantised_cache(name, per_head):
    """Codes plus per-token scales, the one formula behind PagedKVCache.bytes_per_token and
    the benchmark inputs' kv_bytes."""
    from paged_course.testing import make_paged_inputs
    from paged_ref import KVFormat, PagedKVCache

    fmt = KVFormat.parse(name)
    per_token = cm.kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype=fmt)
    assert per_token == 2 * 32 * 8 * per_head
    cache = PagedKVCache(2, 4, 16, 3, 128, dtype=torch.bfloat16, kv_format=name)
    assert cache.bytes_per_token == 2 * 2 * 3 * per_head
    inp = make_paged_inputs([21, 5], num_q_heads=6, num_kv_heads=3, head_dim=128, seed=4,
                            dtype=torch.bfloat16).quantized(name)
    assert inp.kv_bytes == 26 * 2 * 3 * per_head


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="dtype"):
        cm.dtype_bytes(torch.int64)
    with pytest.raises(ValueError, match="dtype"):
        cm.dtype_bytes(0)
    with pytest.raises(ValueError, match="num_kv_heads"):
        cm.kv_bytes_per_token(num_layers=32, num_kv_heads=0, head_dim=128, dtype=2)
    with pytest.raises(TypeError, match="head_dim"):
        cm.kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128.0, dtype=2)


@given(st.integers(1, 200_000), st.integers(1, 600), st.sampled_from([16, 32, 64, 128]))
def test_split_chunks_covers_max_len_without_empty_chunks(max_len, asked, multiple):
    chunk, count = cm.split_chunks(max_len, asked, multiple)
    assert chunk % multiple == 0
    assert (count - 1) * chunk < max_len <= count * chunk  # the last chunk holds tokens
    assert count <= asked
    assert chunk == math.ceil(Fraction(max_len, asked * multiple)) * multiple  # exact ceil
