"""Hand-written CUDA decode kernels for FP8 (e4m3) and INT4 caches, next to the Triton ones.

Why: lesson 10 measured the Triton FP8 kernel at about 2/3 of copy bandwidth and the INT4 one
at about a quarter, instruction-bound (8-bit and 4-bit tiles reach the tensor cores through
byte-wide shared-memory loads). Here each thread reads only its own ``mma.sync`` fragments,
16 bytes at a time, from a per-warp ``cp.async`` ring; on sm_90+ the common INT4 launch reads
from one ring per CTA that the TMA unit fills. The family, one source each:

    common.cuh, warp.cuh   the Args struct, PTX helpers, swizzle; what every decode warp does
    fp8_decode.cu          fp8_decode_*: FP8 caches, per-tensor or per-token-head scales
    int4_head.cuh          INT4 codes -> MMA operands, scores and output (both INT4 rings)
    int4_decode.cu         int4_decode_*: INT4 through each warp's own cp.async ring
    int4_tma_decode.cu     int4_decode_tma_*: INT4 through one TMA-filled ring per CTA (sm_90+)
    merge.cu               merge_chunks_*: the chunks of a long sequence combined
    decode.cu              all of them, one translation unit: one cubin a build

and the host side: :mod:`.build` (nvcc, the cubin cache under ``~/.cache/paged_ref`` or
``$PAGED_REF_CACHE``), :mod:`.driver` (the CUDA driver API through :mod:`ctypes`: load, look up,
launch, tensor maps), :mod:`.launch` (what the kernels take, launch shape and ring depth by
sizes alone) and :mod:`.plans` (plans and calls).

Needs an NVIDIA GPU with FP8 conversions (compute capability 8.9+) and ``nvcc`` (``$CUDA_HOME``
or on ``PATH``); :func:`cuda_kernels_available` says whether this machine has both.

    out = paged_attention_cuda(q, k_q, v_q, block_tables, seq_lens)  # fp8 or int4 caches
    plan = plan_cuda(q, k_q, v_q, block_tables, seq_lens, max_len=4096)   # or plan once,
    out = plan.run(q, k_q, v_q, block_tables, seq_lens)                   # run many

q: float16 / bfloat16 ``[batch, Hq, head_dim]`` (head_dim 64, 128 or 256; ``Hq / Hkv <= 8``);
caches: :class:`~paged_ref.QuantizedKV` in ``fp8`` (per tensor), ``fp8_token_head`` or
``int4`` (a (scale, zero) pair per nibble half) format, ``[num_blocks, block_size, Hkv,
head_dim]`` with a power-of-two block size; ``block_tables`` ``[batch, max_blocks]`` and
``seq_lens`` ``[batch]`` int32. The kernels take checked inputs: ``paged_ref.paged_attention``
validates a call's tables and lengths; these functions check only what the kernels read.
"""

from paged_ref.kernels.cuda.build import Build, compile_cubin, nvcc_path
from paged_ref.kernels.cuda.launch import (
    CUDA_FORMATS,
    check_cuda_inputs,
    cuda_kernels_available,
    cuda_refusal,
    default_launch,
    default_stages,
    heads_per_cta,
    tma_feeds,
)
from paged_ref.kernels.cuda.plans import (
    CudaDecodePlan,
    paged_attention_cuda,
    paged_attention_cuda_fp8,
    plan_cuda,
    plan_cuda_for,
)

__all__ = ["CUDA_FORMATS", "Build", "CudaDecodePlan", "check_cuda_inputs", "compile_cubin",
           "cuda_kernels_available", "cuda_refusal", "default_launch", "default_stages",
           "heads_per_cta", "nvcc_path", "paged_attention_cuda", "paged_attention_cuda_fp8",
           "plan_cuda", "plan_cuda_for", "tma_feeds"]
