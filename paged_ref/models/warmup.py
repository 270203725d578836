"""Dummy requests that make an engine compile, before its first request, every kernel a step
launches (``Engine.warmup``; issue 35: the first ``generate`` on an H200 ran at half the speed
of the second, its first steps compiling Triton kernels).

What a step compiles depends on its shape, not its values. Triton compiles a kernel once per
*specialisation* (its constexprs, the dtypes and 16-byte alignment of its pointers, integers
equal to 1 or divisible by 16), and the engine's steps launch these:

* decode steps replay CUDA graphs, captured when the engine is built (every batch-size bucket:
  the decode kernel and the fused layer ops compiled then); without graphs, planned decode;
* prefill / mixed steps run ``paged_prefill``, whose Triton path picks its tiles per step
  (:func:`paged_ref.kernels.triton.prefill.paged_prefill_triton`): long chunks only (the
  default tiles, one launch), short chunks only (at most ``SHORT_CONFIG.block_m // GQA group``
  rows each: small tiles, one launch), or both at once (two launches, each over a subset of
  the sequences, ``USE_SEQ_IDS``); the prefill kernel does not specialise its tile count or
  table stride (``do_not_specialize``), and its other integers are fixed by the model;
* the fused layer ops (add + RMS norm with and without the residual, rotary + K/V write,
  silu x up) take the token count only as their grid;
* the sampler (temperature alone; with top-k / top-p), outside the graphs.

So :func:`warmup_waves` builds requests that, added wave by wave before a step each, give a
long-only prefill step (as long as the token budget: the allocator grows to the largest
step), a mixed step (a decode row, a short chunk, a long chunk), a short-only step, then
decode steps, with a seeded sampling request of each kind (the sampler takes its top-k /
top-p path for a whole step when one row needs it: the other request samples on alone).
Their token ids are distinct, so no prompt is a prefix-cache hit of another (which would
shorten its chunk).
"""

from __future__ import annotations

import copy
import gc
import time

import torch

from paged_ref.sampling.params import SamplingParams

#: Query rows of the prefill kernel's small tiles (``SHORT_CONFIG.block_m``), where triton is
#: not installed (the engine then runs the torch backend: nothing to compile).
SHORT_TILE_ROWS = 16


def short_rows(num_q_heads: int, num_kv_heads: int) -> int:
    """The most query rows a chunk may have to take the prefill kernel's small tiles."""
    from paged_ref import _device

    rows = SHORT_TILE_ROWS
    if _device.HAS_TRITON:
        from paged_ref.kernels.triton.prefill import SHORT_CONFIG

        rows = SHORT_CONFIG.block_m
    return max(1, rows // (num_q_heads // num_kv_heads))


def warmup_waves(*, vocab_size: int, max_model_len: int, pool_tokens: int,
                 max_num_batched_tokens: int, num_q_heads: int, num_kv_heads: int,
                 ) -> list[list[tuple[list[int], SamplingParams]]]:
    """The warm-up requests, one list per step (see the module doc).

    Args:
        vocab_size: token ids are drawn from ``[3, vocab_size)`` (all ids when it is <= 3).
        max_model_len: the longest request the engine takes (prompt + output).
        pool_tokens: the KV pool's tokens (``num_blocks * block_size``).
        max_num_batched_tokens: the engine's token budget per step.
        num_q_heads, num_kv_heads: the model's heads (the short-chunk limit depends on them).

    Returns:
        Waves of ``(prompt token ids, SamplingParams)``: add a wave's requests, run a step.
    """
    short = short_rows(num_q_heads, num_kv_heads)
    # Long enough for the default tiles and for the budget, short enough that the four
    # requests fit the pool at once and each fits max_model_len with its 4 new tokens.
    long_len = max(short + 1, min(max_num_batched_tokens, pool_tokens // 4))
    long_len = max(1, min(long_len, max_model_len - 3))
    short_len = max(1, min(2, short, max_model_len - 3))
    low = 3 if vocab_size > 3 else 0
    counter = iter(range(1 << 30))

    def prompt(n: int) -> list[int]:  # distinct ids: no prompt is a prefix of another
        return [low + (7919 * next(counter) + 17) % (vocab_size - low) for _ in range(n)]

    def request(n: int, new: int, **sampling) -> tuple[list[int], SamplingParams]:
        new = max(1, min(new, max_model_len - n + 1))  # (prompt + new - 1 <= max_model_len)
        return prompt(n), SamplingParams(max_tokens=new, ignore_eos=True, **sampling)

    return [
        [request(long_len, 4)],  # a long chunk alone
        [request(short_len, 3),  # + the first one's decode row: a mixed step, two launches
         request(long_len, 2, temperature=0.8, top_k=5, top_p=0.9, seed=0)],
        # short chunks and decode rows only; it samples on after the top-k one is done (the
        # sampler's other path: temperature alone)
        [request(short_len, 4, temperature=0.7, seed=1)],
    ]


def run_warmup(engine) -> int:
    """Run :func:`warmup_waves` through ``engine``'s real step path (``add_request``, then
    ``step``, wave by wave, then steps until every request finished). The caller keeps the
    engine's state apart (``Engine.warmup``). Returns the steps run."""
    cfg = engine.model.config
    waves = warmup_waves(vocab_size=engine.vocab_size, max_model_len=engine.max_model_len,
                         pool_tokens=engine.num_blocks * engine.block_size,
                         max_num_batched_tokens=engine.scheduler.max_num_batched_tokens,
                         num_q_heads=cfg.num_attention_heads,
                         num_kv_heads=getattr(cfg, "num_key_value_heads", None)
                         or cfg.num_attention_heads)
    steps = 0
    for wave in waves:
        for ids, params in wave:
            engine.add_request(ids, params)
        engine.step()
        steps += 1
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    return steps


def warmup(engine) -> float:
    """``Engine.warmup``: compile every kernel a step launches, before the first request
    (:func:`run_warmup`'s dummy requests), and leave the engine as it was: no block held,
    nothing cached, stats zero, request ids and the RNGs as they were. Returns the seconds it
    took (also ``warmup_seconds``). RuntimeError after the first request: its blocks and
    cached prefixes would be the dummies' to overwrite. It ends with ``gc.freeze()``, as
    vLLM's start-up does: what is alive then (model, engine, kernels) leaves the sweeps of
    Python's cyclic collector, process-wide (``paged_bench warmup`` records the collector's
    pauses in each ``generate``)."""
    if engine._next_id:
        raise RuntimeError("warmup() runs before the first request (add_request/generate)")
    start, kept = time.perf_counter(), (engine.scheduler, engine.stats)
    # the dummies' scheduler: a fresh one's copy (what they leave in the runner's cache is
    # unreachable), without the disk tier (its moves are host copies: nothing to compile)
    engine.scheduler = copy.deepcopy(engine.scheduler, {id(engine.disk_tier): None})
    cuda = [engine.runner.device] if engine.runner.device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda):  # (sampling draws from the global RNG)
            run_warmup(engine)
    finally:
        (engine.scheduler, engine.stats), engine._next_id, engine._last = kept, 0, ()
        engine.requests.clear()
    gc.collect()
    gc.freeze()
    engine.warmup_seconds = time.perf_counter() - start
    return engine.warmup_seconds


__all__ = ["run_warmup", "short_rows", "warmup", "warmup_waves"]
