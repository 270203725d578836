"""What the engine tests check again and again: transformers' greedy tokens, an engine with
nothing left inside, prefix-cache entries whose K/V are really written."""

import torch


def hf_greedy(model, prompt, n):
    """transformers' greedy ``n`` tokens for ``prompt`` alone (no EOS stop)."""
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def assert_idle_and_whole(engine):
    """Nothing left inside ``engine``: no request, no sequence, every block free or cached."""
    s, m = engine.scheduler, engine.scheduler.manager
    assert not engine.requests and not s.waiting and not s.running, "requests left inside"
    assert not m.seq_ids, f"the manager still holds sequences {m.seq_ids}"
    assert m.num_free_blocks == m.num_blocks, f"{m.num_free_blocks} of {m.num_blocks} free"


@torch.inference_mode()
def assert_cached_kv_is_written(engine, model):
    """Every prefix-cache entry's K/V (every layer) equal transformers' K/V for the tokens it
    is cached under (its chain of parents, then its own): no hash over unwritten K/V. Returns
    how many entries were checked."""
    from transformers import DynamicCache

    from paged_ref.models.compat import forward_into_cache

    cache, entries = engine.runner.cache, engine.scheduler.manager.cached_blocks()
    by_hash, bs = {e.block_hash: e for e in entries}, engine.block_size
    checked = 0
    for e in entries:
        chain, parent = list(e.token_ids), e.parent_hash
        while parent is not None and parent in by_hash:
            chain = list(by_hash[parent].token_ids) + chain
            parent = by_hash[parent].parent_hash
        if parent is not None:  # (an ancestor was evicted: its tokens are unknown here)
            continue
        kv = DynamicCache(config=model.config)
        forward_into_cache(model, torch.tensor([chain]), kv)  # (the keyword of this release)
        for i, layer in enumerate(kv.layers):
            for got, want in ((cache.k_caches[i][e.block_id], layer.keys),
                              (cache.v_caches[i][e.block_id], layer.values)):
                want = want[0, :, -bs:].transpose(0, 1)  # [bs, Hkv, D]
                assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (
                    f"block {e.block_id} cached for tokens {chain[-bs:]} holds other K/V "
                    f"(layer {i}, max diff {(got - want).abs().max():.3g})")
        checked += 1
    return checked


def assert_tables_hold_their_counts(manager):
    """Between steps: each block's reference count is the number of block tables that list it,
    and the blocks held (not free, not evictable) are exactly the ones some table lists."""
    from collections import Counter

    held = Counter(b for s in manager.seq_ids for b in manager.block_table(s))
    wrong = {b: (n, manager.ref_count(b)) for b, n in held.items() if manager.ref_count(b) != n}
    assert not wrong, f"block: (tables listing it, its ref_count): {wrong}"
    assert manager.num_blocks - manager.num_free_blocks == len(held), (
        f"{manager.num_blocks - manager.num_free_blocks} blocks held, {len(held)} in tables")


@torch.inference_mode()
def assert_running_kv_is_theirs(engine, model):
    """Every running request's K/V in the cache (all its computed tokens, every layer) equal
    transformers' K/V for its own tokens: no sequence's write landed in another's block."""
    from transformers import DynamicCache

    from paged_ref.models.compat import forward_into_cache

    cache, m = engine.runner.cache, engine.scheduler.manager
    for r in engine.scheduler.running:
        tokens = r.tokens[:r.num_computed]
        kv = DynamicCache(config=model.config)
        forward_into_cache(model, torch.tensor([tokens]), kv)  # (5.17's keyword or 5.24's)
        slots = torch.tensor(m.slot_mapping(r.req_id, 0, len(tokens)))
        for i, layer in enumerate(kv.layers):
            for got, want in ((cache.k_caches[i], layer.keys), (cache.v_caches[i], layer.values)):
                got = got.reshape(-1, *got.shape[2:])[slots]  # [T, Hkv, D]
                want = want[0].transpose(0, 1)
                assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (
                    f"request {r.req_id}: layer {i} K/V differ from its own tokens' (max diff "
                    f"{(got - want).abs().max():.3g}): another sequence wrote into its blocks")


@torch.inference_mode()
def assert_tiers_hold_their_kv(engine, model, sequences):
    """Every block the host and disk tiers hold (read back from the file) equals
    transformers' K/V, every layer, of the tokens its hash names -- found among the leading
    full blocks of ``sequences`` (token id lists): nothing moved down half-written, from
    another block, or under a hash of tokens no request had. Returns how many were checked."""
    from transformers import DynamicCache

    from paged_ref.memory.prefix_cache import hash_block_tokens
    from paged_ref.models.compat import forward_into_cache

    host, bs = engine.scheduler.manager._host, engine.block_size
    if host is None:
        return 0
    tokens_of, kv_of = {}, {}
    for seq in sequences:
        block_hash = None
        for j in range(len(seq) // bs):
            block_hash = hash_block_tokens(block_hash, seq[j * bs:(j + 1) * bs])
            tokens_of[block_hash] = seq[:(j + 1) * bs]
    held = [(h, engine.runner.cache.host_kv[host.slot_of(h)]) for h in host.hashes()]
    if host.disk is not None:
        held += [(h, host.disk.peek(h)) for h in host.disk.hashes() if host.disk.readable(h)]
    for block_hash, got in held:
        assert block_hash in tokens_of, "a tier holds a hash of tokens no request had"
        tokens = tuple(tokens_of[block_hash])
        if tokens not in kv_of:
            kv = DynamicCache(config=model.config)
            forward_into_cache(model, torch.tensor([list(tokens)]), kv)
            kv_of[tokens] = torch.stack([torch.stack([x[0, :, -bs:].transpose(0, 1) for x in
                                                      (layer.keys, layer.values)])
                                         for layer in kv.layers], dim=1)  # [2, L, bs, Hkv, D]
        assert torch.allclose(got, kv_of[tokens], atol=1e-4, rtol=1e-4), (
            f"a tier holds other K/V for tokens {list(tokens[-bs:])} (max diff "
            f"{(got - kv_of[tokens]).abs().max():.3g})")
    return len(held)
