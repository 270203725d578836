"""The sharing state machine over three tiers: device, host, and a disk tier under the host.

:class:`TieredMachine` is ``test_sharing_machine.SharingMachine`` (every rule and invariant) with
small host and disk tiers, so that evictions push blocks down to the file and prompts find them
there, plus two rules: a prefetch of a seen prompt, and a disk that fails half-way through a
call (an ``OSError`` after half a block is written or read). Its invariants then say, after
every step: every cached hash is in exactly one tier, over the K/V bytes written for exactly
the prefix it names (nothing lost, no hash over unwritten or half-written K/V); no slot of a
tier leaks; an eviction keeps every evicted block below while the tiers have room, and loses
exactly the blocks whose write failed. Every disk file lives under ``tmp_path`` and is removed.

``test_tiers`` plants the likely mistakes in this code and runs this machine on them.
"""

from __future__ import annotations

import contextlib
import errno
import sys
import threading

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, precondition, rule, run_state_machine_as_test

import paged_ref.memory.disk_tier as disk_module
from tests.memory.test_sharing_machine import TOKENS, SharingMachine


@contextlib.contextmanager
def failing_disk(module, kind: str, fails):
    """Inside: each disk ``kind`` ("write" / "read") of ``module`` (a disk tier module: the
    real one or a mutant) at a byte offset where ``fails(offset)`` is true moves half a block,
    then raises ``OSError`` (EIO). Reads on the tier's threads too."""
    name = "_write_at" if kind == "write" else "_read_into"
    real = getattr(module, name)

    def half_then_fail(fd, buf, offset):
        if not fails(offset):
            return real(fd, buf, offset)
        real(fd, buf[: len(buf) // 2], offset)
        raise OSError(errno.EIO, f"planted {kind} failure")

    setattr(module, name, half_then_fail)
    try:
        yield
    finally:
        setattr(module, name, real)


def after(good: int):
    """``fails`` for :func:`failing_disk`: every call after the first ``good``."""
    lock, calls = threading.Lock(), [0]

    def fails(offset: int) -> bool:
        with lock:
            calls[0] += 1
            return calls[0] > good
    return fails


class TieredMachine(SharingMachine):
    folder = None  #: where the disk files go (the test's tmp_path)
    disk_class = disk_module.DiskTier

    @initialize(num_blocks=st.integers(3, 8), block_size=st.integers(1, 2),
                host=st.integers(1, 2), disk=st.integers(1, 6), workers=st.sampled_from([0, 2]))
    def create(self, num_blocks, block_size, host, disk, workers):
        tier = self.disk_class(self.folder, disk, (2, 1, block_size, 1, 2), torch.float32,
                               workers=workers)
        self._build(num_blocks, block_size, True, host, tier)

    def teardown(self):
        if getattr(self, "disk", None) is not None:
            self.disk.close()

    def _faults(self, kind: str, good: int):
        module = sys.modules[type(self.disk).__module__]
        return lambda: failing_disk(module, kind, after(good))

    @precondition(lambda self: self.seen)
    @rule(data=st.data())
    def prefetch_a_seen_prompt(self, data):
        """Read a prompt's disk blocks ahead: nothing is counted, nothing moves between tiers."""
        prompt = data.draw(st.sampled_from(self.seen)) + [data.draw(TOKENS)]
        before, on_disk = self.m.stats(), set(self.disk.hashes())
        assert self.m.prefetch(prompt) <= len(on_disk)
        assert self.m.stats() == before and set(self.disk.hashes()) == on_disk

    @rule(data=st.data(), extra=st.lists(TOKENS, max_size=3))
    def a_cold_chat_comes_back(self, data, extra):
        """A chat's turn runs, the engine goes idle (every request finishes), its cached
        blocks are evicted down the tiers, and the chat's next turn comes back: a hit from the
        host and the disk. (With no new token, its last full block is computed again and
        cached on the device: its copy below must go.)"""
        self._cold_return(data, extra)

    @rule(data=st.data(), extra=st.lists(TOKENS, max_size=3), good=st.integers(0, 2))
    def disk_write_fails_half_way(self, data, extra, good):
        """As :meth:`a_cold_chat_comes_back`, but the eviction's disk writes fail after
        ``good`` blocks: the blocks half written are dropped, and only they are lost."""
        self._cold_return(data, extra, writes=self._faults("write", good))

    @rule(data=st.data(), extra=st.lists(TOKENS, max_size=3), good=st.integers(0, 2))
    def disk_read_fails_half_way(self, data, extra, good):
        """As :meth:`a_cold_chat_comes_back`, but the disk reads fail after ``good`` blocks:
        the hit stops before the first block that could not be read, which is dropped."""
        self._cold_return(data, extra, reads=self._faults("read", good))

    def _cold_return(self, data, extra, *, writes=contextlib.nullcontext,
                     reads=contextlib.nullcontext):
        """Every request finishes; a chat (a new prompt, or one that starts like an earlier
        one) runs and finishes; the pool is evicted (its moves run inside ``writes()``); the
        chat comes back (admitted inside ``reads()``)."""
        for seq_id in data.draw(st.permutations(sorted(self.tokens))):
            self.m.free_sequence(seq_id)
            del self.tokens[seq_id]
        room = self.m.num_blocks * self.m.block_size
        chat = data.draw(st.lists(TOKENS, min_size=2, max_size=room - 1))
        if self.seen and data.draw(st.booleans()):
            chat = (data.draw(st.sampled_from(self.seen)) + chat)[: room - 1]
        chat_id = self.next_id
        self._add(chat, by_tokens=True)
        if chat_id in self.tokens:
            self.m.free_sequence(chat_id)
            del self.tokens[chat_id]
        errors = self.disk.write_errors
        held, kept = self._evict(writes)
        assert held == kept - (self.disk.write_errors - errors), (
            "an eviction lost blocks other than those whose disk write failed")
        self._add(chat + extra, by_tokens=True, faults=reads)


QUICK = settings(max_examples=40, stateful_step_count=25, deadline=None, database=None,
                 derandomize=True, phases=[Phase.generate], report_multiple_bugs=False)


@pytest.fixture
def machine(tmp_path, monkeypatch):
    """TieredMachine writing its files under ``tmp_path``; checks none is left behind."""
    monkeypatch.setattr(TieredMachine, "folder", tmp_path)
    yield TieredMachine
    assert list(tmp_path.glob("paged-kv-*")) == [], "a disk tier left its file behind"


def test_three_tiers_lose_nothing(machine):
    run_state_machine_as_test(machine, settings=settings(
        max_examples=40, stateful_step_count=25, deadline=None, database=None))
