"""The disk tier of the prefix cache: evicted blocks in a file, below the host tier.

When the host tier (:mod:`.host_tier`) is full, its least recently spilled block moves down here
instead of being dropped; a later prompt with the same prefix reads it back -- disk -> host
memory when the prompt is looked up, then host -> device with the step's other block moves --
instead of recomputing it. A block lives in one tier at a time: a hit takes it out of the file.

One file per pool, ``num_blocks`` fixed-size slots; slot ``s`` is the bytes
``[s * block_bytes, (s + 1) * block_bytes)``: one block's K and V of every layer, in the host
tier's layout ``block_shape = (2, num_layers, block_size, num_kv_heads, head_dim)``. This class
holds the file and its bookkeeping: block hash -> slot, a free list, least recently used first
out (a spill or a prefetch makes a block recently used), the reads in flight.

    disk = DiskTier(tmp_dir, 64, block_shape=(2, 16, 16, 8, 64), dtype=torch.bfloat16)
    m = KVCacheManager(n, 16, enable_prefix_caching=True, num_host_blocks=8, disk_tier=disk)
    cache = PagedKVCache(16, n, 16, 8, 64, dtype=torch.bfloat16, num_host_blocks=8, disk_tier=disk)
    m.prefetch(next_prompt)   # reads start on a thread; add_sequence later waits for them
    disk.close()              # the file is removed (also on ``with DiskTier(...)`` and at exit)

What it costs (a Llama-3.2-1B shape: 32 KiB of K/V per token, 512 KiB per 16-token block;
``python -m paged_bench tiers`` measures it on the machine it runs on):

* a spill is one ``pwrite`` per block into the OS page cache (memory speed, ~5-10 GB/s; the
  kernel writes it back later), plus, for a block still on the device, a device -> host copy;
* a read is one ``preadv`` per block into (pinned) host memory: from the page cache at memory
  speed, cold from an NVMe SSD at ~2-7 GB/s with several reads in flight (``workers``), from a
  network disk far less; then host -> device over PCIe (~40-55 GB/s on an H200), like a host hit.
  A 32k-token prefix (1 GiB) is ~0.2-0.5 s cold from a fast SSD, ~20 ms from the host tier;
  recomputing it is a prefill of ~134 TFLOP (~0.3 s at 450 TFLOP/s). Short prefixes pay the
  ~0.1 ms latency of each read.
* ``prefetch`` overlaps those reads with the steps before the prompt is admitted; memory: a
  read block stays in host memory until a hit takes it or it leaves the disk.

NOTE: ``pread``/``pwrite`` rather than a memory map: a read lands straight in the buffer that
is copied to the device, releases the GIL (so a thread can overlap it), fails with an
``OSError`` rather than a ``SIGBUS``, and ``posix_fadvise(DONTNEED)`` can drop its pages (the
kernel keeps pages that are mapped), which an honest cold read needs.

Faults: a write that fails (``OSError``: a full disk, an I/O error) drops its block's hash, so
nothing points at a half-written slot; a read that fails drops it too, and the lookup stops
before it (those tokens are recomputed); ``stats`` of the manager counts both. A read that
raises anything else raises it in the lookup, and is forgotten (read again by the next one).
"""

from __future__ import annotations

import concurrent.futures as cf
import errno
import math
import os
import tempfile
import weakref
from collections.abc import Hashable, Iterable

import torch

from paged_ref.memory.allocator import check_int
from paged_ref.memory.free_queue import SlotLRU

#: The element types a disk tier stores (the plain caches' dtypes).
DISK_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _write_at(fd: int, data: memoryview, offset: int) -> None:
    """All of ``data`` at byte ``offset`` of ``fd`` (``pwrite`` may write less at a time)."""
    done = 0
    while done < len(data):
        n = os.pwrite(fd, data[done:], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"pwrite wrote nothing at byte {offset + done}")
        done += n


def _read_into(fd: int, buf: memoryview, offset: int) -> None:
    """Fill ``buf`` from byte ``offset`` of ``fd``; ``OSError`` at the end of the file."""
    done = 0
    while done < len(buf):
        n = os.preadv(fd, [buf[done:]], offset + done)
        if n <= 0:
            raise OSError(errno.EIO, f"end of file at byte {offset + done}")
        done += n


def _bytes_of(block: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a flat writable view (no copy)."""
    return memoryview(block.view(torch.uint8).view(-1).numpy())


def _close(fd: int, path: str, pool) -> None:
    """Stop the reads, close and remove the file (``weakref.finalize``: once, at the latest
    at exit)."""
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
    os.close(fd)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class DiskTier:
    """``num_blocks`` slots of a file in the folder ``path``, each holding one spilled block.

    Args:
        path: an existing, writable folder (an SSD's, ideally); the file, ``paged-kv-*.blocks``,
            is made in it, sparse (space is taken as blocks are written), and removed by
            :meth:`close`.
        num_blocks: slots (>= 1).
        block_shape: one block's K/V, ``(2, num_layers, block_size, num_kv_heads, head_dim)``
            (``PagedKVCache.host_kv.shape[1:]``).
        dtype: float16, bfloat16 or float32: the cache's.
        workers: threads that read ahead (:meth:`prefetch`); 0 reads on the caller's thread
            only, when a lookup needs a block.
        pin_memory: read into pinned host memory (default: when CUDA is available), so the
            copy to the device is one direct transfer.

    Raises:
        ValueError: ``path`` is not a writable folder, ``num_blocks`` < 1, ``block_shape`` is
            not 5 positive ints, ``dtype`` is not one of :data:`DISK_DTYPES`, ``workers`` < 0.
        TypeError: ``dtype`` is not a ``torch.dtype``, a count is not an int.
    """

    def __init__(self, path, num_blocks: int, block_shape, dtype: torch.dtype = torch.float16,
                 *, workers: int = 4, pin_memory: bool | None = None) -> None:
        self.num_blocks = check_int("num_blocks", num_blocks, minimum=1)
        shape = tuple(block_shape) if isinstance(block_shape, (tuple, list, torch.Size)) else ()
        if len(shape) != 5 or any(isinstance(n, bool) or not isinstance(n, int) or n < 1
                                  for n in shape):
            raise ValueError("block_shape must be 5 positive ints (2, num_layers, block_size, "
                             f"num_kv_heads, head_dim), got {block_shape!r}")
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"dtype must be a torch.dtype, got {type(dtype).__name__}")
        if dtype not in DISK_DTYPES:
            raise ValueError(f"dtype must be one of {DISK_DTYPES}, got {dtype}")
        workers = check_int("workers", workers)
        folder = os.fspath(path)
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"path must be an existing folder this process can write to, "
                             f"got {folder!r}")
        self.block_shape, self.dtype = shape, dtype
        self.block_bytes = math.prod(shape) * dtype.itemsize
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else bool(pin_memory)
        try:
            fd, self.path = tempfile.mkstemp(prefix="paged-kv-", suffix=".blocks", dir=folder)
        except OSError as exc:
            raise ValueError(f"path {folder!r}: cannot make the disk tier's file ({exc})") from exc
        self._fd = fd
        self._pool = cf.ThreadPoolExecutor(workers, "disk-tier") if workers else None
        self._finalizer = weakref.finalize(self, _close, fd, self.path, self._pool)
        try:
            os.ftruncate(fd, self.num_blocks * self.block_bytes)
        except OSError as exc:
            self._finalizer()
            raise ValueError(f"path {folder!r}: cannot size the file ({exc})") from exc
        self._slots = SlotLRU(self.num_blocks)
        self._unwritten: set[int] = set()  # held slots whose write is still owed
        self._ahead: dict[int, cf.Future | torch.Tensor] = {}  # slot -> its read (ahead)
        self.bytes_read = self.bytes_written = 0  #: bytes read from / written to the file, all
        self.read_errors = self.write_errors = 0  #: reads / writes that failed (blocks dropped)

    # ---- what it holds ----------------------------------------------------------------------

    def __len__(self) -> int:
        """Blocks held (written or with their write still owed)."""
        return len(self._slots)

    def __contains__(self, block_hash: Hashable) -> bool:
        return block_hash in self._slots

    def readable(self, block_hash: Hashable) -> bool:
        """Whether ``block_hash`` is here and written (a block spilled in this step is found
        from the next one on: its bytes reach the file when the step's moves run)."""
        slot = self._slots.slot_of(block_hash)
        return slot is not None and slot not in self._unwritten

    def slot_of(self, block_hash: Hashable) -> int | None:
        """The slot holding ``block_hash``, or None."""
        return self._slots.slot_of(block_hash)

    def hashes(self) -> list[Hashable]:
        """Hashes held, the next to be dropped first."""
        return self._slots.hashes()

    @property
    def num_free_blocks(self) -> int:
        """Slots holding nothing."""
        return self._slots.num_free

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    # ---- bookkeeping (the host tier's side) -------------------------------------------------

    def put(self, block_hash: Hashable) -> tuple[int, Hashable | None]:
        """A slot for ``block_hash``, whose bytes :meth:`write` brings: a free slot, else the
        least recently used one's (that hash is dropped). Returns ``(slot, dropped_hash)``."""
        self._check_open()
        slot, dropped = self._slots.put(block_hash)
        if dropped is not None:
            self._forget_read(slot)
        self._unwritten.add(slot)
        return slot, dropped

    def discard(self, block_hash: Hashable) -> int | None:
        """Forget ``block_hash`` if it is here (its block is back on the device, or its bytes
        are bad); returns the slot it held, now free, or None."""
        slot = self._slots.pop(block_hash) if block_hash in self._slots else None
        if slot is not None:
            self._release(slot)
        return slot

    def take(self, block_hash: Hashable) -> torch.Tensor:
        """A hit: ``block_hash`` leaves the disk; its block ``[*block_shape]`` on the CPU (read
        by :meth:`load` or a prefetch; else now, on this thread). Its slot is free at once.

        Raises:
            KeyError: ``block_hash`` is not here.
            OSError: the read failed (the hash is dropped all the same).
        """
        slot = self._slots.pop(block_hash)
        ahead = self._ahead.pop(slot, None)
        try:
            if ahead is None:
                ahead = self._read(slot)
                self.bytes_read += self.block_bytes
            elif isinstance(ahead, cf.Future):
                ahead = self._finish(ahead)
        except OSError:
            self.read_errors += 1
            raise
        finally:
            self._release(slot)
        return ahead

    # ---- reading ahead ----------------------------------------------------------------------

    def prefetch(self, hashes: Iterable[Hashable]) -> int:
        """Start reading the blocks of ``hashes`` that are here (and written) on the threads,
        each made recently used; the others are skipped. Returns how many reads started (0
        with ``workers=0``: then :meth:`load` reads them when a lookup needs them)."""
        hashes = [h for h in hashes if self.readable(h)]
        for block_hash in hashes:
            self._slots.touch(block_hash)
        return self._start_reads(hashes)

    def wait(self, hashes: Iterable[Hashable] | None = None) -> list[Hashable]:
        """Wait for the reads started for ``hashes`` (default: all in flight). A read that
        failed drops its hash; returns those hashes (empty when every read worked)."""
        slots = list(self._ahead) if hashes is None else [
            s for s in map(self._slots.slot_of, hashes) if s is not None]
        failed = []
        for slot in slots:
            ahead = self._ahead.get(slot)
            if isinstance(ahead, cf.Future):
                try:
                    self._ahead[slot] = self._finish(ahead)
                except OSError:
                    failed.append(self._drop_unreadable(slot))
                finally:  # (it raised another error: forgotten; Ctrl-C while it runs: kept)
                    if self._ahead.get(slot) is ahead and ahead.done():
                        del self._ahead[slot]
        return failed

    def load(self, hashes: Iterable[Hashable]) -> list[Hashable]:
        """Make sure the blocks of ``hashes`` (those here and written) are read, and wait for
        them: what a lookup that found them calls. Reads not started yet run on the threads
        (or on this one with ``workers=0``). Returns the hashes whose read failed (dropped)."""
        hashes = [h for h in hashes if self.readable(h)]
        self._start_reads(hashes)  # (no LRU change: a lookup that then fails changes nothing)
        failed = self.wait(hashes)
        for block_hash in hashes:
            slot = self._slots.slot_of(block_hash)
            if slot is not None and slot not in self._ahead:  # no threads: read here
                try:
                    self._ahead[slot] = self._read(slot)
                    self.bytes_read += self.block_bytes
                except OSError:
                    failed.append(self._drop_unreadable(slot))
        return failed

    def peek(self, block_hash: Hashable) -> torch.Tensor:
        """The block ``block_hash``'s slot holds now, read on this thread; changes nothing
        (no counter, no LRU order). ``KeyError`` if it is not here."""
        slot = self._slots.slot_of(block_hash)
        if slot is None:
            raise KeyError(block_hash)
        return self._read(slot)

    # ---- writing (the storage's side: ``PagedKVCache.apply_block_ops``) --------------------

    def write(self, slot: int, block: torch.Tensor) -> bool:
        """Write ``block`` (``[*block_shape]``, this tier's dtype, on the CPU) into ``slot``,
        whose hash :meth:`put` placed there. A slot that holds nothing is left alone (its hash
        left meanwhile). Returns whether the block is now readable.

        A failed write (``OSError``) drops the slot's hash -- it is never found over half
        written bytes -- and is counted in :attr:`write_errors`, not raised: a cache may lose
        an entry. Any other error is raised after dropping it.

        Raises:
            ValueError: ``block`` has another shape or dtype, or is not a CPU tensor.
        """
        self._check_open()
        if (tuple(block.shape) != self.block_shape or block.dtype != self.dtype
                or block.device.type != "cpu"):
            raise ValueError(f"block must be a CPU tensor {self.block_shape} of {self.dtype}, "
                             f"got {tuple(block.shape)} {block.dtype} on {block.device}")
        if slot not in self._unwritten:
            return False
        try:
            _write_at(self._fd, _bytes_of(block.contiguous()), slot * self.block_bytes)
        except OSError:
            self.write_errors += 1
            self._drop_slot(slot)
            return False
        except BaseException:
            self._drop_slot(slot)
            raise
        self._unwritten.discard(slot)
        self.bytes_written += self.block_bytes
        return True

    def drop_page_cache(self) -> None:
        """Flush the file and ask the OS to drop its cached pages (``fsync``, then
        ``posix_fadvise(POSIX_FADV_DONTNEED)``), so the next reads come from the disk: what an
        honest cold read needs. A file system may ignore the advice (tmpfs keeps its pages)."""
        self._check_open()
        os.fsync(self._fd)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)

    # ---- closing ----------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the reads, close and remove the file. Safe to call twice."""
        self._ahead.clear()
        self._finalizer()

    def __enter__(self) -> DiskTier:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- helpers ----------------------------------------------------------------------------

    def _read(self, slot: int) -> torch.Tensor:
        """Slot ``slot``'s block, read now into a fresh (pinned) CPU tensor."""
        block = torch.empty(self.block_shape, dtype=self.dtype, pin_memory=self.pin_memory)
        _read_into(self._fd, _bytes_of(block), slot * self.block_bytes)
        return block

    def _start_reads(self, hashes: list[Hashable]) -> int:
        """Submit the reads of ``hashes`` (held, written) not in flight yet; how many."""
        self._check_open()
        started = 0
        for slot in map(self._slots.slot_of, hashes):
            if self._pool is not None and slot not in self._ahead:
                self._ahead[slot] = self._pool.submit(self._read, slot)
                started += 1
        return started

    def _finish(self, future: cf.Future) -> torch.Tensor:
        """The result of a read ahead (``OSError`` if it failed), counted."""
        block = future.result()
        self.bytes_read += self.block_bytes
        return block

    def _drop_unreadable(self, slot: int) -> Hashable:
        """A read of ``slot`` failed: count it, drop its hash (returned)."""
        self.read_errors += 1
        return self._drop_slot(slot)

    def _drop_slot(self, slot: int) -> Hashable | None:
        """Forget the hash held in ``slot`` (its bytes are not what the hash names); it."""
        block_hash = self._slots.hash_at(slot)
        if block_hash is not None:
            self.discard(block_hash)
        return block_hash

    def _release(self, slot: int) -> None:
        """``slot`` (popped) holds nothing now: no read of it is pending, it is free."""
        self._forget_read(slot)
        self._unwritten.discard(slot)
        self._slots.free(slot)

    def _forget_read(self, slot: int) -> None:
        """Drop what was read ahead of ``slot``; a read still running is waited for, so it
        never overlaps the next write of the slot."""
        ahead = self._ahead.pop(slot, None)
        if isinstance(ahead, cf.Future) and not ahead.cancel():
            cf.wait([ahead])

    def _check_open(self) -> None:
        if self.closed:
            raise ValueError("this DiskTier is closed")

    def __repr__(self) -> str:
        return (f"DiskTier({self.path!r}, num_blocks={self.num_blocks}, "
                f"block_shape={self.block_shape}, dtype={self.dtype}, held={len(self)})")
