"""What the CUDA decode kernels take and how a plan launches them, decided from sizes alone
(no GPU needed): the refusals (:func:`cuda_refusal`, :func:`check_cuda_inputs`), the launch
shape (:func:`default_launch`, :func:`heads_per_cta`), the ring depth (:func:`default_stages`),
the INT4 kernel fed by the TMA unit (:func:`tma_feeds`) and the shared memory of a CTA.

The rules were measured on the H200 (132 SMs); the probes that measured them live in commit
9ae93fd (``tools/gpu/cuda_fp8_probe.py``, ``source_ab_probe.py``, ``host_cost_probe.py``).
"""

from __future__ import annotations

import math

import torch

from paged_ref.kernels.cuda.build import (
    DEFAULT_STAGES,
    HEAD_DIMS,
    MAX_GROUP,
    MAX_WARPS,
    TILE,
    TMA_HEADS,
    nvcc_path,
)
from paged_ref.quant import KVFormat, QuantizedKV

#: The cache formats the kernels read (INT4: a (scale, zero) pair per nibble half).
CUDA_FORMATS = ("fp8", "fp8_token_head", "int4")
#: The warps per KV head a plan may ask for (each a build: ``Build.warps_per_head``).
WARPS_PER_HEAD = (1, 2, 4)


def cuda_kernels_available(device: torch.device | str | None = None) -> bool:
    """A CUDA GPU with compute capability >= 8.9 (FP8 conversions) and an nvcc to build the
    kernels."""
    if not torch.cuda.is_available() or nvcc_path() is None:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 9)


def heads_per_cta(num_kv_heads: int, warps_per_head: int = 1, max_warps: int = MAX_WARPS) -> int:
    """KV heads side by side in one CTA: the largest divisor of ``num_kv_heads`` that keeps the
    CTA within ``max_warps`` warps. (Their rows interleave in memory, so together they read
    whole token rows of the cache at once.)"""
    most = max(max_warps // warps_per_head, 1)
    return max(h for h in range(1, most + 1) if num_kv_heads % h == 0)


def default_launch(batch: int, num_kv_heads: int, max_len: int, sms: int,
                   total_tokens: int | None = None, kind: str = "fp8") -> tuple[int, int]:
    """``(chunk_len, warps_per_head)`` for a batch of a ``kind`` (``"fp8"`` / ``"int4"``)
    cache: each warp streams long runs of one head, about one or two CTAs per SM, and no merge
    kernel when it can be helped.

    * FP8 with lengths about equal (``total_tokens`` >= 90 % of ``batch * max_len``, or
      unknown): whole sequences, with the warps per head (1, 2 or 4; the CTA's KV heads
      shrink to match). FP8 reads fastest with the most KV heads a CTA (longer runs of each
      token row) that still give about one CTA per SM (>= 90 % of the SMs, at most 2 per
      SM): B64_L4096 takes 2 (128 CTAs; 4 heads a CTA, 91.8 % of copy bandwidth against
      90.4 % with 4 warps a head), B256_L1024 takes 1.
    * INT4 with lengths about equal: one warp per head, so a CTA's 8 heads read whole token
      rows, and chunks of 1024 tokens, doubled while that would give more than 2 CTAs per SM
      (whole sequences when they are no longer). B64_L4096: 4 chunks, 256 CTAs, 0.0952 ms
      against 0.0984 with whole sequences and 4 warps a head (2 heads a CTA); B8_L32768:
      0.0956 against 0.1012 with 2048-token chunks (1 CTA per SM); 512- and 768-token chunks
      were slower everywhere. Where that leaves fewer than half as many CTAs as SMs (short
      batches), the rule below.
    * Too few sequences for that (fewer CTAs than SMs even at 4): one warp per head (8 heads
      a CTA) and the sequences cut into as many chunks as fit one CTA per SM (B8_L32768:
      2048 tokens, B1_L131072: 1008), merged by a second kernel.
    * Ragged lengths: one warp per head, chunks sized for about 2 CTAs per SM in all.
    """
    max_len = max(max_len, 1)
    whole = {w: batch * num_kv_heads // heads_per_cta(num_kv_heads, w) for w in WARPS_PER_HEAD}
    layer = whole[1]  # CTAs per chunk position with one warp per head
    uniform = total_tokens is None or total_tokens >= 0.9 * batch * max_len
    if uniform and kind == "int4":
        chunk = 1024
        while layer * math.ceil(max_len / chunk) > 2 * sms and chunk < max_len:
            chunk *= 2
        if layer * math.ceil(max_len / chunk) >= sms / 2:
            return min(chunk, max_len), 1
    if uniform:
        fits = [] if kind == "int4" else [w for w in WARPS_PER_HEAD
                                          if 0.9 * sms <= whole[w] <= 2 * sms]
        if fits:
            return max_len, fits[0]
        if whole[1] > 2 * sms:  # many sequences: one warp per head, several CTAs per SM
            return max_len, 1
        chunks = max(1, sms // layer)
        chunk = 16 * math.ceil(math.ceil(max_len / chunks) / 16)
        return max(chunk, min(256, max_len)), 1
    # ragged: CTAs ~= (total / chunk + batch / 2) * layer / batch
    per_cta_pos = layer / batch  # CTAs per (sequence, chunk)
    target = max(2 * sms / per_cta_pos - batch / 2, 1)
    chunk = 16 * math.ceil(total_tokens / target / 16)
    return min(max(chunk, 256), max_len), 1


def default_stages(kind: str, ctas: int, sms: int, warps_per_head: int,
                   tma: bool = False) -> int:
    """Tiles in each warp's ring for a launch of ``ctas`` CTAs: FP8 with one warp per head and
    about two CTAs per SM or more (B256_L1024, the ragged batch) reads 1.8-1.9 % faster with
    2 (one tile in flight while one is used) than with 3; with one CTA per SM (B8_L32768,
    B1_L131072) or two warps a head (B64_L4096) 2 stages were 6-8 % slower. INT4 was as fast
    or slower with 2 everywhere (21 % on B1_L131072) and 4 % slower with 4. The TMA-fed INT4
    kernel (``tma``: :func:`tma_feeds`; one ring per CTA) takes 4, still 2 tiles ahead but
    with a tile of slack before a stage must be free (the .cu's ``TMA_LAG``): B1_L131072
    0.0611 against 0.0640 ms with 3. With at most one CTA per SM it takes 5 (3 tiles ahead:
    one CTA's 8 warps keep less in flight): B1_L131072 0.0580 against 0.0604 ms, while the
    batches of 2 CTAs per SM were 2-3 % slower with 5."""
    if tma:
        return 5 if ctas <= sms else 4
    if kind == "fp8" and warps_per_head == 1 and ctas >= 1.5 * sms:
        return 2
    return DEFAULT_STAGES


def tma_feeds(kind: str, head_dim: int, block_size: int, warps_per_head: int, heads: int,
              capability: tuple) -> bool:
    """Whether a launch can run ``int4_decode_tma`` (``int4_tma_decode.cu``: the CTA shares
    one ring that the TMA unit fills): INT4, head_dim 128, one warp per head and
    ``TMA_HEADS`` KV heads a CTA, blocks of >= 16 tokens, compute capability 9.0+."""
    return (kind == "int4" and head_dim == 128 and warps_per_head == 1 and heads == TMA_HEADS
            and block_size >= TILE and tuple(capability) >= (9, 0))


def shared_bytes(head_dim: int, stages: int, warps: int, kind: str = "fp8") -> int:
    """Dynamic shared memory of one CTA: ``stages`` tiles per warp (the .cu's ``Stage``: 16 K
    and 16 V rows of ``head_dim`` bytes, unpadded (swizzled), and 2 x 16 float32 scales;
    ``Int4Stage``: rows of ``head_dim / 2`` bytes and 4 x 16 (scale, zero) pairs)."""
    if kind == "int4":
        return warps * stages * (2 * TILE * (head_dim // 2) + 4 * TILE * 4)
    return warps * stages * (2 * TILE * head_dim + 2 * TILE * 4)


def tma_shared_bytes(stages: int) -> int:
    """Dynamic shared memory of an ``int4_decode_tma`` CTA: ``stages`` tiles of all 8 heads
    (the .cu's ``Int4TmaStage``: 2 x 16 x 8 x 64 bytes of codes and 4 x 16 x 8 (scale, zero)
    pairs), two 8-byte barriers a stage, and 1024 bytes of slack to align the ring (the TMA
    unit's swizzle is of 1024-byte blocks)."""
    return stages * (2 * TILE * TMA_HEADS * 64 + 4 * TILE * TMA_HEADS * 4 + 16) + 1024


def kernel_name(kv_format) -> str:
    """The per-warp decode kernel of a format, without the dtype and head_dim
    (``"fp8_decode_{}_token"``)."""
    if kv_format.kind == "int4":
        return "int4_decode_{}"
    return "fp8_decode_{}" + ("_token" if kv_format.scale_per == "token_head" else "")


def _reads_grouping(kv_format, head_dim: int) -> bool:
    """FP8 with either scale, or INT4 with a (scale, zero) pair per nibble half: ``int4``, or
    the same grouping spelled ``int4_g<head_dim / 2>`` (the same tensors)."""
    return kv_format.kind == "fp8" or kv_format.group(head_dim) == head_dim // 2


def check_cuda_inputs(q, k_cache, v_cache, kind: str, stages=None) -> str:
    """Raise a clear error for what the ``kind`` (``"fp8"`` or ``"int4"``) kernel does not
    read; its kernel name without the dtype and head_dim (``"fp8_decode_{}_token"``).

    Raises:
        TypeError: caches not ``kind`` :class:`~paged_ref.QuantizedKV` of one format, q not
            float16 / bfloat16.
        ValueError: head_dim not in ``HEAD_DIMS``, another INT4 grouping, a block size not a
            power of two, more than 8 query heads per KV head, ``stages`` not 2..8, q's
            head_dim strided, q on the CPU.
    """
    what = f"the CUDA {kind.upper()} kernel"
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not isinstance(c, QuantizedKV) or c.format.kind != kind:
            raise TypeError(f"{what} reads {kind} QuantizedKV caches; {name} is "
                            f"{getattr(getattr(c, 'format', None), 'name', type(c).__name__)}")
    if k_cache.format != v_cache.format:
        raise TypeError(f"k_cache is {k_cache.format.name}, v_cache {v_cache.format.name}")
    if q.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"{what} takes float16 / bfloat16 q, got {q.dtype}")
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"{what} takes head_dim in {HEAD_DIMS}, got {head_dim}")
    if not _reads_grouping(k_cache.format, head_dim):
        raise ValueError(f"{what} reads a (scale, zero) pair per nibble half (format 'int4'); "
                         f"got {k_cache.format.name} (use the Triton kernel for it)")
    if block_size & (block_size - 1):
        raise ValueError(f"{what} needs a power-of-two block_size, got {block_size}")
    if q.shape[1] // num_kv_heads > MAX_GROUP:
        raise ValueError(f"{what} takes up to {MAX_GROUP} query heads per KV head, got "
                         f"{q.shape[1] // num_kv_heads}")
    if stages is not None and not (isinstance(stages, int) and 2 <= stages <= 8):
        raise ValueError(f"stages must be 2..8 (or None: default_stages), got {stages!r}")
    if q.stride(-1) != 1:
        raise ValueError(f"q's head_dim must be contiguous (stride 1) for {what}")
    if not q.is_cuda:
        raise ValueError(f"{what} runs on a CUDA GPU; q is on the CPU")
    return kernel_name(k_cache.format)


def cuda_refusal(kv_format, q_dtype: torch.dtype, device, *, head_dim: int, group: int,
                 block_size: int) -> str | None:
    """Why the CUDA kernels would not run a call with these sizes, or ``None`` when they
    would (what ``paged_attention(backend="auto")`` and ``plan_decode`` ask before picking
    them): the cache format, q's dtype, head_dim, the group, the block size, and a GPU of
    compute capability >= 8.9 with nvcc: the rules :func:`check_cuda_inputs` raises on."""
    fmt = KVFormat.parse(kv_format) if isinstance(kv_format, str) else kv_format
    if fmt is None or fmt.kind not in ("fp8", "int4"):
        name = getattr(fmt, "name", "plain ones")
        return f"they read {', '.join(CUDA_FORMATS)} caches, not {name}"
    if q_dtype not in (torch.float16, torch.bfloat16):
        return f"they take float16 / bfloat16 q, not {q_dtype}"
    if head_dim not in HEAD_DIMS:
        return f"they take head_dim in {HEAD_DIMS}, not {head_dim}"
    if group > MAX_GROUP:
        return f"they take up to {MAX_GROUP} query heads per KV head, not {group}"
    if block_size & (block_size - 1):
        return f"they need a power-of-two block_size, not {block_size}"
    if not _reads_grouping(fmt, head_dim):
        return f"they read INT4 with a (scale, zero) pair per nibble half ('int4'), not {fmt.name}"
    if torch.device(device).type != "cuda" or not cuda_kernels_available(device):
        return "they need a CUDA GPU of compute capability >= 8.9 and nvcc"
    return None
