"""Plan once, run many: decode attention without a read-back, ready for CUDA graphs.

A serving step knows its lengths on the host before it launches anything (the
:class:`~paged_ref.KVCacheManager` holds them), so, as FlashInfer's ``plan``/``run`` and vLLM's
attention metadata do, the work that needs values is done once, on the host::

    plan = paged_ref.plan_decode(lens, num_q_heads=32, num_kv_heads=8, head_dim=128,
                                 block_size=16, dtype=torch.bfloat16, device="cuda",
                                 max_seq_len=4096)
    out = paged_ref.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, plan=plan)

:func:`plan_decode` checks the lengths, picks the backend and the split (:func:`dispatch`, the
one place that decides both, also used by calls without a plan) and allocates the split's
scratch buffers. A call with the plan then checks only shapes, dtypes and devices (no tensor
value is read, nothing is copied to the host), allocates nothing but its output (none with
``out=``), and can be captured in a CUDA graph and replayed after the caller writes new
``q``, tables and lengths into the same tensors, as long as every length stays
``<= plan.max_seq_len`` and every used table entry is a valid block id (the caller's promise,
as with FlashInfer; the kernels clamp lengths to ``max_seq_len``, so a longer one is cut short,
never read past the table).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from paged_ref import _device
from paged_ref.cache_math import cdiv, default_scale
from paged_ref.quant import KVFormat
from paged_ref.validation import CACHE_DTYPES, Shapes, check_scale

BACKENDS = ("auto", "torch", "triton", "triton_split", "cuda")
#: The refusal of an explicit Triton backend on a cache :func:`triton_reads` says it cannot read.
UNREADABLE = ("k_cache: the Triton kernels read int4 caches only with head_dim a power of two "
              ">= 32 (use backend='torch')")


@dataclass(frozen=True)
class DecodePlan:
    """What a planned call runs, and the buffers it writes.

    ``backend`` is the kernel that runs: ``"torch"``, ``"triton"`` (one pass),
    ``"triton_split"`` (``split`` chunks; a one-chunk split is the one-pass kernel, so it is
    ``"triton"`` here) or ``"cuda"`` (the hand-written FP8 / INT4 kernels, ``cuda`` their
    :class:`~paged_ref.kernels.cuda.CudaDecodePlan`, for the cache format ``kv_format``).
    Lengths up to ``max_seq_len`` are covered.
    """

    backend: str
    batch: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    device: torch.device
    max_seq_len: int
    scale: float  # the softmax scale (head_dim ** -0.5 when none was given)
    split: object | None = None  # kernels.triton.split.SplitPlan
    scratch: object | None = None  # kernels.triton.split.SplitScratch
    kv_format: object | None = None  # quant.KVFormat the plan is for (None: plain caches)
    cuda: object | None = None  # kernels.cuda.CudaDecodePlan (backend "cuda")
    #: signature -> bound launches of the planned calls (:mod:`paged_ref.planned`); a new
    #: dict for every plan, never copied by ``dataclasses.replace``
    bindings: dict = field(default_factory=dict, init=False, compare=False, repr=False)


def triton_reads(kv_format, head_dim: int) -> bool:
    """Do the Triton kernels read caches of this format? Plain tensors and FP8 always; INT4
    when head_dim is a power of two >= 32 (two halves of >= 16 channels, for the dots).

    Args:
        kv_format: the caches' :class:`~paged_ref.KVFormat`, or None for plain tensors.
        head_dim: the caches' head_dim.

    Returns:
        bool: False only for INT4 caches of other head dims (the torch backend reads them).
    """
    if kv_format is None or kv_format.kind != "int4":
        return True
    return head_dim >= 32 and not head_dim & (head_dim - 1)


def dispatch(backend: str, device: torch.device, *, batch: int, num_kv_heads: int,
             max_len: int, total_tokens: int, max_seq_len: int | None = None,
             cuda_refusal: str | None = "the cache is not quantised", readable: bool = True,
             name: str = "q"):
    """The one decision: which backend runs, and how the split kernel cuts the sequences.

    ``"auto"`` is ``"torch"`` off the GPU (the interpreter is for learning, not speed) and for
    caches the Triton kernels do not read; on a GPU it is the hand-written CUDA kernels when
    they read the call (``cuda_refusal`` is None: an FP8 or INT4 cache on a GPU with nvcc, see
    :func:`~paged_ref.kernels.cuda.cuda_refusal`), else the split kernel when
    :func:`~paged_ref.kernels.triton.split.plan_split` cuts the longest sequence into more than
    one chunk, else the one-pass kernel.

    Args:
        backend: one of :data:`BACKENDS`.
        device: where the call's tensors are.
        batch, num_kv_heads: the call's sizes.
        max_len, total_tokens: the longest and the summed length now (the split's chunk size
            comes from them).
        max_seq_len: the longest length the plan must serve (default ``max_len``): the
            split's chunk count covers it, so lengths may grow up to it (CUDA graph replays).
        cuda_refusal: why the CUDA kernels would not run this call (None: they would).
        readable: whether the Triton kernels read the caches (:func:`triton_reads`).
        name: the argument that carries ``device``, for the messages.

    Returns:
        ``(backend that runs, SplitPlan or None)``.

    Raises:
        ValueError: an unknown backend; ``"cuda"`` where those kernels do not read the call
        (the message says why); a Triton backend on tensors it cannot run on here
        (:func:`paged_ref._device.check_triton_device`) or on caches it does not read.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "cuda":
        if cuda_refusal is not None:
            raise ValueError("backend='cuda' runs the hand-written CUDA kernels, and "
                             f"{cuda_refusal}")
        return "cuda", None
    if backend == "auto" and cuda_refusal is None:
        return "cuda", None
    if backend == "torch" or (backend == "auto" and not (
            readable and _device.compiled_triton_on(device))):
        return "torch", None
    _device.check_triton_device(backend, name, device)
    if not readable:
        raise ValueError(UNREADABLE)
    from paged_ref.kernels.triton import split as triton_split  # (triton is imported here)

    # NOTE: looked up on the module at each call, so that a test can replace plan_split.
    split = triton_split.plan_split(batch=batch, num_kv_heads=num_kv_heads, max_len=max_len,
                                    total_tokens=total_tokens,
                                    num_sms=triton_split.num_multiprocessors(device))
    if backend == "triton" or split.num_chunks == 1:
        return "triton", None
    num_chunks = cdiv(max(max_seq_len or 0, max_len), split.chunk_size)
    return "triton_split", triton_split.SplitPlan(
        split.chunk_size, num_chunks,
        fused_merge=num_chunks <= triton_split.FUSED_MERGE_MAX_CHUNKS,
        eager_fused_merge=split.eager_fused_merge)


def cuda_refusal_for(backend: str, kv_format, dtype: torch.dtype, device: torch.device, *,
                     head_dim: int, group: int, block_size: int) -> str | None:
    """Why the CUDA kernels would not run this call, asked only for ``"auto"`` and
    ``"cuda"`` on quantised caches on a GPU (nothing is compiled or imported from them
    otherwise).

    Args:
        backend: the call's backend.
        kv_format: the caches' KVFormat (None: plain tensors).
        dtype, device: q's.
        head_dim, group, block_size: the call's sizes (group: query heads per KV head).

    Returns:
        The reason, for a message (``"... they run on a CUDA GPU only"``), or None: they would.
    """
    if kv_format is None:
        return "the cache is not quantised"
    if backend not in ("auto", "cuda"):
        return f"backend={backend!r}"
    if torch.device(device).type != "cuda":
        return "they run on a CUDA GPU only"
    from paged_ref.kernels.cuda import cuda_refusal

    return cuda_refusal(kv_format, dtype, device, head_dim=head_dim, group=group,
                        block_size=block_size)


def make_plan(backend: str, shapes: Shapes, dtype: torch.dtype, device: torch.device, *,
              max_len: int, total_tokens: int, max_seq_len: int, scale: float | None,
              kv_format=None, name: str = "q") -> DecodePlan:
    """A plan for checked sizes: :func:`dispatch`, then the split's scratch buffers (or the
    CUDA kernels' own plan).

    Args:
        backend: one of :data:`BACKENDS`.
        shapes: the call's sizes (:func:`paged_ref.validation.check_shapes`; ``num_blocks``
            is not used).
        dtype, device: q's.
        max_len, total_tokens, max_seq_len: as for :func:`dispatch`.
        scale: the softmax scale (None: ``head_dim ** -0.5``); stored in the plan as a float.
        kv_format: the caches' :class:`~paged_ref.KVFormat` (None: plain tensors).
        name: the argument that carries ``device``, for the messages.

    Returns:
        DecodePlan.

    Raises:
        ValueError: as :func:`dispatch`.
    """
    refusal = cuda_refusal_for(backend, kv_format, dtype, device, head_dim=shapes.head_dim,
                               group=shapes.num_q_heads // shapes.num_kv_heads,
                               block_size=shapes.block_size)
    ran, split = dispatch(backend, device, batch=shapes.batch, num_kv_heads=shapes.num_kv_heads,
                          max_len=max_len, total_tokens=total_tokens, max_seq_len=max_seq_len,
                          cuda_refusal=refusal, readable=triton_reads(kv_format, shapes.head_dim),
                          name=name)
    scale = default_scale(shapes.head_dim, scale)
    sizes = (shapes.batch, shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim,
             shapes.block_size, dtype, device, max_seq_len, scale)
    if ran == "cuda":
        from paged_ref.kernels.cuda import plan_cuda_for

        cuda = plan_cuda_for((shapes.batch, shapes.num_q_heads, shapes.head_dim),
                             shapes.block_size, shapes.num_kv_heads, dtype, device, kv_format,
                             max_len=max_seq_len, total_tokens=total_tokens, scale=scale)
        return DecodePlan(ran, *sizes, kv_format=kv_format, cuda=cuda)
    scratch = None
    if split is not None:
        from paged_ref.kernels.triton.split import SplitScratch

        scratch = SplitScratch.allocate(shapes.batch, shapes.num_q_heads, shapes.num_kv_heads,
                                        shapes.head_dim, split, device)
    return DecodePlan(ran, *sizes, split, scratch, kv_format)


def _positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_plan_sizes(num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                     device) -> tuple[dict[str, int], torch.device]:
    """A plan's sizes (ints >= 1, ``num_q_heads % num_kv_heads == 0``), dtype and device (a
    bare ``"cuda"`` made the current GPU): ``({name: size}, device)``; TypeError or
    ValueError naming the argument."""
    sizes = {name: _positive_int(name, value) for name, value in (
        ("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
        ("block_size", block_size))}
    if num_q_heads % num_kv_heads:
        raise ValueError(f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")
    if dtype not in CACHE_DTYPES:
        raise TypeError(f"dtype must be one of {CACHE_DTYPES}, got {dtype!r}")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return sizes, device


def host_lengths(seq_lens) -> list[int]:
    """Host lengths as a list of Python ints.

    Args:
        seq_lens: a list/tuple of ints, or a 1-D CPU int tensor (never a CUDA tensor: that
            would be the read-back a plan exists to avoid).

    Returns:
        list[int]. Raises: TypeError for anything else, naming the entry.
    """
    if isinstance(seq_lens, torch.Tensor):
        if seq_lens.device.type != "cpu" or seq_lens.dim() != 1 or seq_lens.is_floating_point():
            raise TypeError("seq_lens must be host lengths: a list of ints or a 1-D CPU int "
                            f"tensor, got a {seq_lens.dim()}-D {seq_lens.dtype} tensor on "
                            f"{seq_lens.device}")
        return seq_lens.tolist()
    if not isinstance(seq_lens, Sequence) or isinstance(seq_lens, str):
        raise TypeError(f"seq_lens must be a list of ints, got {type(seq_lens).__name__}")
    for b, n in enumerate(seq_lens):
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"seq_lens[{b}] must be an int, got {type(n).__name__}")
    return list(seq_lens)


def plan_decode(
    seq_lens: Sequence[int],
    *,
    num_q_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    max_seq_len: int | None = None,
    scale: float | None = None,
    backend: str = "auto",
    kv_format=None,
) -> DecodePlan:
    """Plan decode attention for a batch whose lengths the caller has on the host.

    Checks every value here, once; the planned call ``paged_attention(..., plan=plan)`` then
    reads no tensor value back and is CUDA-graph capturable (see the module docstring).

    Args:
        seq_lens: the current length of each sequence: a list of ints (or a 1-D CPU int
            tensor); ``len(seq_lens)`` is the batch size the plan is for.
        num_q_heads, num_kv_heads, head_dim, block_size: as the planned calls' ``q`` and
            caches (ints >= 1, ``num_q_heads % num_kv_heads == 0``).
        dtype: q's dtype, float16 / bfloat16 / float32.
        device: where the planned calls' tensors are.
        max_seq_len: the longest length any planned call may see (default
            ``max(seq_lens)``); give the bound when lengths grow between CUDA graph replays.
        scale: softmax scale, default ``head_dim ** -0.5`` (a real number,
            ``abs(scale) <= 1e4``).
        backend: ``"auto"`` (default), ``"torch"``, ``"triton"``, ``"triton_split"`` or
            ``"cuda"`` (the hand-written FP8 / INT4 kernels).
        kv_format: the caches' :class:`~paged_ref.KVFormat` or its name (``"fp8"``,
            ``"int4"``, ...) when they are quantised: ``"auto"`` then runs the CUDA kernels
            where they read the call (a GPU with nvcc), else Triton.

    Returns:
        DecodePlan.

    Raises:
        TypeError: a bad type. ValueError: a bad value, or a backend that cannot run on
        ``device`` here (named).
    """
    lens = host_lengths(seq_lens)
    sizes, device = check_plan_sizes(num_q_heads, num_kv_heads, head_dim, block_size, dtype,
                                     device)
    scale = check_scale(scale)
    for b, n in enumerate(lens):
        if n < 0:
            raise ValueError(f"seq_lens[{b}] = {n} is negative")
    longest = max(lens, default=0)
    if max_seq_len is None:
        max_seq_len = longest
    elif isinstance(max_seq_len, bool) or not isinstance(max_seq_len, int):
        raise TypeError(f"max_seq_len must be an int or None, got {type(max_seq_len).__name__}")
    if max_seq_len < longest:
        b = lens.index(longest)
        raise ValueError(f"seq_lens[{b}] = {longest} exceeds max_seq_len = {max_seq_len}")
    shapes = Shapes(len(lens), sizes["num_q_heads"], sizes["num_kv_heads"], sizes["head_dim"],
                    num_blocks=-1, block_size=sizes["block_size"],
                    max_blocks_per_seq=cdiv(max_seq_len, block_size))
    if kv_format is not None:
        kv_format = KVFormat.parse(kv_format)
    return make_plan(backend, shapes, dtype, device, max_len=longest, total_tokens=sum(lens),
                     max_seq_len=max_seq_len, scale=scale, kv_format=kv_format, name="device")


def check_against_plan(plan: DecodePlan, shapes: Shapes, q: torch.Tensor,
                       kv_format=None) -> None:
    """A planned call's inputs (already through ``check_shapes``) match what was planned.

    Args:
        plan: from :func:`plan_decode`.
        shapes: the call's sizes.
        q: the call's queries (dtype and device).
        kv_format: the call's cache format (None: plain tensors).

    Raises:
        ValueError: sizes, dtype or device other than planned; a table too short for the
        plan's ``max_seq_len``; caches the planned Triton kernels do not read.
    """
    want = (plan.batch, plan.num_q_heads, plan.num_kv_heads, plan.head_dim, plan.block_size)
    got = (shapes.batch, shapes.num_q_heads, shapes.num_kv_heads, shapes.head_dim,
           shapes.block_size)
    if got != want:
        names = ("q has batch", "q has num_q_heads", "k_cache has num_kv_heads",
                 "k_cache has head_dim", "k_cache has block_size")
        diff = ", ".join(f"{n} {g} (planned {w})" for n, g, w in zip(names, got, want, strict=True)
                         if g != w)
        raise ValueError(f"inputs do not match the plan: {diff}")
    if q.dtype != plan.dtype or q.device != plan.device:
        raise ValueError(f"q is {q.dtype} on {q.device}; the plan is for {plan.dtype} on "
                         f"{plan.device}")
    capacity = shapes.max_blocks_per_seq * shapes.block_size
    if capacity < plan.max_seq_len:
        raise ValueError(f"block_tables holds {shapes.max_blocks_per_seq} blocks x block_size "
                         f"{shapes.block_size} = {capacity} tokens < the plan's max_seq_len "
                         f"{plan.max_seq_len}")
    if shapes.num_blocks == 0 and plan.max_seq_len > 0:
        raise ValueError("k_cache has num_blocks == 0 but the plan covers lengths up to "
                         f"{plan.max_seq_len}")
    if plan.backend.startswith("triton") and not triton_reads(kv_format, shapes.head_dim):
        raise ValueError(f"k_cache: a {kv_format.name} cache of head_dim {shapes.head_dim}, "
                         "which the planned Triton kernels do not read: plan with "
                         f"kv_format={kv_format.name!r}")
