"""Plans for the CUDA decode kernels: the launch settled once (:func:`plan_cuda`,
:func:`plan_cuda_for` -> :class:`CudaDecodePlan`), then only launched
(:meth:`CudaDecodePlan.run`); :func:`paged_attention_cuda` is one of each.

The inputs are the caller's to check: ``paged_ref.paged_attention`` (``backend="cuda"`` or
``"auto"``), ``plan_decode`` and ``paged_prefill`` validate theirs before they get here. A plan
checks what the kernels themselves need (:func:`~paged_ref.kernels.cuda.launch.
check_cuda_inputs`) and that the tensors fit one another, and reads no table value: a length
past its table, or a table entry past the cache, is read as it stands.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass, field

import torch

from paged_ref import _device
from paged_ref.kernels.cuda import build, driver
from paged_ref.kernels.cuda.build import MAX_MERGE_WARPS, MAX_WARPS, TMA_HEADS, Build
from paged_ref.kernels.cuda.launch import (
    WARPS_PER_HEAD,
    check_cuda_inputs,
    default_launch,
    default_stages,
    heads_per_cta,
    kernel_name,
    shared_bytes,
    tma_feeds,
    tma_shared_bytes,
)


@dataclass(frozen=True)
class CudaDecodePlan:
    """A prepared launch of the CUDA FP8 or INT4 kernel, as :func:`paged_ref.plan_decode` is
    for the Triton ones: the kernels, the chunking and the scratch buffers are settled once by
    :func:`plan_cuda`; :meth:`run` fills in the tensors' addresses and launches (no tensor
    value read, nothing allocated but the output). Lengths up to ``max_len`` are covered; the
    kernel clamps longer ones to it (cut short, never read past the table)."""

    q_shape: tuple
    q_dtype: torch.dtype
    cache_shape: tuple  # (block_size, Hkv, head_dim): any number of blocks
    kv_format: object
    device_index: int
    decode: ctypes.c_void_p
    merge: ctypes.c_void_p | None
    grid: tuple
    threads: int
    smem: int
    merge_threads: int
    chunk_len: int
    max_chunks: int
    max_len: int
    heads_per_cta: int
    stages: int  # tiles in each warp's shared-memory ring
    qk_scale_log2: float
    part_o: torch.Tensor | None  # [B, Hq, max_chunks, D] float32 scratch (None: one chunk)
    part_lse: torch.Tensor | None
    dependent_merge: bool = True  # the merge as a programmatic dependent launch (Hopper+)
    tma: bool = False  # int4_decode_tma (tma_feeds): the TMA unit reads the cache
    # its descriptions of the caches seen so far (driver.tma_maps), by address, shape and
    # strides: a cache is described once, not on every call
    tensor_maps: dict = field(default_factory=dict, compare=False, repr=False)

    def run(self, q, k_cache, v_cache, block_tables, seq_lens, out=None) -> torch.Tensor:
        """Attention for these tensors (shaped, typed and placed as planned): q ``[batch, Hq,
        head_dim]``, the caches' blocks ``(block_size, Hkv, head_dim)`` of the planned format,
        ``block_tables`` ``[batch, max_blocks]`` and ``seq_lens`` ``[batch]`` int32. Returns
        ``[batch, Hq, head_dim]`` in q's dtype (``out`` when given).

        Its host time counts as much as the kernel's: B1_L131072's INT4 call lasts ~57 us on
        the H200, and this method took 86-94 us of the GPU machine's host, so that the bench's
        timer (and a serving loop) waited on Python: 75 us for what a CUDA graph of the same
        call replays in 57. Read once per tensor, strides cost little; the stream is taken as a
        raw handle, and the merge's launch configuration is made once: 25-28 us (FP8 15-20),
        and the bench's timer agrees with the graph (host_cost_probe, commit 9ae93fd).

        Raises:
            ValueError: q or a cache not as planned, cache strides past 2^31 elements.
        """
        qs = q.stride()
        if (tuple(q.shape) != self.q_shape or q.dtype != self.q_dtype
                or q.get_device() != self.device_index or qs[-1] != 1):
            raise ValueError(f"q {tuple(q.shape)} {q.dtype} on {q.device} does not match the "
                             f"plan: {self.q_shape} {self.q_dtype} on cuda:{self.device_index}, "
                             "head_dim contiguous")
        for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
            if (getattr(c, "format", None) != self.kv_format
                    or tuple(c.shape[1:]) != self.cache_shape):
                raise ValueError(f"{name} is not a {self.kv_format.name} cache of blocks "
                                 f"{self.cache_shape} (block_size, Hkv, head_dim) as planned")
        if out is None:
            out = torch.empty_like(q)
        if self.q_shape[0] == 0:
            return out
        if qs[0] % 4 or qs[1] % 4 or q.data_ptr() % 8:  # read 4 elements at a time
            q = q.contiguous()
            qs = q.stride()
        target = out
        # The kernel stores 4 channels at a time: an out it cannot (strides not multiples of 4
        # elements) gets the answer through a contiguous temporary.
        o_s = out.stride()
        if o_s[0] % 4 or o_s[1] % 4 or out.data_ptr() % 8 or o_s[2] != 1:
            out = torch.empty_like(q, memory_format=torch.contiguous_format)
            o_s = out.stride()
        data, v_data = k_cache.data, v_cache.data
        ds = data.stride()
        if v_data.stride() != ds:  # the kernel reads V at K's offsets
            data, v_data = data.contiguous(), v_data.contiguous()
            ds = data.stride()
        if block_tables.stride(1) != 1:  # (the kernel steps through both by 1)
            block_tables = block_tables.contiguous()
        seq_lens = seq_lens.contiguous()
        ks, vs, kz, vz = k_cache.scale, v_cache.scale, k_cache.zero, v_cache.zero
        ss = ks.stride()
        if kz is not None:  # int4: (scale, zero) pairs read 4 bytes at a time, at K's offsets
            pairs = (ks, kz, vs, vz)
            if (ss[-1] != 1 or any(x % 2 for x in ss[:3])
                    or any(t.stride() != ss or t.data_ptr() % 4 for t in pairs)):
                ks, kz, vs, vz = (t.contiguous() for t in pairs)
                ss = ks.stride()
        elif vs.stride() != ss:
            ks, vs = ks.contiguous(), vs.contiguous()
            ss = ks.stride()
        maps = None
        if self.tma:  # the TMA unit's descriptions of these tensors (once per cache)
            key = (data.data_ptr(), v_data.data_ptr(), ks.data_ptr(), kz.data_ptr(),
                   vs.data_ptr(), vz.data_ptr(), data.shape[0], ds, ss)
            maps = self.tensor_maps.get(key)
            if maps is None:
                if not all(driver.tma_readable(c, (ks, kz, vs, vz)) for c in (data, v_data)):
                    # (copies, laid out and aligned as the TMA unit reads them, every call)
                    data, v_data, ks, kz, vs, vz = (t.clone(memory_format=torch.contiguous_format)
                                                    for t in (data, v_data, ks, kz, vs, vz))
                    ds, ss = data.stride(), ks.stride()
                    maps = driver.tma_maps(data, v_data, (ks, kz, vs, vz))
                else:
                    if len(self.tensor_maps) >= 16:  # (caches come and go: keep the last few)
                        self.tensor_maps.clear()
                    maps = self.tensor_maps[key] = driver.tma_maps(data, v_data,
                                                                   (ks, kz, vs, vz))
        s_strides = ss[:3] if len(ss) >= 3 else (0, 0, 0)
        if max(*ds, *s_strides) >= 2 ** 31:  # (the kernels step within a block in int)
            raise ValueError(f"the CUDA kernels take caches whose strides fit 32 bits; got "
                             f"codes {ds}, scales {s_strides}")
        part_o = out if self.part_o is None else self.part_o
        part_lse = out if self.part_lse is None else self.part_lse
        args = driver.Args(
            q.data_ptr(), data.data_ptr(), v_data.data_ptr(), ks.data_ptr(), vs.data_ptr(),
            block_tables.data_ptr(), seq_lens.data_ptr(), out.data_ptr(), part_o.data_ptr(),
            part_lse.data_ptr(), kz.data_ptr() if kz is not None else None,
            vz.data_ptr() if vz is not None else None, qs[0], qs[1], o_s[0], o_s[1],
            ds[0], ds[1], ds[2], *s_strides, block_tables.stride(0),
            int(math.log2(self.cache_shape[0])), self.q_shape[1] // self.cache_shape[1],
            self.chunk_len, self.max_chunks, self.max_len, self.heads_per_cta,
            self.qk_scale_log2)
        if maps is not None:  # (6 maps, in Args' order: one copy of 768 bytes)
            ctypes.memmove(ctypes.addressof(args) + driver.Args.k_map.offset, maps,
                           ctypes.sizeof(maps))
        stream = _device.current_stream_handle(self.device_index)
        driver.launch(self.decode, self.grid, self.threads, self.smem, args, stream)
        if self.merge is not None:
            launch = driver.launch_dependent if self.dependent_merge else driver.launch
            launch(self.merge, (self.q_shape[1], self.q_shape[0], 1), self.merge_threads, 0,
                   args, stream)
        if target is not out:
            target.copy_(out)
        return target


def _check_layout(q, k_cache, block_tables, seq_lens) -> None:
    """That the tensors fit one another as the launch assumes (reads no value): q ``[batch,
    Hq, head_dim]`` over the cache's head_dim and a multiple of its KV heads, int32
    ``block_tables [batch, max_blocks]`` and ``seq_lens [batch]``, all on q's device."""
    batch, num_q_heads, head_dim = q.shape if q.dim() == 3 else (None, None, None)
    if head_dim != k_cache.shape[3] or num_q_heads % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}: "
                         "[batch, Hq, head_dim] with Hq a multiple of Hkv expected")
    for name, t, rank in (("block_tables", block_tables, 2), ("seq_lens", seq_lens, 1)):
        if t.dtype != torch.int32 or t.dim() != rank or t.shape[0] != batch:
            raise ValueError(f"{name} must be int32 with {rank} dimension(s), {batch} rows; "
                             f"got {t.dtype} {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def plan_cuda(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None, chunk_len=None,
              max_len=None, total_tokens=None, stages=None, warps_per_head=None,
              tma=None) -> CudaDecodePlan:
    """A :class:`CudaDecodePlan` for these tensors (or others like them): ``fp8`` /
    ``fp8_token_head`` caches or ``int4`` ones (a (scale, zero) pair per nibble half), q
    float16 / bfloat16 ``[batch, Hq, head_dim]``, int32 ``block_tables`` and ``seq_lens``.
    The kernels take what :func:`~paged_ref.kernels.cuda.launch.check_cuda_inputs` lets
    through; table values are the caller's to check (the module docstring).

    ``max_len`` (the longest sequence) and ``total_tokens`` are read from ``seq_lens`` when
    ``max_len`` is not given (one read-back); the other keywords are :func:`plan_cuda_for`'s.

    Raises:
        TypeError, ValueError: what the kernels do not read, tensors that do not fit.
    """
    kind = getattr(getattr(k_cache, "format", None), "kind", "fp8")
    check_cuda_inputs(q, k_cache, v_cache, kind if kind == "int4" else "fp8", stages)
    _check_layout(q, k_cache, block_tables, seq_lens)
    if max_len is None:
        lens = seq_lens.long()
        max_len, total_tokens = (torch.stack((lens.max(), lens.sum())).tolist()
                                 if len(lens) else (0, 0))
    return plan_cuda_for(q.shape, k_cache.shape[1], k_cache.shape[2], q.dtype, q.device,
                         k_cache.format, max_len=max_len, total_tokens=total_tokens,
                         scale=scale, chunk_len=chunk_len, stages=stages,
                         warps_per_head=warps_per_head, tma=tma)


def plan_cuda_for(q_shape, block_size: int, num_kv_heads: int, dtype: torch.dtype, device,
                  kv_format, *, max_len: int, total_tokens: int | None = None, scale=None,
                  chunk_len=None, stages=None, warps_per_head=None,
                  tma=None) -> CudaDecodePlan:
    """:func:`plan_cuda` from sizes alone (q ``[batch, Hq, head_dim]``, the cache's block
    size, KV heads and format), for callers that checked their inputs already:
    :func:`paged_ref.plan_decode` and ``paged_attention(backend="auto")`` on quantised caches.
    The plan runs on caches of any number of blocks.

    The launch, each a real choice of the plans (unset, :func:`~paged_ref.kernels.cuda.launch.
    default_launch` and :func:`~paged_ref.kernels.cuda.launch.default_stages` pick them by
    sizes):

    chunk_len:      tokens per CTA and KV head (rounded up to 16): long sequences cut into
                    chunks that fill the SMs, merged by a second kernel.
    warps_per_head: 1, 2 or 4 warps sharing a KV head's tiles (a build each,
                    ``WARPS_PER_HEAD``): FP8 batches too short to fill the SMs with one warp a
                    head run whole sequences with 2 or 4. Given alone: whole sequences.
    stages:         tiles in each ring, 2..8 (a build each, ``STAGES``): 2 where FP8 has two
                    CTAs per SM or more, 4-5 for the TMA-fed ring, else 3.
    tma:            ``None``: the TMA-fed INT4 kernel where :func:`~paged_ref.kernels.cuda.
                    launch.tma_feeds` says it reads the launch; ``False``: the per-warp INT4
                    ring there too (what sm_89 runs, and what the tests compare the TMA-fed
                    kernel against); ``True``: ``ValueError`` unless it can.

    Blocks of fewer than 16 tokens get their own build (``SMALL_BLOCKS=1``: a table entry per
    token row). ``scale``: the softmax scale (default ``head_dim ** -0.5``).

    Raises:
        ValueError: ``max_len``, ``warps_per_head``, ``tma`` or ``stages`` out of range (a ring
            larger than the GPU's shared memory), ``tma=True`` where it cannot run.
    """
    batch, num_q_heads, head_dim = q_shape
    kind = "int4" if kv_format.kind == "int4" else "fp8"
    kernel = kernel_name(kv_format)
    if not isinstance(max_len, int) or max_len < 0:
        raise ValueError(f"max_len must be a non-negative int, got {max_len!r}")
    if warps_per_head is not None and (type(warps_per_head) is not int
                                       or warps_per_head not in WARPS_PER_HEAD):
        raise ValueError(f"warps_per_head must be one of {WARPS_PER_HEAD}, got {warps_per_head!r}")
    if tma not in (None, True, False):
        raise ValueError(f"tma must be None, True or False, got {tma!r}")
    device = torch.device(device).index
    device = torch.cuda.current_device() if device is None else device
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if chunk_len is None and warps_per_head is None:
        chunk_len, warps_per_head = default_launch(batch, num_kv_heads, max_len, sms,
                                                   total_tokens, kind)
    elif chunk_len is None:  # (warps_per_head alone: whole sequences)
        chunk_len = max_len
    warps_per_head = warps_per_head or 1
    chunk_len = 16 * math.ceil(max(chunk_len, 1) / 16)  # tiles start at multiples of 16
    max_chunks = max(1, math.ceil(max_len / chunk_len))
    part_o = part_lse = None
    if max_chunks > 1:
        part_o = torch.empty(batch, num_q_heads, max_chunks, head_dim, dtype=torch.float32,
                             device=f"cuda:{device}")
        part_lse = torch.empty(batch, num_q_heads, max_chunks, dtype=torch.float32,
                               device=f"cuda:{device}")
    limit = driver.shared_limit(device)
    capability = torch.cuda.get_device_capability(device)
    if stages is None:  # by the CTAs that have work (a ragged batch's grid has idle ones)
        chunks = max_chunks * batch
        if total_tokens is not None:
            chunks = min(chunks, math.ceil(total_tokens / chunk_len) + batch)
        heads = heads_per_cta(num_kv_heads, warps_per_head, MAX_WARPS)
        feeds = tma is not False and tma_feeds(kind, head_dim, block_size, warps_per_head, heads,
                                               capability)
        stages = default_stages(kind, num_kv_heads // heads * chunks, sms, warps_per_head, feeds)
    ring = shared_bytes(head_dim, stages, warps_per_head, kind)
    if ring > limit:  # (ring: per KV head of a CTA)
        raise ValueError(f"{stages} stages of head_dim {head_dim} need {ring} bytes of shared "
                         f"memory per head; this GPU allows {limit}: use fewer")
    heads = heads_per_cta(num_kv_heads, warps_per_head,
                          min(MAX_WARPS, limit // ring * warps_per_head))
    feeds = tma_feeds(kind, head_dim, block_size, warps_per_head, heads, capability)
    if tma and not feeds:
        raise ValueError("tma=True: the TMA-fed kernel reads INT4 of head_dim 128, one warp a "
                         f"head, {TMA_HEADS} KV heads a CTA, blocks of >= 16 tokens, on compute "
                         "capability 9.0+")
    tma = feeds and tma is not False
    name = f"{'bf16' if dtype == torch.bfloat16 else 'f16'}_d{head_dim}"
    scale = head_dim ** -0.5 if scale is None else scale
    settings = Build(stages, warps_per_head, block_size < 16)
    if tma:
        kernel = "int4_decode_tma_{}"
    return CudaDecodePlan(
        q_shape=tuple(q_shape), q_dtype=dtype,
        cache_shape=(block_size, num_kv_heads, head_dim), kv_format=kv_format,
        device_index=device,
        decode=driver.function(device, kernel.format(name), settings, build.SOURCE),
        merge=(driver.function(device, f"merge_chunks_{name}", settings, build.SOURCE)
               if max_chunks > 1 else None),
        grid=(num_kv_heads // heads, max_chunks, batch), threads=32 * heads * warps_per_head,
        smem=tma_shared_bytes(stages) if tma else ring * heads,
        merge_threads=32 * min(max_chunks, MAX_MERGE_WARPS),
        chunk_len=chunk_len, max_chunks=max_chunks, max_len=max_len, heads_per_cta=heads,
        stages=stages, qk_scale_log2=scale * math.log2(math.e), part_o=part_o,
        part_lse=part_lse, dependent_merge=capability >= (9, 0), tma=tma)


def paged_attention_cuda(q, k_cache, v_cache, block_tables, seq_lens, *, scale=None,
                         out=None, chunk_len=None, max_len=None, total_tokens=None,
                         stages=None, warps_per_head=None, tma=None) -> torch.Tensor:
    """Decode attention over FP8 or INT4 caches with the CUDA kernels: a :func:`plan_cuda`
    (the keywords but ``out`` are its) and one :meth:`~CudaDecodePlan.run`. Returns
    ``[batch, Hq, head_dim]`` in q's dtype (``out`` when given: q's shape, dtype and device,
    head_dim contiguous).

    Raises:
        TypeError, ValueError: as :func:`plan_cuda`; an ``out`` unlike q.
    """
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor or None, got {type(out).__name__}")
        if (out.shape != q.shape or out.dtype != q.dtype or out.device != q.device
                or out.stride(-1) != 1):
            raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device} like q, "
                             f"head_dim contiguous (stride 1) for the CUDA kernels; got "
                             f"{tuple(out.shape)} {out.dtype} on {out.device}")
    plan = plan_cuda(q, k_cache, v_cache, block_tables, seq_lens, scale=scale,
                     chunk_len=chunk_len, max_len=max_len, total_tokens=total_tokens,
                     stages=stages, warps_per_head=warps_per_head, tma=tma)
    return plan.run(q, k_cache, v_cache, block_tables, seq_lens, out)


def paged_attention_cuda_fp8(q, k_cache, v_cache, block_tables, seq_lens, **kwargs):
    """:func:`paged_attention_cuda` for FP8 caches only (anything else: a TypeError)."""
    check_cuda_inputs(q, k_cache, v_cache, "fp8", kwargs.get("stages"))
    return paged_attention_cuda(q, k_cache, v_cache, block_tables, seq_lens, **kwargs)
