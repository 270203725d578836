"""The model runner: a Hugging Face Llama-family model, run over the paged KV cache.

It uses the model's weights (embeddings, norms, projections, rotary embedding, MLPs, LM head)
and replaces attention and the cache. A layer is about ten kernels (the ops of
:mod:`paged_ref.models.fused`; ``h`` the residual stream, ``x`` its normalised copy)::

    qkv = x @ W_qkv;  q = rope_write_kv(qkv, ...)   # q, k rotated; k, v stored at their slots
    a = paged_prefill(q, cache, ..., plan)  or  paged_attention(q, cache, ..., plan)  # planned
    h, x = h + o_proj(a), post_attention_layernorm;  m = silu(x @ W_gate) * (x @ W_up)
    h, x = h + down_proj(m), the next layer's input_layernorm (the final norm last)

A step's requests are one flat batch of ``T`` tokens: request ``b`` owns rows
``query_start_loc[b]:query_start_loc[b+1]``. On a GPU, steps where every request decodes one
token replay CUDA graphs captured per batch-size bucket (1, 2, 4, 8, 16, 32, 48, ...), padded
with rows of length 0 that write to a spare block; prefill and mixed steps of up to 2,048
tokens replay piecewise graphs (:mod:`~paged_ref.models.piecewise`). Greedy rows take the
argmax; sampling rows go to :func:`~paged_ref.sampling.sampler.sample` (outside the graph, from
its hidden states); beam search reads the likeliest tokens and log-probs (``top_logprobs``).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.nn.functional as F

from paged_ref import paged_prefill, plan_decode, plan_prefill
from paged_ref.attention import paged_attention
from paged_ref.cache_math import blocks_needed
from paged_ref.memory.storage import PagedKVCache
from paged_ref.memory.tables import padded_tables, pass_inputs
from paged_ref.models import fused
from paged_ref.models.compat import head_dim_of
from paged_ref.models.piecewise import PiecewiseGraphs
from paged_ref.sampling.sampler import SamplingBatch, sample


@dataclass
class StepInputs:
    """One step's batch, on the host. ``B`` requests, ``T`` tokens in all.

    input_ids, positions, slot_mapping: ``[T]``; query_start_loc: ``[B + 1]``;
    seq_lens: ``[B]`` (tokens in the cache after this step's writes); block_tables: ``B``
    lists; sample_rows: requests (indices into ``B``) whose last token's logits are sampled;
    steps: a multi-step decode's passes per request (``execute_steps``), else None.
    """

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]
    steps: list[int] | None = None

    @property
    def is_decode(self) -> bool:
        """Every request computes exactly one token."""
        return len(self.input_ids) == len(self.seq_lens)


def graph_buckets(max_num_seqs: int) -> list[int]:
    """Batch sizes that get a CUDA graph: 1, 2, 4, 8, then every 16 up to ``max_num_seqs``."""
    small = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    return small + list(range(16, max_num_seqs, 16)) + [max_num_seqs]


class ModelRunner:
    """Runs ``model`` (a transformers ``LlamaForCausalLM``-like model) one step at a time.

    Args:
        model: used in place, never changed (one model can back several runners). The runner
            keeps each layer's q/k/v weights stacked into one matrix and gate/up into another
            (:func:`fused.fuse_linears`, made once): about half the parameters again.
        num_blocks, block_size: the scheduler's KV pool (plus one scratch block for padding).
        num_host_blocks, disk_tier: the tiers under the pool (``PagedKVCache``'s).
        attention_backend: ``backend=`` of ``paged_prefill`` / ``plan_decode``.
        cuda_graphs: capture decode steps, and prefill / mixed steps piecewise (default: on a
            CUDA device). max_num_seqs, max_model_len, max_num_batched_tokens: their sizes.
        kv_format: a quantised cache format (``paged_ref.QuantizedKV``), or None for plain.
        fused_backend: ``"auto"`` (Triton on a GPU), ``"torch"`` or ``"triton"``.
    """

    def __init__(self, model, num_blocks: int, block_size: int, *, num_host_blocks: int = 0,
                 disk_tier=None, attention_backend: str = "auto",
                 cuda_graphs: bool | None = None, max_num_seqs: int = 256,
                 max_model_len: int = 4096, kv_format: str | None = None,
                 fused_backend: str = "auto", max_num_batched_tokens: int = 2048) -> None:
        cfg = model.config
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"model.config.hidden_act must be 'silu' (a Llama MLP), got "
                             f"{cfg.hidden_act!r}")
        self.model = model
        self.layers = list(model.model.layers)
        self.num_q_heads = cfg.num_attention_heads
        self.head_dim = head_dim_of(cfg)
        self.scale = self.layers[0].self_attn.scaling
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.fused_backend = fused.choose_backend(fused_backend, self.device)
        self.norms = [m for layer in self.layers
                      for m in (layer.input_layernorm, layer.post_attention_layernorm)]
        self.norms.append(model.model.norm)  # norms[2i], norms[2i+1]: layer i's; last: final
        self.qkv = [fused.fuse_linears(a.q_proj, a.k_proj, a.v_proj)
                    for a in (layer.self_attn for layer in self.layers)]
        self.gate_up = [fused.fuse_linears(layer.mlp.gate_proj, layer.mlp.up_proj)
                        for layer in self.layers]
        self.block_size = block_size
        self.cache = PagedKVCache(len(self.layers), num_blocks + 1, block_size,
                                  cfg.num_key_value_heads, self.head_dim, dtype=self.dtype,
                                  device=self.device, num_host_blocks=num_host_blocks,
                                  kv_format=kv_format, disk_tier=disk_tier)
        self.plan_args = dict(num_q_heads=self.num_q_heads, num_kv_heads=cfg.num_key_value_heads,
                              head_dim=self.head_dim, block_size=block_size, dtype=self.dtype,
                              device=self.device, scale=self.scale, backend=attention_backend,
                              kv_format=getattr(self.cache.k_caches[0], "format", None))
        self.scratch_slot = num_blocks * block_size  # first slot of the padding rows' block
        self.max_blocks_per_seq = blocks_needed(max_model_len, block_size)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}  # decode steps, by batch bucket
        self.piecewise: PiecewiseGraphs | None = None  # prefill / mixed steps, by token bucket
        if cuda_graphs is None:
            cuda_graphs = self.device.type == "cuda"
        if cuda_graphs:
            with self._on_device():  # capture on the model's GPU, whichever device is current
                self._capture(graph_buckets(max_num_seqs))
                self.piecewise = PiecewiseGraphs(self, max_num_batched_tokens, max_num_seqs,
                                                 self._capture_one)

    # ---- the forward pass -------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, input_ids, positions, slot_mapping, attend) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]`` in the model's dtype.

        Args:
            input_ids, positions, slot_mapping: int64 ``[T]`` on the model's device.
            attend: ``attend(layer, q)`` runs attention over the cache (after this step's K/V
                are written) for ``q`` ``[T, Hq, D]`` and returns ``[T, Hq, D]``.
        """
        h, x, cos, sin = self._embed(input_ids, positions)
        for i in range(len(self.layers)):
            q = self._qkv(i, x, cos, sin, slot_mapping)
            h, x = self._after_attention(i, h, attend(i, q))
        return x

    def _embed(self, input_ids, positions):  # (forward's pieces: what piecewise.py captures)
        """Embeddings ``h`` ``[T, hidden]``, normalised ``x``, rotary ``cos, sin`` ``[T, D]``."""
        inner = self.model.model
        h = inner.embed_tokens(input_ids)
        cos, sin = inner.rotary_emb(h, positions[None])
        h, x = self._add_norm(h, None, 0)
        return h, x, cos[0], sin[0]

    def _qkv(self, i: int, x, cos, sin, slot_mapping) -> torch.Tensor:
        """Layer ``i``'s q ``[T, Hq, D]`` rotated; its k (rotated) and v written at the slots."""
        return fused.rope_write_kv(F.linear(x, *self.qkv[i]), cos, sin, self.cache.k_caches[i],
                                   self.cache.v_caches[i], slot_mapping, self.num_q_heads,
                                   backend=self.fused_backend)

    def _after_attention(self, i: int, h, a):
        """Layer ``i`` after its attention ``a`` ``[T, Hq, D]``: o_proj and the MLP, each
        added to the residual ``h``; returns ``(h, x)``, ``x`` normalised for what follows."""
        layer = self.layers[i]
        h, x = self._add_norm(h, layer.self_attn.o_proj(a.reshape(a.shape[0], -1)), 2 * i + 1)
        m = fused.silu_mul(F.linear(x, *self.gate_up[i]), backend=self.fused_backend)
        return self._add_norm(h, layer.mlp.down_proj(m), 2 * i + 2)

    def _add_norm(self, h, delta, norm_index: int):
        """``h + delta`` and its normalisation by ``self.norms[norm_index]``."""
        norm = self.norms[norm_index]
        return fused.add_rms_norm(h, delta, norm.weight, norm.variance_epsilon,
                                  backend=self.fused_backend)

    # ---- one step ---------------------------------------------------------------------------

    def _on_device(self):
        """The model's GPU as the current device (graphs are its own), a no-op on the CPU."""
        return torch.cuda.device(self.device) if self.device.type == "cuda" else nullcontext()

    @torch.inference_mode()
    def execute(self, step: StepInputs, sampling: SamplingBatch | None = None) -> list[int]:
        """Run one step; return the next token of each of ``step.sample_rows``.

        Args:
            step: the batch (host lists). A request may be sampled twice (its row listed twice
                in ``sample_rows``: the samples of a request with ``n > 1``, at its first token).
            sampling: which of the sampled rows sample, and how; the others (all, when None)
                take the argmax, of the logits in their own dtype (as exact as float32).

        Returns:
            ``len(step.sample_rows)`` token ids: the step's one read-back.
        """
        if not step.input_ids:
            return []
        tokens, hidden = self._run(step)
        if sampling is not None:
            rows = torch.tensor(sampling.rows, device=self.device)
            tokens[rows] = sample(self.model.lm_head(hidden[rows]), sampling)
        return tokens.tolist()

    @torch.inference_mode()
    def execute_steps(self, step: StepInputs) -> list[list[int]]:
        """Run ``max(step.steps)`` greedy decode passes of the decode step ``step`` back to
        back, each request's input the token its pass before picked, and read the tokens back
        once, at the end (multi-step decoding). Request ``b`` runs its first ``step.steps[b]``
        passes (its blocks taken ahead: ``KVCacheManager.lookahead``); in the passes after,
        its row writes to the scratch slot. Returns each request's ``step.steps[b]`` tokens."""
        passes = pass_inputs(step.block_tables, step.positions, step.steps,
                             self.block_size, self.scratch_slot)
        if self._graphed(step):
            with self._on_device():
                tokens = self._replay(step, passes)[0]
        else:
            tokens, ids = [], torch.tensor(step.input_ids, device=self.device)
            for pos, slots, lens in zip(*passes, strict=True):
                one = replace(step, seq_lens=lens.tolist())  # (what _attend reads)
                ids = self.model.lm_head(self.forward(
                    ids, torch.from_numpy(pos).to(self.device),
                    torch.from_numpy(slots).to(self.device), self._attend(one))).argmax(dim=-1)
                tokens.append(ids)
            tokens = torch.stack(tokens)
        rows = tokens[:, :len(step.seq_lens)].T.tolist()
        return [row[:n] for row, n in zip(rows, step.steps, strict=True)]

    @torch.inference_mode()
    def top_logprobs(self, step: StepInputs, k: int) -> list[list[tuple[float, int]]]:
        """Run one step; return each sampled row's ``k`` likeliest next tokens as ``(log-prob,
        token)`` pairs, best first: float32 ``log_softmax`` of the logits, as transformers'
        beam search takes them (:class:`~paged_ref.sampling.beam.BeamSearch` reads them)."""
        if not step.input_ids:
            return []
        top = self.model.lm_head(self._run(step)[1]).float().log_softmax(dim=-1).topk(k)
        return [list(zip(v, t, strict=True)) for v, t in zip(top.values.tolist(),
                                                             top.indices.tolist(), strict=True)]

    def _run(self, step: StepInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward pass of ``step``: the argmax tokens ``[R]`` and final hidden states
        ``[R, hidden]`` of its ``R = len(sample_rows)`` sampled rows."""
        batch, dev = len(step.seq_lens), self.device
        if self._graphed(step):  # (a 1-token chunk of a prompt, not its last, runs here too)
            with self._on_device():  # replay on the GPU the graphs belong to
                tokens, hidden = self._replay(step)  # (every row of the bucket)
            tokens = tokens[0]
            if step.sample_rows == list(range(batch)):  # (most: every row, once)
                return tokens[:batch], hidden[:batch]
            rows = torch.tensor(step.sample_rows, device=dev)
            return tokens[:batch][rows], hidden[:batch][rows]
        bucket = self.piecewise.bucket_of(step) if self.piecewise is not None else None
        if bucket is not None:  # (a prefill / mixed step of up to piecewise.MAX_TOKENS)
            with self._on_device():
                return self.piecewise.run(step, bucket, self._attend(step))
        ids, pos, slots = torch.tensor([step.input_ids, step.positions,
                                        step.slot_mapping]).to(dev)
        last = torch.tensor([step.query_start_loc[b + 1] - 1 for b in step.sample_rows],
                            dtype=torch.long, device=dev)
        hidden = self.forward(ids, pos, slots, self._attend(step))[last]
        return self.model.lm_head(hidden).argmax(dim=-1), hidden

    def _graphed(self, step: StepInputs) -> bool:
        """Whether ``step`` replays a CUDA graph: one token a request, a bucket that fits."""
        return step.is_decode and bool(self.graphs) and len(step.seq_lens) <= max(self.graphs)

    def _attend(self, step: StepInputs):
        """``attend(layer, q)`` for :meth:`forward`: decode (planned) or prefill attention."""
        c, tables = self.cache, padded_tables(step.block_tables,
                                              len(step.block_tables)).to(self.device)
        seq_lens = torch.tensor(step.seq_lens, dtype=torch.int32, device=self.device)
        if step.is_decode:
            plan = plan_decode(step.seq_lens, **self.plan_args)
            return lambda i, q: paged_attention(q, c.k_caches[i], c.v_caches[i], tables,
                                                seq_lens, plan=plan)
        qsl = torch.tensor(step.query_start_loc, dtype=torch.int32, device=self.device)
        plan = plan_prefill(np.diff(step.query_start_loc).tolist(), step.seq_lens,
                            **self.plan_args)  # one plan a step: no layer reads a value back
        return lambda i, q: paged_prefill(q, c.k_caches[i], c.v_caches[i], tables, seq_lens,
                                          qsl, plan=plan)

    # ---- CUDA graphs for decode steps ---------------------------------------------------------

    def _capture(self, buckets: list[int]) -> None:
        """Capture one decode step per bucket size into CUDA graphs (largest first, one pool)."""
        dev, n = self.device, max(buckets)
        self.g_input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=dev)
        self.g_seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.g_tables = torch.zeros(n, self.max_blocks_per_seq, dtype=torch.int32, device=dev)
        self.g_tokens = torch.zeros(n, dtype=torch.long, device=dev)
        self.g_hidden = torch.zeros(n, self.model.config.hidden_size, dtype=self.dtype,
                                    device=dev)  # (what sampling rows read after a replay)
        max_len = self.max_blocks_per_seq * self.block_size
        pool, c = None, self.cache
        for b in sorted(buckets, reverse=True):
            plan = plan_decode([0] * b, max_seq_len=max_len, **self.plan_args)

            def step(b=b, plan=plan):
                def attend(i, q):
                    return paged_attention(q, c.k_caches[i], c.v_caches[i], self.g_tables[:b],
                                           self.g_seq_lens[:b], plan=plan)
                hidden = self.forward(self.g_input_ids[:b], self.g_positions[:b],
                                      self.g_slots[:b], attend)
                self.g_hidden[:b] = hidden
                self.g_tokens[:b] = self.model.lm_head(hidden).argmax(dim=-1)

            graph = self._capture_one(step, pool)
            pool = graph.pool() if pool is None else pool
            self.graphs[b] = graph

    @staticmethod
    @torch.inference_mode()
    def _capture_one(step, pool):
        """Run ``step`` once (Triton compiles, cuBLAS picks kernels), capture it, and replay it
        once: a graph's first launch also uploads it to the GPU, which would otherwise land in
        the first ``generate`` (the static buffers still hold the scratch slot, length 0)."""
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            step()
        graph.replay()
        torch.cuda.synchronize()
        return graph

    def _replay(self, step: StepInputs, passes=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the step into the static buffers (one copy from pinned memory: nothing waits),
        replay its bucket's graph; returns the greedy tokens ``[1, bucket]`` and (a view of)
        the hidden states ``[bucket, hidden]``. ``passes``: a multi-step decode's inputs
        (``pass_inputs``): one replay each, its input ids the tokens of the one before;
        tokens ``[passes, bucket]``, the last pass's hidden states."""
        batch = len(step.seq_lens)
        bucket = min(b for b in self.graphs if b >= batch)
        if passes is None:
            passes = [np.array([v]) for v in (step.positions, step.slot_mapping, step.seq_lens)]
        host = np.zeros((len(passes[0]), 4, bucket), dtype=np.int64)  # padding rows: length 0
        host[:, 1] = self.scratch_slot
        for j, values in enumerate(passes):
            host[:, j, :batch] = values
        host[0, 3, :batch] = step.input_ids
        def pinned(t):  # (a test's fake graphs run on the CPU)
            return t.pin_memory() if self.device.type == "cuda" else t
        dev = pinned(torch.from_numpy(host)).to(self.device, non_blocking=True)
        tables = pinned(padded_tables(step.block_tables, bucket))
        self.g_tables[:bucket, :tables.shape[1]].copy_(tables, non_blocking=True)
        self.g_input_ids[:bucket].copy_(dev[0, 3])
        tokens = torch.empty(len(host), bucket, dtype=torch.long, device=self.device)
        for k in range(len(host)):
            for buffer, row in zip((self.g_positions, self.g_slots, self.g_seq_lens), dev[k, :3],
                                   strict=True):
                buffer[:bucket].copy_(row)
            self.graphs[bucket].replay()
            tokens[k] = self.g_tokens[:bucket]
            self.g_input_ids[:bucket].copy_(self.g_tokens[:bucket])
        return tokens, self.g_hidden[:bucket]
