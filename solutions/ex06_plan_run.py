"""Lesson 06: the cost around the kernel -- plan once, run many, CUDA graphs.

A decode step knows its lengths on the host before it launches anything. So the work that needs
values (checks, the split decision, buffers) is done once, on the host, and the step itself
reads nothing back: then it can be captured in a CUDA graph and replayed.

* Ex 6.1 :func:`plan_split_for_host_lengths`  check host lengths, plan the split once, covering
                                              lengths that grow up to ``max_seq_len``
* Ex 6.2 :func:`append_tokens_on_device`      write each sequence's new K/V token and advance the
                                              lengths, on the device, with no host sync
* Ex 6.3 :func:`capture_step`                 capture a step in a CUDA graph (replay = one call);
                                              on a CPU, the step itself
* given  :func:`run_decode_steps`             a decode loop from the three: plan once, then
                                              write new values in place and run the step

Layout (as everywhere in the course)::

    q                [B, Hq, D]
    k_cache, v_cache [num_blocks, block_size, Hkv, D]
    block_tables     [B, max_blocks] int32   token t of sequence b: block block_tables[b, t // bs],
                                             offset t % bs
    seq_lens         [B] int32
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from paged_ref.cache_math import cdiv  # noqa: F401  (you use it in Exercise 6.1)
from paged_ref.kernels.triton.split import SplitPlan, plan_split  # noqa: F401  (Exercise 6.1)


def plan_split_for_host_lengths(
    seq_lens: list[int], *, num_kv_heads: int, max_seq_len: int | None = None,
    num_sms: int = 132,
) -> SplitPlan:
    """Exercise 6.1: the split plan for a batch whose lengths the host already has.

    Args:
        seq_lens: the current length of each sequence, a list of Python ints (a
            ``KVCacheManager`` has them: ``[m.seq_len(s) for s in batch]``).
        num_kv_heads: KV heads of the cache.
        max_seq_len: the longest length a later step may reach (lengths grow by one token per
            decode step); default ``max(seq_lens)`` (0 for an empty batch).
        num_sms: multiprocessors of the GPU (132 on an H100/H200).

    Returns:
        ``plan_split(batch=len(seq_lens), num_kv_heads=..., max_len=max(seq_lens),
        total_tokens=sum(seq_lens), num_sms=num_sms)`` -- and, when that plan splits
        (``num_chunks > 1``), the same chunk size with ``num_chunks = ceil(max_seq_len /
        chunk_size)`` so that the chunks still cover every length up to ``max_seq_len``.
        A one-chunk plan is returned as it is (the one-pass kernel walks any length).

    Raises:
        TypeError: an entry of ``seq_lens`` is not an int (``bool`` is not one): "seq_lens[b]".
        ValueError: an entry is negative ("seq_lens[b]"), or ``max_seq_len`` is below the
            longest length ("max_seq_len").

    Hint: check everything first, then one call to ``plan_split``; ``cdiv`` rounds up.
    """
    # BEGIN SOLUTION
    for b, n in enumerate(seq_lens):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"seq_lens[{b}] must be an int, got {type(n).__name__}")
        if n < 0:
            raise ValueError(f"seq_lens[{b}] = {n} is negative")
    longest = max(seq_lens, default=0)
    max_seq_len = longest if max_seq_len is None else max_seq_len
    if max_seq_len < longest:
        raise ValueError(f"max_seq_len = {max_seq_len} is below the longest length {longest}")
    plan = plan_split(batch=len(seq_lens), num_kv_heads=num_kv_heads, max_len=longest,
                      total_tokens=sum(seq_lens), num_sms=num_sms)
    if plan.num_chunks == 1:
        return plan
    return SplitPlan(plan.chunk_size, cdiv(max_seq_len, plan.chunk_size))
    # END SOLUTION


def append_tokens_on_device(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
) -> None:
    """Exercise 6.2: write one new token per sequence and advance the lengths, in place, with
    no host sync.

    Token ``seq_lens[b]`` (the next position) of sequence ``b`` gets ``k_new[b]`` / ``v_new[b]``
    at slot ``block_tables[b, pos // block_size] * block_size + pos % block_size`` (the host has
    already put that block in the table); then ``seq_lens`` grows by one, in place.

    Args:
        k_cache, v_cache: [num_blocks, block_size, Hkv, D], written in place.
        block_tables: [B, max_blocks] int32.
        seq_lens: [B] int32, advanced in place.
        k_new, v_new: [B, Hkv, D], the cache's dtype.

    Everything must stay tensor operations on the tensors' device: no ``.item()``,
    ``.tolist()``, ``int(t)``, ``.cpu()``, no Python loop over tensor values (each would wait
    for the GPU, and none can be captured in a CUDA graph).

    Hint: ``block_tables.long().gather(1, ...)`` picks one entry per row; ``view(-1, Hkv, D)``
    numbers the cache by slot; ``index_copy_`` writes rows; ``seq_lens.add_(1)``.
    """
    # BEGIN SOLUTION
    block_size = k_cache.shape[1]
    pos = seq_lens.long()
    block = block_tables.long().gather(1, (pos // block_size)[:, None])[:, 0]
    slots = block * block_size + pos % block_size
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k_new)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v_new)
    seq_lens.add_(1)
    # END SOLUTION


def capture_step(step: Callable[[], object]) -> Callable[[], None]:
    """Exercise 6.3: a function that runs ``step`` again, as cheaply as this machine allows.

    On a CUDA GPU: run ``step`` once on a side stream (warm-up: Triton compiles, the caching
    allocator settles), then capture one call in a ``torch.cuda.CUDAGraph`` with
    ``with torch.cuda.graph(graph): step()``, and return ``graph.replay``: every replay re-runs
    the captured kernels on whatever values the step's tensors hold *now* (write new inputs
    into them in place; never replace the tensors). Elsewhere (a CPU has no graphs): return a
    function that calls ``step``, so the same loop runs everywhere.

    Hint: the warm-up is ``s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())``,
    ``with torch.cuda.stream(s): step()``, then ``torch.cuda.current_stream().wait_stream(s)``.
    """
    # BEGIN SOLUTION
    if not torch.cuda.is_available():
        return lambda: step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay
    # END SOLUTION


def run_decode_steps(inp, num_steps: int, *, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """Given: ``num_steps`` decode steps on ``inp`` (a ``PagedInputs`` whose tables already hold
    the blocks for ``num_steps`` more tokens per sequence) with one plan and one captured step.

    The step writes the new K/V (6.2) and runs ``paged_attention(..., plan=plan, out=out)``;
    it is captured once (6.3) and replayed after new ``q``, ``k_new``, ``v_new`` are written
    into its tensors. Returns, per step, (output, float64 reference) -- the reference computed
    from a copy of the inputs after that step.
    """
    import paged_ref

    q, k_cache, v_cache, tables, lens = inp.args()
    batch, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    host_lens = lens.tolist()  # the host's copy, as a KVCacheManager holds it
    capacity = tables.shape[1] * block_size
    plan = paged_ref.plan_decode([n + 1 for n in host_lens], num_q_heads=num_q_heads,
                                 num_kv_heads=num_kv_heads, head_dim=head_dim,
                                 block_size=block_size, dtype=q.dtype, device=q.device,
                                 max_seq_len=min(capacity, max(host_lens) + num_steps))
    k_new = torch.empty(batch, num_kv_heads, head_dim, dtype=q.dtype, device=q.device)
    v_new, out = torch.empty_like(k_new), torch.empty_like(q)

    def step():
        append_tokens_on_device(k_cache, v_cache, tables, lens, k_new, v_new)
        paged_ref.paged_attention(q, k_cache, v_cache, tables, lens, plan=plan, out=out)

    replay = None
    gen = torch.Generator(device=q.device).manual_seed(seed)
    results = []
    for _ in range(num_steps):
        for t in (q, k_new, v_new):  # new values, same tensors
            t.copy_(torch.randn(t.shape, generator=gen, device=q.device, dtype=torch.float32))
        if replay is None:  # capture once (it runs the first step, and on a GPU its warm-up
            snapshot = [t.clone() for t in (k_cache, v_cache, lens)]  # too: undo that one)
            replay = capture_step(step)
            for dst, src in zip((k_cache, v_cache, lens), snapshot, strict=True):
                dst.copy_(src)
        replay()
        ref = paged_ref.reference.paged_attention_reference(q, k_cache, v_cache, tables, lens)
        results.append((out.clone(), ref))
    return results
