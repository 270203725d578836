"""Piecewise CUDA graphs for prefill and mixed steps (vLLM's "piecewise" CUDA graphs).

A decode step has the same shape every time (one token a request), so the runner captures it
whole, attention included. A prefill or mixed step does not: its attention launches depend on
how the step's tokens split into requests (the plan). But everything *between* two attentions
-- o_proj, add + norm, the MLP, the next layer's qkv and rotary + K/V write -- depends only on
the step's token count. So a step of ``T`` tokens is padded to a token bucket ``n >= T`` and
runs as ``L + 1`` replayed graphs with the ``L`` attentions launched eagerly between them::

    graph 0:      embed, norm, layer 0's qkv + rope/K,V write        -> q
    attention 0:  paged_prefill(q[:T], ..., plan)                      -> attn   (eager)
    graph i:      layer i-1's o_proj + MLP, layer i's qkv + rope/write -> q      (1 <= i < L)
    graph L:      layer L-1's o_proj + MLP, final norm, LM head of the sampled rows

What a step pays on the host drops from about ten kernel launches a layer, each a Python call
(eager, a 64 + 63-token step took 12.4 ms on an H200's host for 1.5 ms of kernels), to one
replay and one attention launch a layer. The
graphs read and write static buffers (``ids``, ``positions``, ``slots``, ``last``, the residual
``h``, ``q``, ``attn``, rotary ``cos``/``sin``); padding rows hold token 0 at position 0 and
write their K/V to the runner's scratch slot, and attention reads only the ``T`` real rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

#: The largest step replayed piecewise: past about 2,000 tokens (1B shape, H200) a step's
#: kernels take longer than its eager launches, so graphs would only add padding.
MAX_TOKENS = 2048


def token_buckets(max_tokens: int) -> list[int]:
    """Token counts that get piecewise graphs: 16, 32, 64, 128, then every 128 to 1,024, then
    every 256, up to ``max_tokens`` (itself the last). A step pads to the next one."""
    sizes = [16, 32, 64, *range(128, 1025, 128), *range(1280, max_tokens, 256)]
    return sorted({n for n in sizes if n < max_tokens} | {max_tokens})


class PiecewiseGraphs:
    """The piecewise graphs of one :class:`~paged_ref.engine.runner.ModelRunner`, per bucket.

    Args:
        runner: its ``_embed``, ``_qkv`` and ``_after_attention`` are the pieces captured.
        max_tokens: the largest bucket, at most :data:`MAX_TOKENS` (steps with more tokens
            run eagerly).
        max_rows: the most sampled rows a step may have (its LM head runs on this many rows,
            or on the bucket's token count if that is smaller).
        capture_one: ``capture_one(fn, pool) -> graph`` (``ModelRunner._capture_one``).
    """

    def __init__(self, runner, max_tokens: int, max_rows: int, capture_one: Callable) -> None:
        self.runner, self.buckets = runner, token_buckets(min(max_tokens, MAX_TOKENS))
        n, dev, dtype = max(self.buckets), runner.device, runner.dtype
        hidden = runner.model.config.hidden_size
        self.max_rows = max_rows
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), runner.scratch_slot, dtype=torch.long, device=dev)
        self.last = torch.zeros(self.rows(n), dtype=torch.long, device=dev)  # sampled rows
        self.h = torch.zeros(n, hidden, dtype=dtype, device=dev)  # the residual stream
        self.q = torch.zeros(n, runner.num_q_heads, runner.head_dim, dtype=dtype, device=dev)
        self.attn = torch.zeros_like(self.q)
        self.cos = torch.zeros(n, runner.head_dim, dtype=dtype, device=dev)
        self.sin = torch.zeros_like(self.cos)
        self.tokens = torch.zeros(self.rows(n), dtype=torch.long, device=dev)
        self.hidden = torch.zeros(self.rows(n), hidden, dtype=dtype, device=dev)
        self.graphs: dict[int, list] = {}
        pool = None
        for bucket in sorted(self.buckets, reverse=True):  # (largest first: one memory pool)
            graphs = []
            for piece in range(len(runner.layers) + 1):
                graph = capture_one(lambda b=bucket, p=piece: self._piece(b, p), pool)
                pool = graph.pool() if pool is None else pool
                graphs.append(graph)
            self.graphs[bucket] = graphs

    def rows(self, bucket: int) -> int:
        """Sampled rows the LM head of a ``bucket``-token step runs on."""
        return min(bucket, self.max_rows)

    def bucket_of(self, step) -> int | None:
        """The bucket ``step`` (a ``StepInputs``) replays, or None (it runs eagerly)."""
        bucket = next((b for b in self.buckets if b >= len(step.input_ids)), None)
        if bucket is None or len(step.sample_rows) > self.rows(bucket):
            return None
        return bucket

    @torch.inference_mode()
    def _piece(self, n: int, piece: int) -> None:
        """Graph ``piece`` of bucket ``n`` (see the module doc), static buffers in and out."""
        r, last_layer = self.runner, len(self.runner.layers) - 1
        if piece == 0:
            h, x, cos, sin = r._embed(self.ids[:n], self.positions[:n])
            self.cos[:n], self.sin[:n] = cos, sin
        else:
            h, x = r._after_attention(piece - 1, self.h[:n], self.attn[:n])
        if piece <= last_layer:
            self.h[:n] = h
            self.q[:n] = r._qkv(piece, x, self.cos[:n], self.sin[:n], self.slots[:n])
        else:
            rows = self.rows(n)
            self.hidden[:rows] = hidden = x[self.last[:rows]]
            self.tokens[:rows] = r.model.lm_head(hidden).argmax(dim=-1)

    @torch.inference_mode()
    def run(self, step, bucket: int, attend) -> tuple[torch.Tensor, torch.Tensor]:
        """Run ``step`` (``T`` tokens, ``bucket_of(step)`` == ``bucket``) through its bucket's
        graphs, ``attend(layer, q)`` (``ModelRunner._attend``) between them. Returns views of
        the greedy tokens ``[R]`` and final hidden states ``[R, hidden]`` of its ``R`` sampled
        rows (valid until the next step)."""
        tokens, rows = len(step.input_ids), self.rows(bucket)
        host = np.zeros((3, bucket), dtype=np.int64)  # padding: token 0, position 0, scratch
        host[2] = self.runner.scratch_slot
        host[:, :tokens] = step.input_ids, step.positions, step.slot_mapping
        last = np.zeros(rows, dtype=np.int64)
        last[:len(step.sample_rows)] = [step.query_start_loc[b + 1] - 1 for b in step.sample_rows]
        up = torch.from_numpy(np.concatenate([host.ravel(), last]))
        up = (up.pin_memory() if self.ids.is_cuda else up).to(self.ids.device, non_blocking=True)
        for buffer, values in zip((self.ids, self.positions, self.slots),
                                  up[:3 * bucket].view(3, bucket), strict=True):
            buffer[:bucket].copy_(values)
        self.last[:rows].copy_(up[3 * bucket:])
        graphs = self.graphs[bucket]
        graphs[0].replay()
        for layer, graph in enumerate(graphs[1:]):
            self.attn[:tokens] = attend(layer, self.q[:tokens])
            graph.replay()
        sampled = len(step.sample_rows)
        return self.tokens[:sampled], self.hidden[:sampled]


__all__ = ["MAX_TOKENS", "PiecewiseGraphs", "token_buckets"]
