"""The planned call's host path: what ``paged_attention(..., plan=plan)`` does on the host.

A small decode batch is bound by the host: B4_L2048's kernel takes ~0.02 ms on an H200, less
than the Python around it took (0.06 ms a call, as measured for issue 35). A plan
(:mod:`paged_ref.plan`) has already fixed the backend, the split, the scratch buffers and the
lengths it covers. What is left per call is to make sure the tensors are the ones the plan
fits, and to launch. The first planned call with given tensors checks their metadata in
full (:func:`~paged_ref.validation.check_shapes`, :func:`~paged_ref.validation.check_out`,
:func:`~paged_ref.plan.check_against_plan`), runs, and its launches are recorded and bound
(:class:`~paged_ref.kernels.triton.launch.BoundLaunch`). What those checks read (types,
shapes, strides, dtypes, devices) is the call's *signature*: a later call with the same
signature would pass the same checks and launch the same kernels with the same arguments,
but for its tensors' data pointers. So a planned call does, on the host:

1. the signature: five metadata reads a tensor (no value is read, nothing is synchronised),
   one dict look-up among the plan's bindings;
2. found: the data pointers (16-byte aligned, as the kernels were compiled for), the current
   stream's handle, and the bound launches (the C launcher, pointers as ints): no binder, no
   ``torch.empty``, no ``.contiguous()``, no cache-key string;
3. not found: the full checks -- a clear error naming the argument when the tensors do not fit
   the plan (another shape, dtype or device; a non-contiguous cache) -- then the call,
   recorded and bound for the next ones with this signature.

A call is never bound (it always takes the full path of :func:`paged_ref.paged_attention`)
when: its backend launches no Triton kernel (``torch``, the CUDA kernels); the batch or the
pool is empty; one tensor is passed as two arguments; a pointer is not 16-byte aligned; the
call copies a tensor (q, tables or lengths with a strided last dimension); or the tensors are
on another GPU than the current one. A plan keeps at most :data:`MAX_BINDINGS`.

The unplanned call on a GPU (:func:`call_unplanned`) takes the same path. There the values
are checked by a kernel queued first, and the attention kernel is planned for every length
the table can hold (:mod:`paged_ref.attention`), so its plan depends on metadata only: the
first unplanned call with given metadata, scale and backend checks it in full, makes the
plan and remembers it (at most :data:`MAX_UNPLANNED`, per stream: their scratch buffers are
the stream's); a later one launches the check kernel, then the plan's bound launches, and
waits for the checks' verdict. The value checks are never skipped: only the metadata checks
and the planning are not redone.
"""

from __future__ import annotations

import torch

from paged_ref import _device
from paged_ref.plan import DecodePlan, check_against_plan
from paged_ref.quant import QuantizedKV
from paged_ref.validation import check_out, check_shapes

#: Signatures a plan binds at most (a caller alternating more tensor layouts is re-bound).
MAX_BINDINGS = 8
#: Plans remembered for unplanned GPU calls, by signature, scale, backend and stream.
MAX_UNPLANNED = 8
_UNPLANNED: dict = {}  # key -> (Shapes, DecodePlan)


class Binding:
    """A signature's bound launches, and the CUDA device they run on (None: interpreter)."""

    __slots__ = ("device", "launches")

    def __init__(self, launches: tuple, device: int | None) -> None:
        self.launches, self.device = launches, device


def _parts(cache) -> tuple:
    """A cache's tensors: itself, or a QuantizedKV's codes, scales (and zeros)."""
    if type(cache) is QuantizedKV:
        return (cache.data, cache.scale) if cache.zero is None else (cache.data, cache.scale,
                                                                     cache.zero)
    return (cache,)


def _meta(tensors: tuple) -> tuple:
    """What the metadata checks read of ``tensors``."""
    return tuple([(type(t), t.shape, t.stride(), t.dtype, t.device) for t in tensors])


def _signature(plan: DecodePlan, tensors: tuple, made_out: bool) -> tuple:
    """What the full checks read of ``tensors``, and what else picks the launched kernels."""
    meta = _meta(tensors)
    if plan.device.type != "cuda":
        return meta, made_out
    # NOTE: a split plan may merge inside the split kernel when eager and with a second
    # kernel when captured (SplitPlan.eager_fused_merge): the capture state picks the kernels
    # (as kernels.triton.split.capturing asks it), the current device their context.
    capturing = tensors[0].is_cuda and torch.cuda.is_current_stream_capturing()
    return meta, made_out, capturing, torch.cuda.current_device()


def unplanned_key(q, k_cache, v_cache, block_tables, seq_lens, out, scale, backend) -> tuple:
    """What an unplanned call's metadata checks and plan depend on: the tensors' signature
    (as for a plan), the caches' formats, ``scale`` (with its type: ``True == 1.0``, but
    only one is a valid scale), the backend, the current CUDA device and stream.

    Raises:
        AttributeError / TypeError: not tensors (the full path names the argument).
    """
    caches = (k_cache, v_cache) if type(k_cache) is torch.Tensor else (
        *_parts(k_cache), *_parts(v_cache))
    tensors = (q, *caches, block_tables, seq_lens) + (() if out is None else (out,))
    meta = _meta(tensors)
    device = torch.cuda.current_device() if q.is_cuda else None
    stream = None if device is None else _device.current_stream_handle(device)
    return (meta, out is None, getattr(k_cache, "format", None),
            getattr(v_cache, "format", None), type(scale), scale, backend, device, stream)


def remember_unplanned(key: tuple, shapes, plan: DecodePlan) -> None:
    """Keep ``plan`` (made for every length the table holds) for later unplanned calls."""
    if len(_UNPLANNED) >= MAX_UNPLANNED:
        _UNPLANNED.clear()
    _UNPLANNED[key] = (shapes, plan)


def call_unplanned(q, k_cache, v_cache, block_tables, seq_lens, out, scale, backend):
    """An unplanned call whose metadata was seen before (see the module doc): the check
    kernel, the remembered plan's launches, then the verdict.

    Returns:
        The output tensor, or None: not seen before (the full path checks, plans and
        remembers it).

    Raises:
        ValueError: a length or a used table entry failed the value checks (the rows that
        passed are written, the others are not).
    """
    try:
        key = unplanned_key(q, k_cache, v_cache, block_tables, seq_lens, out, scale, backend)
        entry = _UNPLANNED.get(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable scale
        return None
    if entry is None:
        return None
    from paged_ref.kernels.triton import checks
    from paged_ref.validation import check_values

    shapes, plan = entry
    pending = checks.start_checks(block_tables, seq_lens, shapes.block_size, shapes.num_blocks)
    lens = pending.checked_lens
    result = call_planned(plan, q, k_cache, v_cache, block_tables, lens, out)
    if result is None:  # (not bindable: the plan run as it is)
        from paged_ref.attention import run_plan

        result = run_plan(plan, q, k_cache, v_cache, block_tables, lens, out)
    check_values(block_tables, seq_lens, shapes, pending.stats())  # raises the named error
    return result


def call_planned(plan: DecodePlan, q, k_cache, v_cache, block_tables, seq_lens, out):
    """``paged_attention(q, k_cache, v_cache, block_tables, seq_lens, plan=plan, out=out)``
    through the plan's bindings (see the module doc).

    Args:
        plan: a DecodePlan (its ``scale`` and ``backend`` are the call's).
        q, k_cache, v_cache, block_tables, seq_lens, out: as for
            :func:`paged_ref.paged_attention`.

    Returns:
        The output tensor, or None: this call takes the full path (not bindable, or not
        tensors at all: the full path says what is wrong).

    Raises:
        TypeError / ValueError: from the full checks, for tensors that do not fit the plan.
    """
    try:
        caches = (k_cache, v_cache) if type(k_cache) is torch.Tensor else (
            *_parts(k_cache), *_parts(v_cache))
        tensors = (q, *caches, block_tables, seq_lens) + (() if out is None else (out,))
        key = _signature(plan, tensors, out is None)
    except (AttributeError, TypeError):  # not tensors: the full path names the argument
        return None
    binding = plan.bindings.get(key, False)
    if binding is False:
        return _bind(plan, key, q, k_cache, v_cache, block_tables, seq_lens, out)
    if binding is None:
        return None
    if out is None:  # NOTE: always contiguous (the signature says q's shape, dtype, device)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        tensors += (out,)
    ptrs = tuple([t.data_ptr() for t in tensors])
    aligned = 0
    for p in ptrs:
        aligned |= p
    if aligned & 15:  # a view at an odd offset: the kernels were compiled for 16-byte aligned
        return None
    if binding.device is None:  # the interpreter takes the tensors themselves
        for bound in binding.launches:
            bound(tensors)
        return out
    stream = _device.current_stream_handle(binding.device)
    for bound in binding.launches:
        bound(ptrs, stream)
    return out


def _bind(plan: DecodePlan, key: tuple, q, k_cache, v_cache, block_tables, seq_lens, out):
    """The first call with signature ``key``: full checks, the call, its launches bound."""
    shapes = check_shapes(q, k_cache, v_cache, block_tables, seq_lens)
    check_out(out, q)
    check_against_plan(plan, shapes, q, getattr(k_cache, "format", None))
    if q.is_cuda and q.get_device() != torch.cuda.current_device():
        return None  # (paged_attention moves to that GPU first)
    from paged_ref.attention import run_plan
    from paged_ref.kernels.triton.launch import BoundLaunch, recording

    made_out = out is None
    if made_out:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    tensors = (q, *_parts(k_cache), *_parts(v_cache), block_tables, seq_lens, out)
    with recording() as launches:
        result = run_plan(plan, q, k_cache, v_cache, block_tables, seq_lens, out)
    binding = None
    distinct = len({id(t) for t in tensors}) == len(tensors)
    aligned = all(t.data_ptr() % 16 == 0 for t in tensors)
    if (launches and distinct and aligned and shapes.batch and shapes.num_blocks
            and plan.backend.startswith("triton")):
        scratch = plan.scratch
        owned = () if scratch is None else (scratch.part_out, scratch.part_lse,
                                            scratch.counters)
        bound = tuple(BoundLaunch.bind(r, tensors, owned) for r in launches)
        if None not in bound:
            binding = Binding(bound, None if _device.INTERPRET else q.get_device())
    if len(plan.bindings) >= MAX_BINDINGS:
        plan.bindings.clear()
    plan.bindings[key] = binding
    return result


__all__ = ["MAX_BINDINGS", "MAX_UNPLANNED", "call_planned", "call_unplanned", "remember_unplanned",
           "unplanned_key"]
