# Your exercises for lesson 4: replace each `raise NotImplementedError(...)`.
# The lesson notebook's check cells (or `make test-exercises EX=ex04`) test this file.
# Generated from solutions/ex04_warmups.py by tools/make_exercises.py.
"""Lesson 04 warm-ups: three small Triton kernels before the paged decode kernel.

Each warm-up is one idea that Exercise 4.2 and 4.3 combine:

* Ex 4.0a :func:`masked_row_copy_kernel` a load with a mask (rows longer than the data)
* Ex 4.0b :func:`gather_rows_kernel`     a gather: load indices, then the rows they point at
* Ex 4.0c :func:`running_max_kernel`     a loop over tiles that keeps a running (online) max
* given   :func:`masked_row_copy`, :func:`gather_rows`, :func:`running_max` launch them

Every launcher returns plain tensors, so you can look at what your kernel read: feed it an
*address probe* (a tensor whose element at flat index ``a`` holds ``a + 1``) and every value
it loaded names the address it came from; ``paged_course.viz.draw_memory_reads`` draws
them. In Triton, a ``tl.load`` reads every lane whose mask is on (or every lane, without a
mask), whatever the data there is: a missed mask shows up in the picture as reads outside the
data, and on a GPU as garbage or a crash.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# ---- Exercise 4.0a: a load with a mask ---------------------------------------------------------


@triton.jit
def masked_row_copy_kernel(x_ptr, out_ptr, n_cols, stride_x, BLOCK: tl.constexpr):
    """Exercise 4.0a: program ``row`` copies the first ``n_cols`` values of row ``row``.

    ``x`` is [rows, stride_x] in memory (row ``r`` starts at element ``r * stride_x``) but only
    its first ``n_cols <= BLOCK`` columns are data; the rest of each row is padding that may hold
    anything (NaN in the checks). ``out`` is a contiguous [rows, BLOCK] float32 tensor. Write

        out[row, j] = x[row, j]   for j < n_cols,      out[row, j] = 0   for n_cols <= j < BLOCK

    and read nothing past column ``n_cols - 1``. Grid: ``(rows,)``.

    Example: ``n_cols = 3``, ``BLOCK = 4``, row 1 of x holds ``[5., 6., 7., nan]``: out[1] is
    ``[5., 6., 7., 0.]``.

    Hints: ``tl.program_id(0)``; ``tl.arange(0, BLOCK)`` gives the lanes; ``tl.load(ptrs,
    mask=..., other=...)``; ``tl.store`` every lane of the output row.
    """
    raise NotImplementedError("Exercise 4.0a: masked_row_copy_kernel")


def masked_row_copy(x: torch.Tensor, n_cols: int, block: int = 16) -> torch.Tensor:
    """Given: launch :func:`masked_row_copy_kernel` on ``x`` [rows, >= n_cols] (rows may be
    strided, columns contiguous); returns out [rows, block] float32."""
    out = torch.full((x.shape[0], block), float("nan"), dtype=torch.float32, device=x.device)
    masked_row_copy_kernel[(x.shape[0],)](x, out, n_cols, x.stride(0), BLOCK=block)
    return out


# ---- Exercise 4.0b: a gather through an index tensor -------------------------------------------


@triton.jit
def gather_rows_kernel(x_ptr, idx_ptr, out_ptr, n_idx, n_cols, stride_x,
                       BLOCK_I: tl.constexpr, BLOCK_D: tl.constexpr):
    """Exercise 4.0b: one program gathers the rows that an index tensor points at.

    ``idx`` is int32; only its first ``n_idx <= BLOCK_I`` entries are indices, the rest are
    garbage (-1, ids of other rows, ...). ``x`` is [num_rows, stride_x] with data in its first
    ``n_cols <= BLOCK_D`` columns. ``out`` is a contiguous [BLOCK_I, BLOCK_D] float32 tensor:

        out[i, d] = x[idx[i], d]   for i < n_idx and d < n_cols,      0 elsewhere

    Grid: ``(1,)``. This is lesson 03's ``k_cache.flatten(0, 1)[slots]`` for one tile, and
    half of Exercise 4.2.

    Example: ``idx = [2, 0, -1, 7]``, ``n_idx = 2``: out row 0 is row 2 of x, out row 1 is
    row 0, out rows 2 and 3 are zeros (entries -1 and 7 are never followed).

    Hints:
        * Two loads: first the ``[BLOCK_I]`` indices, then a ``[BLOCK_I, BLOCK_D]`` block of
          values; ``a[:, None] + b[None, :]`` broadcasts two vectors into a block of offsets,
          and ``&`` combines masks the same way.
        * An index times a row stride is an address offset: cast the index to ``tl.int64``
          first, or a large tensor's offsets wrap around in int32.
    """
    raise NotImplementedError("Exercise 4.0b: gather_rows_kernel")


def gather_rows(x: torch.Tensor, idx: torch.Tensor, n_idx: int, n_cols: int,
                block_i: int = 16, block_d: int = 16) -> torch.Tensor:
    """Given: launch :func:`gather_rows_kernel`; returns out [block_i, block_d] float32."""
    out = torch.full((block_i, block_d), float("nan"), dtype=torch.float32, device=x.device)
    gather_rows_kernel[(1,)](x, idx, out, n_idx, n_cols, x.stride(0), BLOCK_I=block_i,
                             BLOCK_D=block_d)
    return out


# ---- Exercise 4.0c: a loop with a running max --------------------------------------------------


@triton.jit
def running_max_kernel(x_ptr, lens_ptr, steps_ptr, stride_x, stride_s, BLOCK: tl.constexpr):
    """Exercise 4.0c: program ``row`` walks its row BLOCK values at a time, keeping the max.

    Row ``row`` of ``x`` (float32, row stride ``stride_x``) holds ``n = lens[row]`` values
    (int32 lengths, ragged, 0 allowed); what lies past them may be anything. Step ``s`` of the
    loop reads values ``s * BLOCK .. s * BLOCK + BLOCK - 1`` (the last step only up to
    ``n - 1``) and then stores the max of *everything read so far* (one float32) in
    ``steps[row, s]`` (row stride ``stride_s``). Store nothing else: a row of ``n`` values
    writes exactly ``ceil(n / BLOCK)`` entries. Grid: ``(rows,)``.

    Example: ``BLOCK = 4``, a row ``[-3., -1., -2., -5., -4., 2.]`` (n = 6): step 0 reads 4
    values (max -1), step 1 reads 2 (max 2): ``steps[row, :2] = [-1., 2.]``.

    This is the running max ``m`` of the online softmax (Exercise 4.1 in torch; 4.3 in Triton)
    without the sum: one value that every loop step updates, never revisiting old tiles.

    Hints:
        * ``for s in range(0, tl.cdiv(n, BLOCK)):`` with ``n`` loaded from ``lens_ptr``.
        * Values may all be negative: masked lanes must not win the max (``other=``).
        * A loop-carried value must keep one type: start it as
          ``tl.full([], float("-inf"), tl.float32)``; ``tl.max(x, axis=0)`` reduces a vector.
    """
    raise NotImplementedError("Exercise 4.0c: running_max_kernel")


def running_max(x: torch.Tensor, lens: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Given: launch :func:`running_max_kernel`; returns steps [rows, ceil(max(lens) / block)]
    float32, NaN where a row had no such step."""
    num_steps = max(1, -(-int(lens.max()) // block)) if lens.numel() else 1
    steps = torch.full((x.shape[0], num_steps), float("nan"), dtype=torch.float32,
                       device=x.device)
    running_max_kernel[(x.shape[0],)](x, lens, steps, x.stride(0), steps.stride(0), BLOCK=block)
    return steps
