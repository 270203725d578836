"""The engine over three tiers (``Engine(..., num_host_blocks=, disk_path=, num_disk_blocks=)``)
on a tiny random Llama, CPU: cached prefixes evicted from the device to the host and on to the
disk come back (disk -> host memory -> device) for a later prompt, read ahead of the step that
admits it, and give the greedy tokens of an engine that caches nothing; faults half-way through
a step (a disk read or write, a move back, the prefetch) lose nothing and leave no tier holding
K/V other than its hash's; bad arguments are named; then the likely mistakes are planted back
(``mutant_of``) and these checks must fail."""

from __future__ import annotations

import gc
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

import paged_ref.memory.disk_tier as disk_module  # noqa: E402
import paged_ref.memory.storage as storage_module  # noqa: E402
from paged_ref.engine import Engine, SamplingParams  # noqa: E402
from paged_ref.engine import engine as engine_module  # noqa: E402
from paged_ref.engine import scheduler as scheduler_module  # noqa: E402
from tests.engine.checks import (  # noqa: E402
    assert_cached_kv_is_written,
    assert_idle_and_whole,
    assert_tiers_hold_their_kv,
    hf_greedy,
)
from tests.engine.test_faults import Boom, fail_once  # noqa: E402
from tests.mutations.mutate import mutant_of  # noqa: E402

#: A pool that evicts all the time: 12 blocks of 4 tokens, 2 host blocks, the rest on disk.
TIERS = dict(num_blocks=12, block_size=4, max_num_seqs=3, max_num_batched_tokens=16,
             num_host_blocks=2, num_disk_blocks=24)


def shared_prefixes(seed: int = 0, families: int = 4, rounds: int = 3):
    """``rounds`` prompts of each of ``families`` 12-token prefixes (3 blocks), each with a
    suffix of 1-5 tokens of its own, round by round; 2-6 new tokens each."""
    gen = torch.Generator().manual_seed(seed)
    heads = [torch.randint(3, 256, (12,), generator=gen).tolist() for _ in range(families)]
    prompts = [h + torch.randint(3, 256, (int(torch.randint(1, 6, (1,), generator=gen)),),
                                 generator=gen).tolist() for _ in range(rounds) for h in heads]
    return prompts, torch.randint(2, 7, (len(prompts),), generator=gen).tolist()


@pytest.fixture(scope="module")
def llama(tiny):
    """The ``tiny`` fixture's Llama shape with untied, larger weights (initializer range 0.2,
    not 0.02): its greedy tokens depend on the whole context, so K/V that come back wrong
    change them (``tiny``'s mostly repeat the last token)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**tiny.config.to_dict() | dict(tie_word_embeddings=False,
                                                     initializer_range=0.2))
    torch.manual_seed(1)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = None, 0
    return model


@pytest.fixture(scope="module")
def case(llama):
    """The workload, transformers' greedy tokens for it, and every full sequence."""
    prompts, outputs = shared_prefixes()
    expected = [hf_greedy(llama, p, n) for p, n in zip(prompts, outputs, strict=True)]
    assert len({tuple(e[:2]) for e in expected}) > len(expected) // 2  # (context matters)
    return prompts, outputs, expected, [p + o for p, o in zip(prompts, expected, strict=True)]


@pytest.fixture
def folder(tmp_path):
    """The disk tiers' folder; no file is left in it once their engines are gone."""
    yield tmp_path
    gc.collect()
    assert list(tmp_path.glob("paged-kv-*")) == [], "a disk tier left its file behind"


def engine_on(model, folder, cls=Engine, **kw) -> Engine:
    return cls(model, **(TIERS | kw), disk_path=folder)


# ---- the tokens, and where the blocks went ------------------------------------------------


@pytest.mark.parametrize("kw", [{}, dict(preemption_mode="swap", num_host_blocks=2),
                                dict(max_num_batched_tokens=10), dict(scheduling_policy="prefix")],
                         ids=["recompute", "swap", "chunked", "prefix-policy"])
def test_three_tiers_give_the_tokens_of_no_caching(llama, case, folder, kw):
    prompts, outputs, expected, _ = case
    plain = Engine(llama, num_blocks=64, block_size=4, enable_prefix_caching=False)
    assert plain.generate(prompts, outputs, ignore_eos=True) == expected
    # (longest cached prefix first: the families run together, their hits are on the device)
    engine = engine_on(llama, folder, **kw)
    check_tokens(engine, llama, case, disk_hits="scheduling_policy" not in kw)


def check_tokens(engine, model, case, disk_hits: bool = True) -> None:
    """``engine`` gives ``case``'s greedy tokens, hits the disk (``disk_hits``), and every
    tier holds the K/V of its hashes, twice over."""
    prompts, outputs, expected, sequences = case
    assert engine.generate(prompts, outputs, ignore_eos=True) == expected
    st = engine.scheduler.manager.stats()
    assert st.prefix_hit_tokens > 0 and st.disk_bytes_written > 0, st
    assert not disk_hits or (st.prefix_disk_hit_tokens > 0 and st.disk_bytes_read > 0), st
    assert st.disk_read_errors == st.disk_write_errors == 0
    assert engine.stats.cached_tokens == st.prefix_hit_tokens
    assert_idle_and_whole(engine)
    assert_cached_kv_is_written(engine, model)
    assert assert_tiers_hold_their_kv(engine, model, sequences) > 0
    assert engine.generate(prompts, outputs, ignore_eos=True) == expected  # (a warm cache)


def test_a_prefix_goes_down_to_the_disk_and_comes_back(llama, folder):
    """One prompt's three full blocks: device -> host -> disk as other prompts evict them,
    then a prompt with the same prefix hits all three on the disk; they leave it."""
    engine = engine_on(llama, folder, max_num_seqs=1)
    m, disk, bs = engine.scheduler.manager, engine.disk_tier, engine.block_size
    prefix = list(range(3, 15))
    first = engine.generate([prefix + [20]], 2, ignore_eos=True)
    hashes = m._prefix.chain(prefix)
    fillers = [[100 + 10 * i + j for j in range(9)] for i in range(8)]
    engine.generate(fillers, 2, ignore_eos=True)
    assert all(disk.readable(h) for h in hashes), "the prefix did not reach the disk"
    before = m.stats()
    again = engine.generate([prefix + [20]], 2, ignore_eos=True)
    st = m.stats()
    assert again == first == [hf_greedy(llama, prefix + [20], 2)]
    assert st.prefix_disk_hit_tokens - before.prefix_disk_hit_tokens == len(hashes) * bs
    assert st.disk_bytes_read - before.disk_bytes_read == len(hashes) * disk.block_bytes
    assert not any(h in disk for h in hashes), "a block read back stayed on the disk too"
    assert {e.block_hash for e in m.cached_blocks()} >= set(hashes)


def test_reads_run_ahead_of_the_step_that_admits_them(llama, case, folder):
    """Requests waiting for a seat have their disk blocks read while earlier steps run
    (``KVCacheManager.prefetch`` after each schedule, on the disk tier's threads): the lookup
    that admits them then waits for reads already started."""
    check_reads_ahead(engine_on(llama, folder, max_num_seqs=1), case)


def check_reads_ahead(engine, case) -> None:
    prompts, outputs, expected, _ = case
    disk, started = engine.disk_tier, {"ahead": 0, "at lookup": 0}
    io = sys.modules[type(disk).__module__]  # (where its reads look _read_into up)
    real_prefetch, real_start = disk.prefetch, disk._start_reads
    threads, real_read = set(), io._read_into

    def prefetch(hashes):
        disk.in_prefetch = True
        try:
            return real_prefetch(hashes)
        finally:
            disk.in_prefetch = False

    def start_reads(hashes):
        n = real_start(hashes)
        started["ahead" if getattr(disk, "in_prefetch", False) else "at lookup"] += n
        return n

    def read(fd, buf, offset):
        threads.add(threading.current_thread().name)
        return real_read(fd, buf, offset)

    disk.prefetch, disk._start_reads = prefetch, start_reads
    engine.generate(prompts[:4], outputs[:4], ignore_eos=True)  # (the prefixes, then evicted)
    io._read_into = read
    try:
        assert engine.generate(prompts, outputs, ignore_eos=True) == expected
    finally:
        io._read_into = real_read
    assert started["ahead"] > 0 and started["ahead"] >= 2 * started["at lookup"], started
    assert threads and all(t.startswith("disk-tier") for t in threads), threads


def test_online_requests_over_three_tiers(llama, case, folder):
    prompts, outputs, expected, _ = case
    engine, done = engine_on(llama, folder), {}
    ids = []
    for i, (p, n) in enumerate(zip(prompts, outputs, strict=True)):
        ids.append(engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True)))
        if i % 3 == 2:
            for o in engine.step():
                done[o.request_id] = o.output_token_ids
    while engine.has_unfinished_requests():
        for o in engine.step():
            done[o.request_id] = o.output_token_ids
    assert [done[r] for r in ids] == expected
    assert engine.scheduler.manager.stats().prefix_disk_hit_tokens > 0


# ---- arguments --------------------------------------------------------------------------

REFUSED = [
    (dict(num_disk_blocks=8), ValueError, "num_disk_blocks needs disk_path"),
    (dict(disk_path="FOLDER"), ValueError, "num_disk_blocks must be >= 1"),
    (dict(disk_path="FOLDER", num_disk_blocks=2.5), TypeError, "num_disk_blocks must be an int"),
    (dict(disk_path="FOLDER", num_disk_blocks=-1), ValueError, "num_disk_blocks must be >= 1"),
    (dict(disk_path="FOLDER", num_disk_blocks=8), ValueError,
     "disk_path: the disk tier needs a host tier above it: num_host_blocks > 0"),
    (dict(disk_path="FOLDER", num_disk_blocks=8, num_host_blocks=0, preemption_mode="swap"),
     ValueError, "num_host_blocks=0 leaves preemption_mode='swap' no host tier"),
    (dict(disk_path="FOLDER", num_disk_blocks=8, num_host_blocks=4,
          enable_prefix_caching=False), ValueError, "disk_path: .*enable_prefix_caching=True"),
    (dict(disk_path="FOLDER", num_disk_blocks=8, num_host_blocks=4, kv_format="fp8"),
     ValueError, "disk_path: the disk tier needs a plain cache, not kv_format='fp8'"),
    (dict(disk_path="FOLDER/missing", num_disk_blocks=8, num_host_blocks=4), ValueError,
     "disk_path: path must be an existing folder"),
    (dict(disk_path=8, num_disk_blocks=8, num_host_blocks=4), TypeError,
     "disk_path must be a folder"),
    (dict(num_host_blocks=-2), ValueError, "num_host_blocks must be >= 0"),
    (dict(num_host_blocks="4"), TypeError, "num_host_blocks must be an int"),
    (dict(num_host_blocks=4, enable_prefix_caching=False), ValueError,
     "num_host_blocks > 0 needs enable_prefix_caching=True"),
    (dict(num_host_blocks=4, kv_format="fp8"), ValueError, "num_host_blocks: the host tier"),
    (dict(disk_path="FOLDER", num_disk_blocks=8, num_host_blocks=4, max_num_seqs=0),
     ValueError, "max_num_seqs"),  # (a later check: the file made is removed all the same)
]


@pytest.mark.parametrize("kw,error,match", REFUSED, ids=[m[:40] for _, _, m in REFUSED])
def test_bad_tier_arguments_are_named(llama, folder, kw, error, match):
    kw = {k: str(v).replace("FOLDER", str(folder)) if k == "disk_path" and isinstance(v, str)
          else v for k, v in kw.items()}
    with pytest.raises(error, match=match):
        Engine(llama, num_blocks=8, block_size=4, **kw)


def test_host_tier_alone_and_its_default(llama, case, folder):
    prompts, outputs, expected, _ = case
    assert Engine(llama, num_blocks=8).scheduler.num_host_blocks == 0
    assert Engine(llama, num_blocks=8, preemption_mode="swap").scheduler.num_host_blocks == 8
    engine = Engine(llama, **(TIERS | dict(num_disk_blocks=0)))  # a host tier, no disk
    assert engine.disk_tier is None and engine.runner.cache.host_kv.shape[0] == 2
    assert engine.generate(prompts, outputs, ignore_eos=True) == expected
    st = engine.scheduler.manager.stats()
    assert st.prefix_host_hit_tokens > 0 and st.prefix_disk_hit_tokens == 0


def test_the_disk_tiers_file_goes_with_its_engine(llama, folder):
    engine = engine_on(llama, folder)
    assert list(folder.glob("paged-kv-*")) == [Path(engine.disk_tier.path)]
    del engine  # (the folder fixture checks that the file went with it)


# ---- faults -------------------------------------------------------------------------------


#: Where a fault is planted: ``point(engine) -> (object, attribute)``.
POINTS = {
    "disk read": lambda e: (sys.modules[type(e.disk_tier).__module__], "_read_into"),
    "disk write": lambda e: (sys.modules[type(e.disk_tier).__module__], "_write_at"),
    "lookup's disk reads": lambda e: (e.disk_tier, "load"),
    "prefetch": lambda e: (e.scheduler.manager, "prefetch"),
    "spill to the host": lambda e: (e.runner.cache, "swap_out"),
    "copy back from the disk": lambda e: (e.runner.cache, "swap_in_blocks"),
    "copy back from the host": lambda e: (e.runner.cache, "swap_in"),
    "copy-on-write (last move)": lambda e: (e.runner.cache, "copy_blocks"),
    "layer 0 MLP": lambda e: (e.model.model.layers[0].mlp.down_proj, "forward"),
    "update": lambda e: (e.scheduler, "update"),
}
#: (point, call) pairs: early and late calls; a copy back into a block spilled in its own step
#: (steps 7 and 17 of this workload: the moves after it fail, the spill must not run again).
FAULTS = [(p, at) for p in POINTS for at in (1, 3, 8)] + [
    ("copy-on-write (last move)", 18), ("copy back from the host", 18)]


def survives(engine, model, case, fire) -> None:
    """``fire(engine)`` raises; then nothing is left inside, every cached block on the device
    and in the tiers holds its hash's K/V, and the next run gives the expected tokens."""
    prompts, outputs, expected, sequences = case
    with pytest.raises((Boom, KeyboardInterrupt)):
        fire(engine)
    assert_idle_and_whole(engine)
    assert_cached_kv_is_written(engine, model)
    assert_tiers_hold_their_kv(engine, model, sequences)
    assert engine.generate(prompts, outputs, ignore_eos=True) == expected
    assert_tiers_hold_their_kv(engine, model, sequences)
    assert_idle_and_whole(engine)


def fault_run(engine, model, case, mp, point: str, at: int, exc=Boom) -> None:
    """``case``'s ``generate`` with a fault at ``point``'s ``at``-th call; then ``survives``."""
    prompts, outputs, _, _ = case
    survives(engine, model, case, lambda e: fail_once(
        mp, POINTS[point](e), at, exc, lambda: e.generate(prompts, outputs, ignore_eos=True)))


@pytest.mark.parametrize("point,at", FAULTS, ids=[f"{p}-{a}" for p, a in FAULTS])
def test_a_fault_in_a_step_loses_nothing(llama, case, folder, monkeypatch, point, at):
    fault_run(engine_on(llama, folder), llama, case, monkeypatch, point, at)


@pytest.mark.parametrize("point", ["disk write", "copy back from the disk", "prefetch"])
def test_ctrl_c_in_a_step_loses_nothing(llama, case, folder, monkeypatch, point):
    fault_run(engine_on(llama, folder), llama, case, monkeypatch, point, 3, KeyboardInterrupt)


@pytest.mark.parametrize("name", ["_read_into", "_write_at"])
def test_disk_io_errors_cost_recomputation_only(llama, case, folder, monkeypatch, name):
    """An ``OSError`` (a bad sector, a full disk) drops the block: the tokens stay the same,
    the tier counts the error, nothing points at bytes never written."""
    prompts, outputs, expected, sequences = case
    engine = engine_on(llama, folder)
    real, calls = getattr(disk_module, name), [0]

    def failing(*args):
        calls[0] += 1
        if calls[0] % 3 == 0:
            raise OSError(5, "planted I/O error")
        return real(*args)

    monkeypatch.setattr(disk_module, name, failing)
    assert engine.generate(prompts, outputs, ignore_eos=True) == expected
    st = engine.scheduler.manager.stats()
    assert (st.disk_read_errors if name == "_read_into" else st.disk_write_errors) > 0, st
    monkeypatch.undo()
    assert_idle_and_whole(engine)
    assert_tiers_hold_their_kv(engine, llama, sequences)


# ---- the likely mistakes planted back: the checks above must fail ---------------------------

#: (module, [(old, new)], how the engine picks the mutant up, the check that must fail).
PLANTED = {
    "a disk read comes from the wrong slot": (
        disk_module, [("_read_into(self._fd, _bytes_of(block), slot * self.block_bytes)",
                       "_read_into(self._fd, _bytes_of(block), (slot + 1) % self.num_blocks"
                       " * self.block_bytes)")], "disk", "tokens"),
    "a block read from the disk is not copied back to the device": (
        storage_module, [("(self.swap_in_blocks, ops.from_disk), ", "")], "cache", "tokens"),
    "the runner's cache has no disk tier (the moves have nowhere to go)": (
        engine_module, [("                                  disk_tier=self.disk_tier,\n", "")],
        "engine", "tokens"),
    "a read that raised stays in flight (the next lookup raises it again)": (
        disk_module, [("if self._ahead.get(slot) is ahead and ahead.done()", "if False")],
        "disk", "fault: disk read-3"),
    "a failed step's moves run again from the start (a spill re-copies a reused block)": (
        storage_module, [("done = self._resume[1] if self._resume[0] is ops else 0",
                          "done = 0")], "cache", "fault: copy-on-write (last move)-18"),
    "nothing is read ahead (no prefetch after the schedule)": (
        scheduler_module, [("self.manager.prefetch(req.tokens, req.block_hashes)", "pass")],
        "scheduler", "ahead"),
}


def engine_class(mutant, how, monkeypatch):
    """The engine class that runs ``mutant`` where the library looks ``module`` up."""
    if how == "disk":
        import paged_ref.memory.host_tier as host_module
        import paged_ref.memory.tiers as tiers_module

        monkeypatch.setattr(tiers_module, "DiskTier", mutant.DiskTier)
        monkeypatch.setattr(host_module, "DiskTier", mutant.DiskTier)  # (its type check)
    elif how == "cache":
        import paged_ref.engine.runner as runner_module

        monkeypatch.setattr(runner_module, "PagedKVCache", mutant.PagedKVCache)
    elif how == "scheduler":
        monkeypatch.setattr(engine_module, "Scheduler", mutant.Scheduler)
    return mutant.Engine if how == "engine" else Engine


@pytest.mark.parametrize("name", PLANTED)
def test_planted_mistake_is_caught(llama, case, folder, monkeypatch, tmp_path_factory, name):
    module, edits, how, check = PLANTED[name]
    mutant = mutant_of(module, edits, tmp_path_factory.mktemp("mutant"), monkeypatch)
    cls = engine_class(mutant, how, monkeypatch)
    with pytest.raises((AssertionError, ValueError, Boom)) as caught:
        if check == "tokens":
            check_tokens(engine_on(llama, folder, cls), llama, case)
        elif check == "ahead":
            check_reads_ahead(engine_on(llama, folder, cls, max_num_seqs=1), case)
        else:
            point, at = check.split(": ", 1)[1].rsplit("-", 1)
            fault_run(engine_on(llama, folder, cls), llama, case, monkeypatch, point, int(at))
    print(f"caught: {caught.value!r}"[:300])
