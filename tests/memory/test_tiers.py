"""Device, host and disk tiers through the manager and the cache, scenario by scenario: where
an evicted block goes, how a hit brings it back, the counters, reads ahead, faults half-way,
bad arguments; then the planted mistakes, each caught by a scenario here or by the three-tier
state machine (``test_tiers_machine``)."""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import pytest
import torch
from hypothesis.stateful import run_state_machine_as_test

import paged_ref.memory.disk_tier as disk_module
import paged_ref.memory.free_queue as queue_module
import paged_ref.memory.host_tier as host_module
import paged_ref.memory.manager as manager_module
import paged_ref.memory.storage as storage_module
import tests.memory.test_sharing_machine as machine_module
from paged_ref import KVCacheManager, OutOfBlocksError, PagedKVCache
from paged_ref.memory.disk_tier import DiskTier
from tests.memory.test_tiers_machine import QUICK, TieredMachine, failing_disk
from tests.mutations.mutate import mutant_of

LAYERS, HEADS, DIM = 2, 1, 4
OPEN: list = []  #: the disk tiers the scenarios made (closed after each test)


@pytest.fixture(autouse=True)
def no_file_left(tmp_path):
    """Every disk tier is closed after its test, and its file is gone."""
    yield
    while OPEN:
        OPEN.pop().close()
    assert list(tmp_path.glob("paged-kv-*")) == [], "a disk tier left its file behind"


@dataclass
class Classes:
    """What a scenario builds (a mutant may stand in for any)."""

    manager: type = KVCacheManager
    cache: type = PagedKVCache
    disk: type = DiskTier


REAL = Classes()


class Run:
    """A manager, its cache and a disk tier, driven as an engine does; remembers the K/V
    written for each full block's hash (fresh random values) to check what comes back."""

    def __init__(self, folder, *, num_blocks, block_size, host, disk, workers=0,
                 classes=REAL):
        self.disk = classes.disk(folder, disk, (2, LAYERS, block_size, HEADS, DIM),
                                 torch.float32, workers=workers)
        self.m = classes.manager(num_blocks, block_size, enable_prefix_caching=True,
                                 num_host_blocks=host, disk_tier=self.disk)
        self.cache = classes.cache(LAYERS, num_blocks, block_size, HEADS, DIM,
                                   dtype=torch.float32, num_host_blocks=host, disk_tier=self.disk)
        self.written: dict[bytes, torch.Tensor] = {}  # block hash -> its K/V [2, L, bs, H, D]
        OPEN.append(self.disk)

    def step(self, faults=contextlib.nullcontext):
        with faults():
            self.cache.apply_block_ops(self.m.take_block_ops())

    def add(self, seq_id, tokens, faults=contextlib.nullcontext) -> int:
        """Admit ``tokens`` (inside ``faults()``), run the moves, write fresh K/V for what
        was not cached; returns the hit."""
        with faults():
            cached = self.m.add_sequence(seq_id, token_ids=tokens)
        self.step()
        table, bs = self.m.block_table(seq_id), self.m.block_size
        for j in range(cached // bs, len(table)):
            self.cache.kv[:, :, table[j]] = torch.randn_like(self.cache.kv[:, :, table[j]])
        for e in self.m.cached_blocks():
            if e.block_id in table[cached // bs:]:
                self.written[e.block_hash] = self.cache.kv[:, :, e.block_id].clone()
        return cached

    def evict(self, faults=contextlib.nullcontext) -> None:
        """Every cached block nobody holds goes down the tiers."""
        n = self.m.num_free_blocks * self.m.block_size
        self.m.add_sequence("hog", n)
        self.step(faults)
        self.m.free_sequence("hog")

    def assert_holds_what_was_written(self, seq_id) -> None:
        """Each cached full block of ``seq_id`` holds the K/V written for its hash."""
        hashes = {e.block_id: e.block_hash for e in self.m.cached_blocks()}
        for b in self.m.block_table(seq_id):
            if b in hashes:
                assert torch.equal(self.cache.kv[:, :, b], self.written[hashes[b]]), (
                    f"block {b} of {seq_id!r} does not hold its K/V")

    def where(self) -> dict[bytes, str]:
        """Each cached hash -> its tier (checking it is in one only)."""
        tiers = {"device": {e.block_hash for e in self.m.cached_blocks()},
                 "host": set(self.m._host.hashes()), "disk": set(self.disk.hashes())}
        out: dict[bytes, str] = {}
        for tier, found in tiers.items():
            for h in found:
                assert h not in out, f"a hash is in two tiers: {out[h]} and {tier}"
                out[h] = tier
        return out


def blocks_of(run: Run, tokens) -> list[bytes]:
    return run.m._prefix.chain(list(tokens))


def fails_at(run: Run, kind: str, block_hash: bytes):
    """A context (factory) inside which the disk ``kind`` ("write" / "read") of
    ``block_hash``'s slot moves half a block, then raises an I/O error."""
    module = sys.modules[type(run.disk).__module__]
    bad = run.disk.slot_of(block_hash) * run.disk.block_bytes
    return lambda: failing_disk(module, kind, lambda offset: offset == bad)


# ---- scenarios (each takes the folder for the file and the classes to build with) ------------


def spills_go_down_and_hits_come_back(folder, classes, workers=0):
    """One eviction of a 2-block prompt with one host slot: its first block (freed last, the
    most recent) stays on the host, the other is pushed straight from the device to the disk;
    the prompt comes back from both, bit for bit, and leaves them."""
    r = Run(folder, num_blocks=3, block_size=2, host=1, disk=4, workers=workers, classes=classes)
    prompt = [5, 1, 4, 1, 5]
    r.add("a", prompt)
    r.m.free_sequence("a")
    r.evict()
    first, second = blocks_of(r, prompt)[:2]
    assert r.where() == {first: "host", second: "disk"}
    st = r.m.stats()
    assert (st.blocks_on_host, st.blocks_on_disk) == (1, 1)
    assert st.disk_bytes_written == r.disk.block_bytes and st.disk_bytes_read == 0
    assert r.add("b", prompt) == 4
    r.assert_holds_what_was_written("b")
    st = r.m.stats()
    assert (st.prefix_host_hit_tokens, st.prefix_disk_hit_tokens) == (2, 2)
    assert (st.blocks_on_host, st.blocks_on_disk, st.prefix_device_hit_tokens) == (0, 0, 0)
    assert st.disk_bytes_read == r.disk.block_bytes
    assert set(r.where().values()) == {"device"}


def a_full_host_moves_its_oldest_block_down(folder, classes):
    """Blocks spilled in separate steps: the host's oldest goes down from its host slot."""
    r = Run(folder, num_blocks=2, block_size=2, host=1, disk=2, classes=classes)
    a, b = [3, 3, 7], [2, 7, 1]
    for seq_id, prompt in (("a", a), ("b", b)):
        r.add(seq_id, prompt)
        r.m.free_sequence(seq_id)
        r.m.add_sequence("hog", 4)
        ops = r.m.take_block_ops()
        r.cache.apply_block_ops(ops)
        r.m.free_sequence("hog")
    assert ops.to_disk == [(0, 0)] and ops.device_to_disk == []
    assert r.where() == {blocks_of(r, a)[0]: "disk", blocks_of(r, b)[0]: "host"}
    for seq_id, prompt in (("a2", a), ("b2", b)):
        assert r.add(seq_id, prompt) == 2
        r.assert_holds_what_was_written(seq_id)
        r.m.free_sequence(seq_id)


def the_disk_drops_its_least_recently_used(folder, classes):
    """One-block prompts evicted one a step through a host slot into 2 disk slots: the disk
    keeps the two most recent; a prefetch makes a block recent, so another goes."""
    r = Run(folder, num_blocks=2, block_size=2, host=1, disk=2, classes=classes)
    prompts = [[9, i, 0] for i in range(5)]
    first = [blocks_of(r, p)[0] for p in prompts]

    def spill(p):
        r.add("p", p)
        r.m.free_sequence("p")
        r.evict()

    for p in prompts[:4]:
        spill(p)
    assert r.disk.hashes() == first[1:3] and r.m._host.hashes() == [first[3]]
    assert r.m.prefetch(prompts[1]) == 0  # workers=0: no read starts, but p1 is now recent
    spill(prompts[4])
    assert r.disk.hashes() == [first[1], first[3]]


def a_prefetch_keeps_its_host_blocks_on_the_host(folder, classes):
    """A prefetch makes the host blocks of a prompt about to be admitted the most recent: the
    next spill pushes another block down to the disk, and the prompt's hit comes from memory."""
    r = Run(folder, num_blocks=2, block_size=2, host=2, disk=2, classes=classes)
    a, b, c = [1, 2, 0], [3, 4, 0], [5, 6, 0]
    for p in (a, b):
        r.add("p", p)
        r.m.free_sequence("p")
        r.evict()
    assert r.m._host.hashes() == [blocks_of(r, a)[0], blocks_of(r, b)[0]]  # oldest first
    assert r.m.prefetch(a) == 0  # on the host: nothing to read, but a is now the most recent
    r.add("p", c)
    r.m.free_sequence("p")
    r.evict()
    assert r.where() == {blocks_of(r, a)[0]: "host", blocks_of(r, b)[0]: "disk",
                         blocks_of(r, c)[0]: "host"}
    before = r.m.stats().disk_bytes_read
    assert r.add("a2", a) == 2 and r.m.stats().disk_bytes_read == before
    r.assert_holds_what_was_written("a2")


def a_prefetch_is_read_once(folder, classes):
    """Reads started ahead on the threads are what the lookup uses: each block read once."""
    r = Run(folder, num_blocks=5, block_size=1, host=1, disk=4, workers=2, classes=classes)
    prompt = [1, 2, 3, 4, 5]
    r.add("a", prompt)
    r.m.free_sequence("a")
    r.evict()
    before = r.m.stats()
    assert before.blocks_on_disk == 4  # blocks 1-4; block 0 on the host
    assert r.m.prefetch(prompt) == 3  # blocks 1-3 (a hit leaves the last token to compute)
    assert r.m.stats() == before  # nothing counted, nothing moved
    assert r.add("b", prompt) == 4
    r.assert_holds_what_was_written("b")
    assert r.m.stats().disk_bytes_read == 3 * r.disk.block_bytes


def a_failed_admission_reads_nothing(folder, classes):
    """A prompt that does not fit is refused before its disk blocks are read."""
    r = Run(folder, num_blocks=3, block_size=1, host=1, disk=3, classes=classes)
    r.add("a", [1, 2, 3])
    r.m.free_sequence("a")
    r.evict()
    r.add("other", [7])
    disk = list(r.disk.hashes())
    with pytest.raises(OutOfBlocksError):
        r.m.add_sequence("b", token_ids=[1, 2, 3, 4])
    assert r.disk.hashes() == disk and r.m.stats().disk_bytes_read == 0


def a_disk_write_failing_half_way_drops_that_block(folder, classes, workers=0):
    """Three blocks go to the disk in one step; one write fails half-way: that block is
    dropped (its slot free), the others are readable, the prompt comes back up to it."""
    r = Run(folder, num_blocks=4, block_size=1, host=1, disk=4, workers=workers, classes=classes)
    prompt = [4, 4, 2, 1]
    r.add("a", prompt)
    r.m.free_sequence("a")
    h = blocks_of(r, prompt)
    r.m.add_sequence("hog", 4)  # block 0 (freed last) stays on the host, 1-3 go down
    r.step(fails_at(r, "write", h[2]))
    r.m.free_sequence("hog")
    assert r.where() == {h[0]: "host", h[1]: "disk", h[3]: "disk"}
    assert r.m.stats().disk_write_errors == 1 and r.disk.num_free_blocks == 2
    assert r.add("b", prompt) == 2
    r.assert_holds_what_was_written("b")


def a_disk_read_failing_half_way_ends_the_hit(folder, classes, workers=0):
    """Of a prompt's hit (one block on the host, three on the disk), the second disk read
    fails half-way: the hit stops before that block, which is dropped; the rest is
    recomputed (and its copies below dropped: cached on the device again)."""
    r = Run(folder, num_blocks=5, block_size=1, host=1, disk=4, workers=workers, classes=classes)
    prompt = [6, 2, 8, 3, 1]
    r.add("a", prompt)
    r.m.free_sequence("a")
    r.evict()
    h = blocks_of(r, prompt)
    assert r.where() == {h[0]: "host", h[1]: "disk", h[2]: "disk", h[3]: "disk", h[4]: "disk"}
    assert r.add("b", prompt, faults=fails_at(r, "read", h[2])) == 2
    r.assert_holds_what_was_written("b")
    assert r.where() == dict.fromkeys(h, "device")
    assert r.m.stats().disk_read_errors == 1 and len(r.disk) + r.disk.num_free_blocks == 4
    r.m.free_sequence("b")
    r.evict()
    assert r.add("c", prompt) == 4
    r.assert_holds_what_was_written("c")


def a_hash_cached_again_leaves_the_tiers_below(folder, classes):
    """A prompt of exactly two blocks comes back: its first block is a hit, its last is
    computed again (a hit always leaves a token to compute) and cached on the device, so its
    copy below -- on the host, or on the disk -- goes, and with it the slot (a host slot
    used to leak here)."""
    for host, disk in ((2, 1), (1, 2)):
        r = Run(folder, num_blocks=2, block_size=2, host=host, disk=disk, classes=classes)
        prompt = [8, 1, 8, 2]
        for round_ in range(3):
            assert r.add("p", prompt) == 2 * bool(round_)
            r.assert_holds_what_was_written("p")
            r.m.free_sequence("p")
            r.evict()
            assert len(r.where()) == 2, f"round {round_}"
            assert len(r.m._host) + r.m._host.num_free_slots == host, "a host slot leaked"
            assert len(r.disk) + r.disk.num_free_blocks == disk, "a disk slot leaked"


SCENARIOS = [spills_go_down_and_hits_come_back, a_full_host_moves_its_oldest_block_down,
             the_disk_drops_its_least_recently_used,
             a_prefetch_keeps_its_host_blocks_on_the_host, a_prefetch_is_read_once,
             a_failed_admission_reads_nothing, a_disk_write_failing_half_way_drops_that_block,
             a_disk_read_failing_half_way_ends_the_hit, a_hash_cached_again_leaves_the_tiers_below]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda f: f.__name__)
def test_scenario(scenario, tmp_path):
    scenario(tmp_path, Classes())


@pytest.mark.parametrize("scenario", [spills_go_down_and_hits_come_back,
                                      a_disk_write_failing_half_way_drops_that_block,
                                      a_disk_read_failing_half_way_ends_the_hit],
                         ids=lambda f: f.__name__)
def test_scenario_with_reads_on_threads(scenario, tmp_path):
    scenario(tmp_path, Classes(), workers=2)


# ---- bad arguments --------------------------------------------------------------------------


def test_the_disk_tier_sits_under_a_host_tier_of_the_same_blocks(tmp_path):
    with DiskTier(tmp_path, 2, (2, 1, 2, 1, 4), torch.float32) as disk:
        with pytest.raises(ValueError, match="disk_tier sits under the host tier"):
            KVCacheManager(4, 2, enable_prefix_caching=True, disk_tier=disk)
        fits = dict(num_layers=1, num_blocks=4, block_size=2, num_kv_heads=1, head_dim=4,
                    dtype=torch.float32, num_host_blocks=1)
        assert PagedKVCache(**fits, disk_tier=disk).disk_tier is disk
        for wrong in (dict(num_host_blocks=0), dict(num_layers=2), dict(block_size=4),
                      dict(num_kv_heads=2), dict(head_dim=8), dict(dtype=torch.float16)):
            with pytest.raises(ValueError, match="disk_tier must hold this cache's host blocks"):
                PagedKVCache(**(fits | wrong), disk_tier=disk)
    with pytest.raises(TypeError, match="disk_tier must be a DiskTier"):
        KVCacheManager(4, 2, enable_prefix_caching=True, num_host_blocks=1, disk_tier="/tmp")


def test_disk_moves_need_a_cache_with_the_disk_tier(tmp_path):
    r = Run(tmp_path, num_blocks=2, block_size=1, host=1, disk=2)
    r.add("a", [1, 2])
    r.m.free_sequence("a")
    r.m.add_sequence("hog", 2)
    ops = r.m.take_block_ops()
    assert ops.device_to_disk
    plain = PagedKVCache(LAYERS, 2, 1, HEADS, DIM, dtype=torch.float32, num_host_blocks=1)
    with pytest.raises(ValueError, match="this cache has none"):
        plain.apply_block_ops(ops)
    r.disk.close()


def test_moves_run_again_after_a_fault_resume_where_it_raised():
    """A step spills device block 0 to host slot 0 and copies host slot 1 back into block 0;
    the copy-on-write after them raises. Run again (the engine does, before it rolls back),
    the moves resume at the copy-on-write: the spill is not run again over block 0's new K/V."""
    from paged_ref.memory.host_tier import BlockOps

    cache = PagedKVCache(LAYERS, 3, 2, HEADS, DIM, dtype=torch.float32, num_host_blocks=2)
    cache.kv.normal_()
    cache.host_kv.normal_()
    spilled, back = cache.kv[:, :, 0].clone(), cache.host_kv[1].clone()
    ops = BlockOps([(0, 0)], [(1, 0)], [(1, 2)])
    real, calls = cache.copy_blocks, []

    def raising_once(pairs):
        calls.append(pairs)
        if len(calls) == 1:
            raise RuntimeError("planted: a failed copy")
        real(pairs)

    cache.copy_blocks = raising_once
    with pytest.raises(RuntimeError, match="planted"):
        cache.apply_block_ops(ops)
    cache.apply_block_ops(ops)
    assert torch.equal(cache.host_kv[0], spilled), "the spill ran again over the copy back"
    assert torch.equal(cache.kv[:, :, 0], back) and torch.equal(cache.kv[:, :, 2],
                                                                 cache.kv[:, :, 1])
    cache.apply_block_ops(ops)  # (a new call on the same ops after a success: all of them)
    assert len(calls) == 3


def test_prefetch_with_a_memo_starts_the_same_reads(tmp_path):
    """``prefetch(tokens, hashes)`` (the scheduler's, with a request's memo) = ``prefetch``."""
    runs = [Run(tmp_path, num_blocks=5, block_size=1, host=1, disk=4, workers=2)
            for _ in range(2)]
    prompt, memo = [1, 2, 3, 4, 5], []
    for r in runs:
        r.add("a", prompt)
        r.m.free_sequence("a")
        r.evict()
    assert runs[0].m.prefetch(prompt) == runs[1].m.prefetch(prompt, memo) == 3
    assert memo == blocks_of(runs[1], prompt)[:4] and runs[1].m.prefetch(prompt, memo) == 0


def test_prefetch_without_a_disk_tier_or_with_bad_tokens():
    m = KVCacheManager(4, 2, enable_prefix_caching=True, num_host_blocks=1)
    assert m.prefetch([1, 2, 3]) == 0 and KVCacheManager(4, 2).prefetch([1, 2, 3]) == 0
    with pytest.raises(TypeError, match="token_ids"):
        m.prefetch("abc")
    with pytest.raises(ValueError, match="token_ids"):
        m.prefetch([1, -2])


def test_without_a_disk_tier_nothing_changes():
    """The host tier alone drops what it pushes off, as before; the new fields stay 0."""
    m = KVCacheManager(2, 1, enable_prefix_caching=True, num_host_blocks=1)
    m.add_sequence("a", token_ids=[1, 2])
    m.take_block_ops()
    m.free_sequence("a")
    m.add_sequence("hog", 2)
    ops = m.take_block_ops()
    assert (ops.to_disk, ops.device_to_disk, ops.from_disk) == ([], [], [])
    assert ops.swap_out == [(0, 0)]  # block 1 (older) was pushed off and dropped
    st = m.stats()
    assert (st.blocks_on_host, st.blocks_on_disk, st.disk_bytes_written) == (1, 0, 0)


# ---- planted mistakes -----------------------------------------------------------------------

#: Likely mistakes: (module, old, new, what the mutant replaces: "host slots" / "disk slots" --
#: the host or the disk tier's SlotLRU --, "disk" -- the DiskTier --, "host tier", "cache").
PLANTED = {
    "a block moved down to the disk stays on the host": (
        queue_module, "dropped, slot = self._slot_of.popitem(last=False)",
        "dropped, slot = next(iter(self._slot_of.items()))", "host slots"),
    "the disk drops its most recent block first": (
        queue_module, "dropped, slot = self._slot_of.popitem(last=False)",
        "dropped, slot = self._slot_of.popitem(last=True)", "disk slots"),
    "a prefetch does not make a block recent": (
        queue_module, "        self._slot_of.move_to_end(block_hash)",
        "        pass", "disk slots"),
    "a prefetch leaves the host blocks it needs to be pushed down": (
        host_module, "                self._slots.touch(block_hash)", "                pass",
        "host tier"),
    "the host copy stays when the device caches the hash again": (
        host_module, "            slot = self._slots.pop(block_hash)\n"
                     "            self._slots.free(slot)\n", "            pass\n", "host tier"),
    "a hit does not leave the disk": (
        disk_module, "        slot = self._slots.pop(block_hash)\n        ahead",
        "        slot = self._slots.slot_of(block_hash)\n        ahead", "disk"),
    "a read comes from the wrong slot": (
        disk_module, "_read_into(self._fd, _bytes_of(block), slot * self.block_bytes)",
        "_read_into(self._fd, _bytes_of(block), (slot + 1) % self.num_blocks * self.block_bytes)",
        "disk"),
    "a failed write keeps its hash": (
        disk_module, "            self.write_errors += 1\n            self._drop_slot(slot)\n",
        "            self.write_errors += 1\n", "disk"),
    "a failed read still counts as a hit": (
        host_module, "        return hit[:bad[0]] if bad else hit", "        return hit",
        "host tier"),
    "a lookup reads the disk before it knows the prompt fits": (
        manager_module, "        shared, fresh = self._check_fit(seq_id, num_tokens, hit)  #",
        "        self._host is not None and self._host.load(hashes, hit)\n"
        "        shared, fresh = self._check_fit(seq_id, num_tokens, hit)  #", "manager"),
    "disk writes run after the spills to the host": (
        storage_module, "moves = [(self._disk_moves, ops), (self.swap_out, ops.swap_out),",
        "moves = [(self.swap_out, ops.swap_out), (self._disk_moves, ops),", "cache"),
    "a block pushed off the host in its own step is written from its host slot": (
        host_module, '("device", owed[0]) if owed else ("host", slot)', '("host", slot)',
        "host tier"),
}


def load_classes(mistake, folder, monkeypatch) -> Classes:
    """Plant ``mistake``; the classes to build with (patched where the library looks)."""
    module, old, new, where = PLANTED[mistake]
    mutant = mutant_of(module, [(old, new)], folder, monkeypatch)
    if where in ("host slots", "disk slots"):
        monkeypatch.setattr(host_module if where == "host slots" else disk_module, "SlotLRU",
                            mutant.SlotLRU)
    elif where == "disk":
        monkeypatch.setattr(host_module, "DiskTier", mutant.DiskTier)  # (its type check)
        return Classes(disk=mutant.DiskTier)
    elif where == "host tier":
        monkeypatch.setattr(manager_module, "HostTier", mutant.HostTier)
    elif where == "manager":
        return Classes(manager=mutant.KVCacheManager)
    elif where == "cache":
        return Classes(cache=mutant.PagedKVCache)
    return Classes()


def scenarios_that_fail(folder, classes) -> list[str]:
    caught = []
    for scenario in SCENARIOS:
        try:
            scenario(folder, classes)
        except Exception:  # (each scenario passes with the real classes)
            caught.append(scenario.__name__)
    return caught


@pytest.mark.parametrize("mistake", PLANTED)
def test_each_planted_mistake_is_caught_by_a_scenario(mistake, tmp_path, monkeypatch):
    (tmp_path / "mutant").mkdir()
    classes = load_classes(mistake, tmp_path / "mutant", monkeypatch)
    assert scenarios_that_fail(tmp_path, classes), f"no scenario caught: {mistake}"


MACHINE_CATCHES = [m for m in PLANTED if m not in (
    "the disk drops its most recent block first",  # (both orders keep the invariants)
    "a prefetch does not make a block recent",
    "a prefetch leaves the host blocks it needs to be pushed down",
    "a lookup reads the disk before it knows the prompt fits",  # (the machine's manager is real)
)]


@pytest.mark.parametrize("mistake", MACHINE_CATCHES)
def test_the_three_tier_machine_catches_it_too(mistake, tmp_path, monkeypatch):
    (tmp_path / "mutant").mkdir()
    classes = load_classes(mistake, tmp_path / "mutant", monkeypatch)
    monkeypatch.setattr(TieredMachine, "folder", tmp_path)
    monkeypatch.setattr(TieredMachine, "disk_class", classes.disk)
    monkeypatch.setattr(machine_module, "PagedKVCache", classes.cache)
    with pytest.raises((AssertionError, KeyError, ValueError)):
        run_state_machine_as_test(TieredMachine, settings=QUICK)
