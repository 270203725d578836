"""The disk tier on its own: slots in a file, least recently used first out, reads ahead on
threads, failures that drop their block, bad arguments, and the file removed on close."""

from __future__ import annotations

import errno
import gc
import os
import threading

import pytest
import torch

import paged_ref.memory.disk_tier as disk_module
from paged_ref.memory.disk_tier import DiskTier

SHAPE = (2, 3, 4, 2, 8)  # (K/V, layers, block_size, kv heads, head_dim)


def hashes(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]


def spill(disk: DiskTier, block_hash: bytes, dtype=torch.float32) -> torch.Tensor:
    """Put ``block_hash`` on the disk with fresh random K/V; the block written."""
    slot, _ = disk.put(block_hash)
    block = torch.randn(SHAPE).to(dtype)
    assert disk.write(slot, block)
    return block


@pytest.fixture
def folder(tmp_path):
    yield tmp_path
    assert list(tmp_path.glob("paged-kv-*")) == [], "a disk tier left its file behind"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("workers", [0, 3])
def test_blocks_come_back_bit_for_bit_and_leave_the_disk(folder, dtype, workers):
    with DiskTier(folder, 5, SHAPE, dtype, workers=workers) as disk:
        keys = hashes(5)
        written = {h: spill(disk, h, dtype) for h in keys}
        assert disk.bytes_written == 5 * disk.block_bytes and len(disk) == 5
        order = torch.randperm(5).tolist()
        assert disk.load([keys[i] for i in order[:3]]) == []
        for i in order:  # three read ahead, two read now on this thread
            assert torch.equal(disk.take(keys[i]), written[keys[i]])
        assert len(disk) == 0 and disk.num_free_blocks == 5
        assert disk.bytes_read == 5 * disk.block_bytes
        assert disk.block_bytes == 2 * 3 * 4 * 2 * 8 * dtype.itemsize


def test_full_disk_drops_the_least_recently_used_and_prefetch_refreshes(folder):
    with DiskTier(folder, 2, SHAPE, torch.float32, workers=0) as disk:
        a, b, c, d = hashes(4)
        spill(disk, a)
        spill(disk, b)
        assert disk.put(c)[1] == a  # full: the oldest spill goes
        disk.write(disk.slot_of(c), torch.randn(SHAPE))
        assert disk.hashes() == [b, c]
        disk.prefetch([b])  # b is about to be used: now the most recent
        assert disk.put(d)[1] == c and disk.hashes() == [b, d]


def test_a_block_spilled_in_this_step_is_found_once_written(folder):
    with DiskTier(folder, 2, SHAPE, torch.float32, workers=0) as disk:
        (h,) = hashes(1)
        slot, _ = disk.put(h)
        assert h in disk and not disk.readable(h)  # its write is owed
        assert disk.prefetch([h]) == 0 and disk.load([h]) == []
        disk.write(slot, torch.randn(SHAPE))
        assert disk.readable(h)


def test_prefetch_reads_on_the_threads(folder, monkeypatch):
    threads = set()
    real = disk_module._read_into

    def spy(fd, buf, offset):
        threads.add(threading.current_thread().name)
        real(fd, buf, offset)

    monkeypatch.setattr(disk_module, "_read_into", spy)
    with DiskTier(folder, 4, SHAPE, torch.float32, workers=2) as disk:
        keys = hashes(4)
        written = [spill(disk, h) for h in keys]
        assert disk.prefetch(keys + hashes(1)) == 4  # an unknown hash is skipped
        assert disk.prefetch(keys) == 0  # already in flight
        assert disk.wait() == []
        assert threads and all(name.startswith("disk-tier") for name in threads)
        assert all(torch.equal(disk.take(h), w) for h, w in zip(keys, written, strict=True))
        assert disk.bytes_read == 4 * disk.block_bytes  # each block read once


def test_peek_changes_nothing(folder):
    with DiskTier(folder, 3, SHAPE, torch.float32, workers=0) as disk:
        keys = hashes(3)
        written = [spill(disk, h) for h in keys]
        assert torch.equal(disk.peek(keys[1]), written[1])
        assert disk.hashes() == keys and disk.bytes_read == 0
        with pytest.raises(KeyError):
            disk.peek(b"nope")


def test_short_writes_and_reads_are_completed(folder, monkeypatch):
    """``pwrite`` / ``preadv`` may move fewer bytes than asked: the rest follows."""
    real_write, real_read = os.pwrite, os.preadv
    monkeypatch.setattr(disk_module.os, "pwrite", lambda fd, d, o: real_write(fd, d[:100], o))
    monkeypatch.setattr(disk_module.os, "preadv",
                        lambda fd, bufs, o: real_read(fd, [bufs[0][:100]], o))
    with DiskTier(folder, 2, SHAPE, torch.float32, workers=0) as disk:
        (h,) = hashes(1)
        block = spill(disk, h)
        assert torch.equal(disk.take(h), block)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_write_failing_half_way_drops_its_block(folder, monkeypatch, workers):
    """An I/O error after half a block is written: that hash is gone (its slot free, never
    read back over half-written bytes); the other blocks are intact; nothing is raised."""
    with DiskTier(folder, 3, SHAPE, torch.float32, workers=workers) as disk:
        a, b, c = hashes(3)
        block_a = spill(disk, a)
        real = disk_module._write_at

        def half_then_fail(fd, data, offset):
            real(fd, data[: len(data) // 2], offset)
            raise OSError(errno.ENOSPC, "no space left")

        slot, _ = disk.put(b)
        monkeypatch.setattr(disk_module, "_write_at", half_then_fail)
        assert disk.write(slot, torch.randn(SHAPE)) is False
        monkeypatch.setattr(disk_module, "_write_at", real)
        assert b not in disk and disk.write_errors == 1 and disk.bytes_written == disk.block_bytes
        assert len(disk) + disk.num_free_blocks == 3
        block_c = spill(disk, c)
        assert torch.equal(disk.take(a), block_a) and torch.equal(disk.take(c), block_c)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_read_failing_half_way_drops_its_block(folder, monkeypatch, workers):
    with DiskTier(folder, 3, SHAPE, torch.float32, workers=workers) as disk:
        keys = hashes(3)
        written = [spill(disk, h) for h in keys]
        real, bad = disk_module._read_into, disk.slot_of(keys[1]) * disk.block_bytes

        def fail_for_b(fd, buf, offset):
            real(fd, buf[: len(buf) // 2], offset)
            if offset == bad:
                raise OSError(errno.EIO, "bad sector")
            real(fd, buf, offset)

        monkeypatch.setattr(disk_module, "_read_into", fail_for_b)
        assert disk.load(keys) == [keys[1]]
        assert keys[1] not in disk and disk.read_errors == 1
        assert len(disk) + disk.num_free_blocks == 3
        assert torch.equal(disk.take(keys[0]), written[0])
        assert torch.equal(disk.take(keys[2]), written[2])


def test_a_read_ahead_that_raises_another_error_is_read_again(folder, monkeypatch):
    """Not an I/O error (a bug, memory): it raises in the lookup that waits for it, and is
    forgotten, so the next lookup reads the block again instead of raising it forever."""
    with DiskTier(folder, 2, SHAPE, torch.float32, workers=2) as disk:
        (h,) = hashes(1)
        block, real, calls = spill(disk, h), disk_module._read_into, [0]

        def once(fd, buf, offset):
            calls[0] += 1
            if calls[0] == 1:
                raise RuntimeError("planted: not an I/O error")
            real(fd, buf, offset)

        monkeypatch.setattr(disk_module, "_read_into", once)
        assert disk.prefetch([h]) == 1
        with pytest.raises(RuntimeError, match="planted"):
            disk.load([h])
        assert disk.readable(h) and disk.read_errors == 0  # (kept: its bytes are fine)
        assert disk.load([h]) == [] and torch.equal(disk.take(h), block) and calls[0] == 2


def test_take_without_load_reads_now_and_a_failure_drops_the_hash(folder, monkeypatch):
    with DiskTier(folder, 2, SHAPE, torch.float32, workers=0) as disk:
        (h,) = hashes(1)
        spill(disk, h)

        def fail(fd, buf, offset):
            raise OSError(errno.EIO, "bad sector")

        monkeypatch.setattr(disk_module, "_read_into", fail)
        with pytest.raises(OSError):
            disk.take(h)
        assert h not in disk and disk.num_free_blocks == 2 and disk.read_errors == 1


def test_close_removes_the_file_and_is_idempotent(folder):
    disk = DiskTier(folder, 4, SHAPE, torch.float32, workers=2)
    path = disk.path
    assert os.path.dirname(path) == str(folder) and os.path.getsize(path) == 4 * disk.block_bytes
    spill(disk, hashes(1)[0])
    disk.close()
    disk.close()
    assert disk.closed and not os.path.exists(path)
    with pytest.raises(ValueError, match="closed"):
        disk.put(b"x")


def test_a_dropped_disk_tier_removes_its_file(folder):
    disk = DiskTier(folder, 1, SHAPE, torch.float32)
    path = disk.path
    del disk
    gc.collect()
    assert not os.path.exists(path)


def test_drop_page_cache_keeps_the_data(folder):
    with DiskTier(folder, 2, SHAPE, torch.float32, workers=0) as disk:
        (h,) = hashes(1)
        block = spill(disk, h)
        disk.drop_page_cache()
        assert torch.equal(disk.take(h), block)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(num_blocks=0), ValueError, "num_blocks must be >= 1"),
    (dict(num_blocks=2.0), TypeError, "num_blocks must be an int"),
    (dict(dtype=torch.int8), ValueError, "dtype must be one of"),
    (dict(dtype=torch.float8_e4m3fn), ValueError, "dtype must be one of"),
    (dict(dtype="float16"), TypeError, "dtype must be a torch.dtype"),
    (dict(block_shape=(2, 3, 4, 8)), ValueError, "block_shape must be 5 positive ints"),
    (dict(block_shape=(2, 3, 0, 2, 8)), ValueError, "block_shape must be 5 positive ints"),
    (dict(workers=-1), ValueError, "workers must be >= 0"),
])
def test_bad_arguments_are_named(folder, kwargs, error, match):
    args = dict(path=folder, num_blocks=2, block_shape=SHAPE, dtype=torch.float16) | kwargs
    with pytest.raises(error, match=match):
        DiskTier(**args)


def test_a_path_that_is_not_a_writable_folder_is_refused(folder):
    file = folder / "a_file"
    file.write_text("x")
    for path in (file, folder / "missing", file / "below"):
        with pytest.raises(ValueError, match="path must be an existing folder"):
            DiskTier(path, 2, SHAPE)
    file.unlink()


def test_a_path_this_process_cannot_write_is_refused(folder, monkeypatch):
    monkeypatch.setattr(disk_module.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match="path must be an existing folder this process can"):
        DiskTier(folder, 2, SHAPE)


def test_a_block_of_another_shape_or_dtype_is_refused(folder):
    with DiskTier(folder, 2, SHAPE, torch.float32, workers=0) as disk:
        slot, _ = disk.put(b"h")
        for bad in (torch.randn(SHAPE).half(), torch.randn(SHAPE[:-1])):
            with pytest.raises(ValueError, match="block must be a CPU tensor"):
                disk.write(slot, bad)
        assert not disk.readable(b"h")
