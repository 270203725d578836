"""A tiny prefill + decode loop over a paged KV cache, and its contiguous twin.

The model is one attention layer with fixed random weights (no MLP, no vocabulary). Each
sequence starts from a prompt of random hidden states ``[n, hidden]``; after that, the layer's
own output is fed back as the next input::

    q, k, v = x @ Wq, x @ Wk, x @ Wv              # split into heads
    a       = attention(q, K/V of every token so far, including this one)
    x_next  = rms_norm(a @ Wo)                     # the next step's input

Feeding the (normalised) output back stands in for "sample a token, embed it" while keeping
the loop continuous: two implementations that agree up to rounding stay close step after step,
instead of diverging the first time a rounding difference flips an argmax.

:class:`PagedDecoder` keeps K/V in a :class:`~paged_ref.PagedKVCache` managed by a
:class:`~paged_ref.KVCacheManager`: prefill takes ``ceil(n / block_size)`` blocks and writes the
prompt through the sequence's slot mapping; each decode step calls ``append_slot`` (a new block
only when a sequence crosses a block boundary), writes the new token's K/V into that slot and
runs :func:`paged_ref.paged_attention`. :class:`ContiguousDecoder` does the same with one plain,
growing ``[len, num_kv_heads, head_dim]`` tensor per sequence and a dense softmax written out
separately. :func:`run_side_by_side` runs both token by token and records the differences.

    model = TinyAttentionLayer.random(seed=0)
    trace = run_side_by_side(model, prompt_lens=[3, 9, 16], num_steps=12, block_size=4)
    trace.max_diff        # per step (prefill first): max |paged - contiguous|, ~1e-7 in float32
    trace.free_blocks     # free blocks after each step: drops only at block boundaries
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from paged_ref.attention import paged_attention
from paged_ref.cache_math import blocks_needed, default_scale
from paged_ref.memory.manager import KVCacheManager
from paged_ref.memory.storage import PagedKVCache


def rms_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(mean(x**2, last dim) + eps)``, computed in float32, returned in x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@dataclass
class TinyAttentionLayer:
    """One attention layer's weights (float32, fixed by a seed).

    wq [hidden, num_q_heads * head_dim]; wk, wv [hidden, num_kv_heads * head_dim];
    wo [num_q_heads * head_dim, hidden].
    """

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    num_q_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def random(
        cls,
        hidden: int = 64,
        num_q_heads: int = 4,
        num_kv_heads: int = 2,
        head_dim: int = 16,
        seed: int = 0,
    ) -> TinyAttentionLayer:
        """Weights drawn from N(0, 1/fan_in) with a fixed seed."""
        if num_q_heads % num_kv_heads:
            raise ValueError(
                f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
            )
        gen = torch.Generator().manual_seed(seed)

        def w(fan_in: int, fan_out: int) -> torch.Tensor:
            return torch.randn(fan_in, fan_out, generator=gen) / math.sqrt(fan_in)

        return cls(
            wq=w(hidden, num_q_heads * head_dim),
            wk=w(hidden, num_kv_heads * head_dim),
            wv=w(hidden, num_kv_heads * head_dim),
            wo=w(num_q_heads * head_dim, hidden),
            num_q_heads=num_q_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )

    @property
    def hidden(self) -> int:
        """Width of the hidden state."""
        return self.wq.shape[0]

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [n, hidden] float32 -> q [n, Hq, D], k [n, Hkv, D], v [n, Hkv, D] (float32)."""
        n, d = x.shape[0], self.head_dim
        q = (x @ self.wq).view(n, self.num_q_heads, d)
        k = (x @ self.wk).view(n, self.num_kv_heads, d)
        v = (x @ self.wv).view(n, self.num_kv_heads, d)
        return q, k, v

    def next_input(self, attn: torch.Tensor) -> torch.Tensor:
        """attn [n, Hq, D] -> the next input ``rms_norm(attn @ Wo)`` [n, hidden] float32."""
        return rms_norm(attn.float().flatten(1) @ self.wo)

    def random_prompt(self, length: int, seed: int) -> torch.Tensor:
        """A prompt of ``length`` random hidden states [length, hidden] float32."""
        gen = torch.Generator().manual_seed(seed)
        return torch.randn(length, self.hidden, generator=gen)


class PagedDecoder:
    """Decode with K/V in a paged cache: blocks are taken as sequences grow.

    Args:
        model: the layer's weights.
        num_blocks, block_size: the pool (see :class:`paged_ref.KVCacheManager`).
        dtype: cache dtype (q, k, v are cast to it; outputs come back as float32).
        backend: passed to :func:`paged_ref.paged_attention`.
    """

    def __init__(
        self,
        model: TinyAttentionLayer,
        num_blocks: int,
        block_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
        backend: str = "torch",
    ) -> None:
        self.model = model
        self.backend = backend
        self.dtype = dtype
        self.manager = KVCacheManager(num_blocks, block_size)
        self.cache = PagedKVCache(
            1, num_blocks, block_size, model.num_kv_heads, model.head_dim,
            dtype=dtype, device=device,
        )

    def _attend(self, seq_ids: Sequence[Hashable], q: torch.Tensor) -> torch.Tensor:
        """q [B, Hq, D] for the newest token of each sequence -> attention output [B, Hq, D]."""
        block_tables, seq_lens = self.manager.batch_tables(seq_ids, device=self.cache.device)
        k_cache, v_cache = self.cache.layer(0)
        return paged_attention(
            q.to(self.dtype).to(self.cache.device), k_cache, v_cache, block_tables, seq_lens,
            backend=self.backend,
        ).cpu()  # the layer's weights live on the CPU

    def prefill(
        self, seq_ids: Sequence[Hashable], prompts: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Start each sequence with its prompt [n_i, hidden] (n_i >= 1).

        Takes ``ceil(n_i / block_size)`` blocks per sequence, writes the prompt's K/V through
        ``manager.slot_mapping(seq_id)``, and attends from each prompt's last token.
        Returns the first decode inputs [B, hidden] float32.
        """
        last_q = []
        for seq_id, x in zip(seq_ids, prompts, strict=True):
            if x.shape[0] < 1:
                raise ValueError(f"prompt of sequence {seq_id!r} is empty")
            q, k, v = self.model.qkv(x)
            self.manager.add_sequence(seq_id, x.shape[0])
            slots = self.manager.slot_mapping(seq_id)
            self.cache.write(0, self._cast(k), self._cast(v), slots)
            last_q.append(q[-1])
        attn = self._attend(seq_ids, torch.stack(last_q))
        return self.model.next_input(attn)

    def step(self, seq_ids: Sequence[Hashable], x: torch.Tensor) -> torch.Tensor:
        """One decode step: x [B, hidden] (one new token per sequence) -> next inputs [B, hidden].

        Each sequence gets one slot from ``manager.append_slot`` (a new block only at a block
        boundary); the token's K/V are written there before attention reads them.
        """
        q, k, v = self.model.qkv(x)
        slots = self.manager.append_slots(seq_ids)
        self.cache.write(0, self._cast(k), self._cast(v), slots)
        return self.model.next_input(self._attend(seq_ids, q))

    def free(self, seq_id: Hashable) -> None:
        """Finish a sequence: every block it holds goes back to the pool."""
        self.manager.free_sequence(seq_id)

    def _cast(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(device=self.cache.device, dtype=self.dtype)


class ContiguousDecoder:
    """The same loop with one growing ``[len, Hkv, D]`` K and V tensor per sequence.

    No blocks, no tables: what you would write without paging. Attention is a plain float32
    softmax, one sequence at a time (deliberately not shared with the paged code).
    """

    def __init__(self, model: TinyAttentionLayer, *, dtype: torch.dtype = torch.float32) -> None:
        self.model = model
        self.dtype = dtype
        self.k: dict[Hashable, torch.Tensor] = {}
        self.v: dict[Hashable, torch.Tensor] = {}

    def _attend(self, seq_ids: Sequence[Hashable], q: torch.Tensor) -> torch.Tensor:
        out = [dense_decode_attention(q[i].to(self.dtype), self.k[s], self.v[s])
               for i, s in enumerate(seq_ids)]
        return torch.stack(out)

    def prefill(
        self, seq_ids: Sequence[Hashable], prompts: Sequence[torch.Tensor]
    ) -> torch.Tensor:
        """Same contract as :meth:`PagedDecoder.prefill`."""
        last_q = []
        for seq_id, x in zip(seq_ids, prompts, strict=True):
            q, k, v = self.model.qkv(x)
            self.k[seq_id], self.v[seq_id] = k.to(self.dtype), v.to(self.dtype)
            last_q.append(q[-1])
        return self.model.next_input(self._attend(seq_ids, torch.stack(last_q)))

    def step(self, seq_ids: Sequence[Hashable], x: torch.Tensor) -> torch.Tensor:
        """Same contract as :meth:`PagedDecoder.step`: append K/V, then attend."""
        q, k, v = self.model.qkv(x)
        for i, s in enumerate(seq_ids):
            self.k[s] = torch.cat([self.k[s], k[i : i + 1].to(self.dtype)])
            self.v[s] = torch.cat([self.v[s], v[i : i + 1].to(self.dtype)])
        return self.model.next_input(self._attend(seq_ids, q))


def dense_decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One sequence: q [Hq, D], k, v [L, Hkv, D] -> [Hq, D] in q's dtype (float32 math).

    Query head ``h`` reads KV head ``h // (Hq // Hkv)``; scale ``D ** -0.5``.
    """
    num_q_heads, head_dim = q.shape
    group = num_q_heads // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)  # [L, Hq, D]
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("hd,lhd->hl", q.float(), kf) * default_scale(head_dim)
    return torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), vf).to(q.dtype)


@dataclass
class SideBySide:
    """What :func:`run_side_by_side` saw, one entry per step (entry 0 is the prefill).

    max_diff:    max |paged - contiguous| over the step's outputs [B, hidden].
    free_blocks: the paged pool's free blocks after the step.
    seq_lens:    each sequence's length after the step.
    blocks_expected_free: ``num_blocks - sum(ceil(len / block_size))`` after the step.
    """

    max_diff: list[float] = field(default_factory=list)
    free_blocks: list[int] = field(default_factory=list)
    seq_lens: list[list[int]] = field(default_factory=list)
    blocks_expected_free: list[int] = field(default_factory=list)
    free_after_finish: int | None = None
    num_blocks: int = 0


def run_side_by_side(
    model: TinyAttentionLayer,
    prompt_lens: Sequence[int],
    num_steps: int,
    *,
    block_size: int = 4,
    num_blocks: int | None = None,
    dtype: torch.dtype = torch.float32,
    backend: str = "torch",
    seed: int = 0,
    free_at_end: bool = True,
) -> SideBySide:
    """Prefill random prompts of ``prompt_lens`` tokens, decode ``num_steps`` tokens each, with
    both decoders in lock step; return the per-step differences and block counts.

    ``num_blocks`` defaults to exactly what the longest run needs. With ``free_at_end`` every
    sequence is freed afterwards and ``free_after_finish`` records the pool's free count.
    """
    seq_ids = list(range(len(prompt_lens)))
    final = [n + num_steps for n in prompt_lens]
    if num_blocks is None:
        num_blocks = max(1, sum(blocks_needed(n, block_size) for n in final))
    paged = PagedDecoder(model, num_blocks, block_size, dtype=dtype, backend=backend)
    dense = ContiguousDecoder(model, dtype=dtype)
    prompts = [model.random_prompt(n, seed=seed * 1000 + i) for i, n in enumerate(prompt_lens)]
    trace = SideBySide(num_blocks=num_blocks)

    def record(a: torch.Tensor, b: torch.Tensor) -> None:
        lens = [paged.manager.seq_len(s) for s in seq_ids]
        trace.max_diff.append(float((a - b).abs().max()))
        trace.free_blocks.append(paged.manager.num_free_blocks)
        trace.seq_lens.append(lens)
        trace.blocks_expected_free.append(
            num_blocks - sum(blocks_needed(n, block_size) for n in lens)
        )

    x_paged, x_dense = paged.prefill(seq_ids, prompts), dense.prefill(seq_ids, prompts)
    record(x_paged, x_dense)
    for _ in range(num_steps):
        x_paged, x_dense = paged.step(seq_ids, x_paged), dense.step(seq_ids, x_dense)
        record(x_paged, x_dense)
    if free_at_end:
        for s in seq_ids:
            paged.free(s)
        trace.free_after_finish = paged.manager.num_free_blocks
    return trace
