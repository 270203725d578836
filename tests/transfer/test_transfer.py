"""paged_ref.transfer: pack/unpack round trips, and two gloo processes moving a sequence."""

from __future__ import annotations

import pytest
import torch

from paged_course import two_ranks
from paged_ref import KVCacheManager, PagedKVCache, transfer


def _filled_cache(seed: int, num_blocks: int = 12, dtype=torch.float32) -> PagedKVCache:
    cache = PagedKVCache(3, num_blocks, 4, 2, 8, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    for t in cache.k_caches + cache.v_caches:
        t.copy_(torch.randn(t.shape, generator=gen).to(dtype))
    return cache


def test_pack_then_unpack_lands_blocks_in_other_ids():
    src, dst = _filled_cache(0), _filled_cache(1)
    src_ids, dst_ids = [7, 2, 9, 0], [3, 11, 1, 5]
    packed = transfer.pack_blocks(src, src_ids)
    assert packed.shape == (3, 2, 4, 4, 2, 8) and packed.is_contiguous()
    before = [t.clone() for t in dst.k_caches]
    transfer.unpack_blocks(dst, dst_ids, packed)
    for layer in range(3):
        assert torch.equal(dst.k_caches[layer][dst_ids], src.k_caches[layer][src_ids])
        assert torch.equal(dst.v_caches[layer][dst_ids], src.v_caches[layer][src_ids])
        untouched = [b for b in range(12) if b not in dst_ids]
        assert torch.equal(dst.k_caches[layer][untouched], before[layer][untouched])


@pytest.mark.parametrize("ids, match", [([12], "outside"), ([-1], "outside"),
                                        ([3, 3], "repeats")])
def test_bad_block_ids(ids, match):
    with pytest.raises(ValueError, match=match):
        transfer.pack_blocks(_filled_cache(0), ids)


def test_unpack_checks_payload_shape():
    cache = _filled_cache(0)
    with pytest.raises(ValueError, match="packed must be"):
        transfer.unpack_blocks(cache, [1, 2], transfer.pack_blocks(cache, [1, 2, 3]))


@pytest.mark.parametrize("num_layers, per_chunk", [(1, 1), (2, 1), (3, 2), (30, 7), (32, 1),
                                                  (32, 4), (32, 32), (32, 40)])
def test_chunk_bounds_cover_every_layer_once_with_short_ends(num_layers, per_chunk):
    bounds = transfer.chunk_bounds(num_layers, per_chunk)
    assert [layer for l0, l1 in bounds for layer in range(l0, l1)] == list(range(num_layers))
    assert all(1 <= l1 - l0 <= per_chunk for l0, l1 in bounds)
    if per_chunk < num_layers:  # first and last messages carry one layer: short fill and drain
        assert bounds[0] == (0, 1) and bounds[-1] == (num_layers - 1, num_layers)


def test_a_quantised_cache_is_refused_before_anything_is_sent():
    cache = PagedKVCache(2, 8, 4, 2, 8, kv_format="fp8")
    m = KVCacheManager(8, 4)
    m.add_sequence("a", 5)
    with pytest.raises(ValueError, match="quantised"):  # (no process group: nothing was sent)
        transfer.send_sequence(cache, m, "a", dst=1)


def _refused(rank, world_size, *, num_blocks, head_dim):
    """Rank 0 sends a 30-token sequence; rank 1's pool has ``num_blocks`` blocks of ``head_dim``.
    Reports what each side raised and how many sequences rank 1 holds afterwards."""
    cache = PagedKVCache(1, num_blocks if rank else 32, 4, 2, head_dim if rank else 8)
    m = KVCacheManager(num_blocks if rank else 32, 4)
    try:
        if rank == 0:
            m.add_sequence("big", 30)
            transfer.send_sequence(cache, m, "big", dst=1)
        else:
            transfer.recv_sequence(cache, m, "big", src=0)
    except Exception as e:  # noqa: BLE001 -- report what each side raised
        return {"error": type(e).__name__, "message": str(e), "held": len(m)}
    return {"error": None}


@pytest.mark.parametrize("num_blocks, head_dim, sender_says, receiver_raises", [
    (4, 8, "refused sequence 'big': it has no free blocks", ("OutOfBlocksError", "")),
    (32, 16, "refused sequence 'big': its pool's shape differs",
     ("ValueError", "differs from this pool's")),
], ids=["no room", "other shape"])
def test_two_processes_refuse_cleanly(num_blocks, head_dim, sender_says, receiver_raises):
    """Both sides raise, and nothing is held on the receiver."""
    res = two_ranks.run_two_ranks(_refused, backend="gloo", num_blocks=num_blocks,
                                  head_dim=head_dim)
    assert res[0]["error"] == "ValueError" and sender_says in res[0]["message"]
    assert (res[1]["error"], res[1]["held"]) == (receiver_raises[0], 0)
    assert receiver_raises[1] in res[1]["message"]


def test_decode_after_transfer_equals_single_process():
    """Prefill on rank 0, K/V moved (different block ids on each side), decode on rank 1:
    the outputs equal one process doing it all, bit for bit, in every transfer mode."""
    res = two_ranks.run_two_ranks(two_ranks.demo_tiny_disaggregated, backend="gloo",
                                  prompt_len=37, steps=6, modes=transfer.MODES)
    expected = two_ranks.tiny_single_process(prompt_len=37, steps=6)
    for mode in transfer.MODES:
        sent, got = res[0][mode], res[1][mode]
        assert sent["table"] != got["table"]  # the blocks landed in other ids
        assert torch.equal(got["outputs"], expected), f"{mode}: outputs differ"
        t = got["transfer"]
        assert (t.num_tokens, t.num_blocks, t.mode) == (37, 10, mode)
        assert t.payload_bytes == 10 * 4 * 2 * 2 * 16 * 4  # blocks*size*K,V*heads*dim*fp32


def _prefix_ranks(rank, world_size):
    """Rank 0 computed two prompts sharing 8 tokens; rank 1 takes both into its prefix cache."""
    bs = 4
    gen = torch.Generator().manual_seed(7)
    prompt_a = torch.randint(0, 1000, (23,), generator=gen).tolist()
    prompt_b = prompt_a[:8] + torch.randint(0, 1000, (9,), generator=gen).tolist()
    cache = PagedKVCache(2, 64, bs, 2, 8, dtype=torch.float32)
    m = KVCacheManager(64, bs, enable_prefix_caching=True)
    if rank == 0:
        for name, prompt in (("a", prompt_a), ("b", prompt_b)):
            m.add_sequence(name, token_ids=prompt)
            for layer in range(2):  # the prompt's K/V, as a prefill would write them
                k = torch.randn(len(prompt), 2, 8, generator=gen)
                cache.write(layer, k, -k, m.slot_mapping(name))
        expected = {n: [cache.gather(layer, m.block_table(n), 20 if n == "a" else 16)
                        for layer in range(2)] for n in ("a", "b")}
        for name in ("a", "b"):
            m.free_sequence(name)
        moved = [transfer.send_prefix(cache, m, p, dst=1) for p in (prompt_a, prompt_b)]
        return {"expected": expected, "moved": moved}
    m.add_sequence("running", 30)  # another request holds blocks here
    moved = [transfer.recv_prefix(cache, m, src=0) for _ in range(2)]
    hits = {"a": m.add_sequence("a", token_ids=prompt_a),
            "b": m.add_sequence("b", token_ids=prompt_b)}
    got = {n: [cache.gather(layer, m.block_table(n), hits[n]) for layer in range(2)]
           for n in ("a", "b")}
    return {"moved": moved, "hits": hits, "got": got, "free": m.num_free_blocks}


def test_prefix_lands_in_the_receivers_prefix_cache_and_only_missing_blocks_travel():
    res = two_ranks.run_two_ranks(_prefix_ranks, backend="gloo")
    assert res[1]["hits"] == {"a": 20, "b": 16}  # full blocks, one token left to compute
    for name in ("a", "b"):
        for (k0, v0), (k1, v1) in zip(res[0]["expected"][name], res[1]["got"][name],
                                      strict=True):
            assert torch.equal(k0, k1) and torch.equal(v0, v1), name
    a, b = res[1]["moved"]
    assert (a.num_tokens, a.num_blocks) == (20, 5)
    assert (b.num_tokens, b.num_blocks) == (16, 2)  # its first 2 blocks were cached already


def test_engine_greedy_tokens_after_transfer_equal_one_engine():
    """Lesson 11's bar on CPU: rank 0's engine computes the prompts, their blocks move into
    rank 1's prefix cache (gloo), rank 1's engine generates: the same greedy tokens as one
    engine in one process, and rank 1 computed only the tails (at most a block per prompt)."""
    pytest.importorskip("transformers")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (37, 16, 53)]
    res = two_ranks.run_two_ranks(two_ranks.demo_engine_disaggregated, backend="gloo",
                                  prompts=prompts, max_new_tokens=8)
    alone = two_ranks.engine_single_process(prompts=prompts, max_new_tokens=8)
    assert res[1]["outputs"] == alone
    assert [(m.num_tokens, m.num_blocks) for m in res[1]["moved"]] == [(32, 2), (0, 0), (48, 3)]
    assert res[1]["cached_tokens"] == 80  # every moved token was a prefix-cache hit on rank 1
