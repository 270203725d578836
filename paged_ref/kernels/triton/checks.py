"""The value checks of an unplanned ``paged_attention`` call, as one small Triton kernel.

Without a plan, ``paged_attention`` must read the lengths and the used block-table entries
before it launches anything (a bad block id would make the kernel read outside the pool). On
the GPU, copying them to the host and checking them with NumPy cost 76-136 us per call on an
H200 (the copy, a sync, NumPy over every entry): half the time of a 0.25 ms decode kernel.
This kernel reduces them on the device instead; the host then reads back four numbers per
program (one small copy, one sync):

    stats[p] = (shortest length, longest length, total length, bad used entries)

for the rows ``[p * ROWS, (p + 1) * ROWS)`` of the batch. An entry is *used* when its block
holds tokens of the sequence (``j * block_size < seq_lens[b]``); it is *bad* when it is not a
block id (``< 0`` or ``>= num_blocks``). Any strides.

The kernel also writes ``checked_lens[b]``: ``seq_lens[b]`` when row ``b`` passed (length in
``[0, width * block_size]``, every used entry a block id), else ``-1``. The attention kernels
skip a row of length ``-1`` (they write nothing for it and read none of its table entries), so
an unplanned call can queue the attention kernel right behind this one, reading
``checked_lens``, and wait for the verdict only afterwards (:func:`start_checks`): the GPU never
waits for the host, and a bad row is never read. The host raises after the verdict arrives.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from paged_ref.kernels.triton.launch import launch

ROWS = 16  # sequences per program, at most
#: Table entries a program reads per step of its loop (rows x columns). The steps of one
#: program run one after another, each waiting on its loads, so a long narrow table (B1_L131072:
#: one row of 8,193 entries) in 16 x 128 tiles took 65 steps, ~60 us on an H200: a quarter of
#: the attention kernel's time. Tiles of this many entries, as few rows as the batch has, take
#: 3 steps there.
TILE_ENTRIES = 8192


def tile_shape(batch: int, width: int) -> tuple[int, int]:
    """``(rows, cols)`` of one program's tile: powers of two, ``rows <= ROWS``, ``rows x cols
    <= TILE_ENTRIES``, no wider than the table needs."""
    rows = min(ROWS, max(2, triton.next_power_of_2(batch)))
    cols = min(TILE_ENTRIES // rows, max(16, triton.next_power_of_2(width)))
    return rows, cols


@triton.jit
def check_values_kernel(
    stats_ptr,  # int64 [num_programs, 4]
    checked_lens_ptr,  # int32 [batch]: seq_lens[b], or -1 where row b failed a check
    table_ptr, lens_ptr,  # block_tables [batch, width], seq_lens [batch] (any integer dtype)
    batch, width, stride_tb, stride_tc, stride_l, block_size, num_blocks,
    ROWS: tl.constexpr, COLS: tl.constexpr,
):
    p = tl.program_id(0)
    rows = p * ROWS + tl.arange(0, ROWS)
    r_mask = rows < batch
    lens = tl.load(lens_ptr + rows.to(tl.int64) * stride_l, mask=r_mask, other=0).to(tl.int64)
    big = tl.full([ROWS], 2**62, dtype=tl.int64)
    shortest = tl.min(tl.where(r_mask, lens, big), axis=0)
    longest = tl.max(tl.where(r_mask, lens, -big), axis=0)
    total = tl.sum(lens, axis=0)
    bad = tl.zeros([ROWS, COLS], dtype=tl.int32)
    capacity = tl.full([ROWS], width, dtype=tl.int64) * block_size
    for c0 in range(0, width, COLS):
        cols = c0 + tl.arange(0, COLS)
        first_token = cols.to(tl.int64) * block_size
        used = r_mask[:, None] & (cols < width)[None, :] & (first_token[None, :] < lens[:, None])
        ids = tl.load(table_ptr + rows.to(tl.int64)[:, None] * stride_tb
                      + cols.to(tl.int64)[None, :] * stride_tc, mask=used, other=0)
        bad += (used & ((ids < 0) | (ids >= num_blocks))).to(tl.int32)
    row_ok = (tl.sum(bad, axis=1) == 0) & (lens >= 0) & (lens <= capacity)
    tl.store(checked_lens_ptr + rows, tl.where(row_ok, lens, -1).to(tl.int32), mask=r_mask)
    out = stats_ptr + p * 4
    tl.store(out, shortest)
    tl.store(out + 1, longest)
    tl.store(out + 2, total)
    tl.store(out + 3, tl.sum(tl.sum(bad, axis=1), axis=0).to(tl.int64))


@dataclass
class PendingChecks:
    """The check kernel's results, on their way to the host.

    ``checked_lens`` (device, int32 ``[batch]``) can be handed to the attention kernels at once;
    :meth:`stats` waits for the check kernel only (a CUDA event), not for work queued after it.
    """

    checked_lens: torch.Tensor
    host_stats: torch.Tensor  # int64 [programs, 4], pinned host memory when on a GPU
    done: torch.cuda.Event | None

    def stats(self) -> tuple[int, int, int, int]:
        """``(shortest, longest, total, bad used entries)`` over the batch."""
        if self.done is not None:
            self.done.synchronize()
        rows = self.host_stats.tolist()
        return (min(r[0] for r in rows), max(r[1] for r in rows), sum(r[2] for r in rows),
                sum(r[3] for r in rows))


def start_checks(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                 num_blocks: int) -> PendingChecks:
    """Launch the check kernel and the copy of its four numbers per program to the host; do
    not wait.

    Args:
        block_tables: integer ``[batch, width]``, any strides, batch >= 1.
        seq_lens: integer ``[batch]``, any strides.
        block_size, num_blocks: the cache's.

    Returns:
        PendingChecks: ``checked_lens`` (int32 ``[batch]``, ``-1`` for a failed row) now, the
        verdict by :meth:`PendingChecks.stats`.
    """
    device = seq_lens.device
    if device.type == "cuda" and device.index != torch.cuda.current_device():
        with torch.cuda.device(device):  # kernel, copy and event on one GPU's stream
            return start_checks(block_tables, seq_lens, block_size, num_blocks)
    batch, width = block_tables.shape
    rows, cols = tile_shape(batch, width)
    programs = triton.cdiv(batch, rows)
    stats = torch.empty(programs, 4, dtype=torch.int64, device=device)
    checked_lens = torch.empty(batch, dtype=torch.int32, device=device)
    launch(
        check_values_kernel, (programs,),
        stats, checked_lens, block_tables, seq_lens, batch, width, block_tables.stride(0),
        block_tables.stride(1), seq_lens.stride(0), block_size, num_blocks, ROWS=rows, COLS=cols,
        num_warps=8 if rows * cols >= 4096 else 4,
    )
    if device.type != "cuda":
        return PendingChecks(checked_lens, stats, None)
    host_stats = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
    host_stats.copy_(stats, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return PendingChecks(checked_lens, host_stats, done)


def length_stats(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                 num_blocks: int) -> tuple[int, int, int, int]:
    """The check kernel's verdict: one launch, one small read-back (waited for here).

    Args:
        block_tables, seq_lens, block_size, num_blocks: as for :func:`start_checks`.

    Returns:
        ``(shortest, longest, total, bad used entries)`` over the batch, Python ints.
    """
    return start_checks(block_tables, seq_lens, block_size, num_blocks).stats()


__all__ = ["PendingChecks", "check_values_kernel", "length_stats", "start_checks", "tile_shape"]
