"""Fault injection for ``paged_ref.transfer``: two gloo ranks, one killed at every phase of the
protocol (``KILLS``: every phase a rank posts a message in, each call and mode; a refuser killed
while it refuses, ``REFUSERS``), or refusing, or failing half-way; what the survivor must show.

Every K/V block in these pools is derived from what it holds (:func:`kv_of`: a full prompt block
from its prefix-cache hash), so any rank can check any cached block on its own. Checked on the
survivor after every fault:

* the named error, raised promptly: a ``TransferError`` (dead or silent peer, a peer that gave
  up half-way), or the refusal's ``ValueError`` / ``OutOfBlocksError``, in well under the calls'
  ``timeout`` (:data:`TIMEOUT`) -- or, for a silent peer, after the timeout and not much later;
* its manager exactly as before the call (tables, reference counts, hashes, free and evictable
  blocks): no sequence half-landed, nothing registered;
* the pool's invariants (:func:`pool_problems`) and no prefix-cache hash over a block whose K/V
  are not what the hash names (:func:`stale_blocks`).

Each planted bug (``PLANTED``: issue 36's scenarios 1, 2, 3 and 9 put back) is caught.
"""

from __future__ import annotations

import sys
import time

import pytest
import torch

import paged_ref.transfer.handshake as handshake
import paged_ref.transfer.prefix as prefix_module
import paged_ref.transfer.sequence as sequence_module
import paged_ref.transfer.stream as stream
from paged_ref import KVCacheManager, PagedKVCache, transfer
from paged_ref.memory.prefix_cache import hash_block_tokens
from tests.mutations.mutate import mutant_of
from tests.transfer.forked_pair import die_at, run_pair

LAYERS, BLOCKS, BS, HEADS, DIM = 4, 24, 4, 2, 8
TIMEOUT = 8.0  #: the calls' timeout here; a dead peer or a refusal must be seen well before it
PROMPTLY = 2.0  #: seconds within which a dead peer or a refusal must raise
_gen = torch.Generator().manual_seed(36)
PROMPT = torch.randint(0, 1000, (41,), generator=_gen).tolist()  # 10 full blocks travel
OTHER = PROMPT[:8] + torch.randint(0, 1000, (5,), generator=_gen).tolist()
SEQ_TOKENS = 37  # send_sequence's sequence: 10 blocks


# ---- the world: pools whose every block says what it holds ---------------------------------


def kv_of(key: bytes) -> torch.Tensor:
    """The K/V of the block named ``key``: ``[2, LAYERS, BS, HEADS, DIM]`` float32."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little") % 2**62)
    return torch.randn(2, LAYERS, BS, HEADS, DIM, generator=gen)


def pool(*, num_blocks=BLOCKS, caching=True, dtype=torch.float32, head_dim=DIM, seed=0):
    """A cache full of junk (never zeros: an unwritten block must not look written) and its
    manager."""
    cache = PagedKVCache(LAYERS, num_blocks, BS, HEADS, head_dim, dtype=dtype)
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return cache, KVCacheManager(num_blocks, BS, enable_prefix_caching=caching)


def block_key(tokens: list[int], j: int, name: str) -> bytes:
    """Block ``j`` of a prompt: its hash if full, else a name of its own."""
    parent = None
    for i in range(j + 1):
        if (i + 1) * BS > len(tokens):
            return f"{name}:{j}".encode()
        parent = hash_block_tokens(parent, tokens[i * BS:(i + 1) * BS])
    return parent


def compute(cache, m, seq, tokens):
    """Admit ``tokens`` as ``seq`` and write every block's K/V (a prefill)."""
    m.add_sequence(seq, token_ids=tokens)
    for j, block in enumerate(m.block_table(seq)):
        cache.kv[:, :, block] = kv_of(block_key(tokens, j, str(seq))).to(cache.dtype)


def sequence_blocks_ok(cache, m, seq) -> bool:
    return all(torch.equal(cache.kv[:, :, b], kv_of(f"req:{j}".encode()))
               for j, b in enumerate(m.block_table(seq)))


def stale_blocks(cache, m) -> list[int]:
    """Cached blocks whose K/V are not what their hash names."""
    return [e.block_id for e in m.cached_blocks()
            if not torch.equal(cache.kv[:, :, e.block_id], kv_of(e.block_hash).to(cache.dtype))]


def pool_problems(m) -> list[str]:
    """free + held + evictable == num_blocks, reference counts == table references, nothing
    held is free or evictable."""
    a, problems, refs = m.allocator, [], {}
    for s in m.seq_ids:
        for b in m.block_table(s):
            refs[b] = refs.get(b, 0) + 1
    for b in range(a.num_blocks):
        if m.ref_count(b) != refs.get(b, 0):
            problems.append(f"block {b}: ref_count {m.ref_count(b)}, {refs.get(b, 0)} tables")
        if b in refs and (a.is_free(b) or a.is_evictable(b)):
            problems.append(f"held block {b} is free or evictable")
    if m.num_free_blocks + len(set(refs) | set(m._pinned)) != a.num_blocks:
        problems.append("free + held != num_blocks")
    return problems


def state(m):
    """What a failed call must leave as it was."""
    a = m.allocator
    return ({s: (m.block_table(s), m.seq_len(s)) for s in m.seq_ids},
            [(a.ref_count(b), a.block_hash(b), a.is_evictable(b)) for b in range(a.num_blocks)],
            m.num_free_blocks, list(m._pinned))


def attempt(fn, cache, m) -> dict:
    """Run one transfer call; what it raised, how fast, and the manager's state after it."""
    before = state(m)
    start = time.perf_counter()
    try:
        fn()
        error = None
    except Exception as e:  # noqa: BLE001 -- the test asserts on it
        error = e
    return {"error": type(error).__name__ if error else None, "message": str(error or ""),
            "seconds": time.perf_counter() - start, "same": state(m) == before,
            "problems": pool_problems(m), "stale": stale_blocks(cache, m), "held": m.seq_ids}


# ---- one transfer, a rank killed at a phase ---------------------------------------------------


def sender_world(call):
    cache, m = pool(seed=1)
    if call == "sequence":
        m.add_sequence("req", SEQ_TOKENS)
        for j, b in enumerate(m.block_table("req")):
            cache.kv[:, :, b] = kv_of(f"req:{j}".encode())
    else:
        compute(cache, m, "p", PROMPT)
        m.free_sequence("p")
    return cache, m


def receiver_world():
    cache, m = pool(seed=2)
    m.add_sequence("running", 9)  # another request holds blocks here
    compute(cache, m, "local", OTHER)  # OTHER shares PROMPT's first 2 blocks: 8 tokens cached
    m.free_sequence("local")
    return cache, m


def one_transfer(rank, *, call, mode, kill=None, timeouts=(TIMEOUT, TIMEOUT)):
    """Rank 0 sends (``send_sequence`` of 10 blocks, or ``send_prefix`` of PROMPT, of which the
    receiver has 2 blocks cached), rank 1 receives; ``kill = (rank, phase, nth, sleep)``;
    ``timeouts``: each rank's."""
    if kill is not None and kill[0] == rank:
        die_at(*kill[1:])
    timeout = timeouts[rank]
    if rank == 0:
        cache, m = sender_world(call)
        if call == "sequence":
            chunk = 2 * 10 * BS * cache.bytes_per_token // LAYERS  # 2 layers: 3 messages
            return attempt(lambda: transfer.send_sequence(
                cache, m, "req", dst=1, mode=mode, chunk_bytes=chunk, timeout=timeout), cache, m)
        return attempt(lambda: transfer.send_prefix(cache, m, PROMPT, dst=1, mode=mode,
                                                    timeout=timeout), cache, m)
    cache, m = receiver_world()
    if call == "sequence":
        out = attempt(lambda: transfer.recv_sequence(cache, m, "req", src=0, timeout=timeout),
                      cache, m)
        out["landed"] = "req" in m and sequence_blocks_ok(cache, m, "req")
        return out
    out = attempt(lambda: transfer.recv_prefix(cache, m, src=0, timeout=timeout), cache, m)
    out["landed"] = m.add_sequence("check", token_ids=PROMPT) == 40
    return out


def assert_undone(side: dict) -> None:
    """The survivor raised a TransferError promptly and holds what it held before."""
    assert side is not None and "crashed" not in side, side
    assert side["error"] == "TransferError", side
    assert side["seconds"] < PROMPTLY, f"took {side['seconds']:.1f} s"
    assert side["same"] and not side["problems"] and not side["stale"], side


KILLS = [  # (the rank that dies, call, mode, the phase it dies at, at its nth message)
    (0, "sequence", "packed", "sending the header", 1),
    (0, "sequence", "packed", "waiting for the answer", 1),  # after the header
    (0, "sequence", "packed", "sending the payload", 1),  # after the answer
    (0, "sequence", "packed", "sending the payload", 2),
    (0, "sequence", "per_layer", "sending the payload", 3),
    (0, "sequence", "per_block", "sending the payload", 7),
    (0, "sequence", "packed", "sending the trailer", 1),
    (0, "prefix", "packed", "sending the header", 1),
    (0, "prefix", "packed", "sending the prompt's token ids", 1),  # after the header
    (0, "prefix", "packed", "waiting for the answer", 1),
    (0, "prefix", "packed", "sending the payload", 1),
    (0, "prefix", "per_layer", "sending the payload", 2),
    (0, "prefix", "per_block", "sending the payload", 9),
    (0, "prefix", "per_block", "sending the trailer", 1),
    (1, "sequence", "packed", "waiting for the header", 1),  # before it heard anything
    (1, "prefix", "packed", "waiting for the header", 1),
    (1, "prefix", "packed", "receiving the prompt's token ids", 1),
    (1, "sequence", "packed", "answering", 1),  # it took the blocks, then died
    (1, "sequence", "packed", "receiving the payload", 2),
    (1, "sequence", "per_layer", "receiving the payload", 2),
    (1, "sequence", "per_block", "receiving the payload", 5),
    (1, "sequence", "packed", "sending the receipt", 1),  # after landing
    (1, "prefix", "packed", "answering", 1),
    (1, "prefix", "per_layer", "receiving the payload", 3),
    (1, "prefix", "per_block", "receiving the payload", 4),
    (1, "prefix", "packed", "sending the receipt", 1),
    (1, "sequence", "per_layer", "waiting for the trailer", 1),  # the payload in, then died
    (1, "prefix", "packed", "waiting for the trailer", 1),
]


@pytest.mark.parametrize("dies, call, mode, phase, nth", KILLS,
                         ids=["-".join(map(str, kill)) for kill in KILLS])
def test_a_peer_dies(dies, call, mode, phase, nth):
    """The survivor raises a TransferError at once and holds what it held before: a receiver
    frees what it took, hashes and all; a sender's manager is only read (send_prefix
    registers nothing)."""
    res = run_pair(one_transfer, call=call, mode=mode, kill=(dies, phase, nth))
    assert res[dies] is None, f"rank {dies} was to die"
    assert_undone(res[1 - dies])
    if dies == 0:
        assert not res[1]["landed"]


@pytest.mark.parametrize("call", ["sequence", "prefix"])
def test_sender_dies_after_the_trailer(call):
    """The payload and its trailer arrived: the receiver either keeps it (the receipt went
    out before the connection closed) or undoes it; never anything in between."""
    res = run_pair(one_transfer, call=call, mode="packed", kill=(0, "waiting for the receipt", 1))
    side = res[1]
    assert not side["problems"] and not side["stale"], side
    if side["error"] is None:
        assert side["landed"]
    else:
        assert_undone(side)


@pytest.mark.parametrize("silent, phase", [(0, "sending the payload"), (1, "answering")],
                         ids=["silent sender", "silent receiver"])
def test_a_silent_peer_is_a_transfer_error_after_the_timeout(silent, phase):
    timeouts = (TIMEOUT, 1.0) if silent == 0 else (1.0, TIMEOUT)  # the survivor's is short
    res = run_pair(one_transfer, call="prefix", mode="packed", timeouts=timeouts,
                   kill=(silent, phase, 1, 2.5))
    side = res[1 - silent]
    assert side["error"] == "TransferError" and "did not answer within 1 s" in side["message"]
    assert 0.9 < side["seconds"] < 2.0, side["seconds"]
    assert side["same"] and not side["problems"] and not side["stale"], side


def test_the_happy_path_of_this_harness_lands_everything():
    for call in ("sequence", "prefix"):
        res = run_pair(one_transfer, call=call, mode="per_layer")
        assert res[0]["error"] is None and res[1]["error"] is None, res
        assert res[1]["landed"] and not res[1]["stale"] and not res[1]["problems"]


# ---- refusals and failures half-way: both ranks live, and stay in step ------------------------


def _fail_on_call(module, name, nth):
    """Make ``module.name`` raise on its ``nth`` call from now on (a gather or a scatter that
    fails half-way). Returns the undo."""
    real, calls = getattr(module, name), [0]

    def broken(*args, **kwargs):
        calls[0] += 1
        if calls[0] == nth:
            raise RuntimeError("planted failure half-way")
        return real(*args, **kwargs)

    setattr(module, name, broken)
    return lambda: setattr(module, name, real)


def _refusal_cases():
    """(name, sender action, receiver action, what each side must raise). Each action takes
    nothing and returns the :func:`attempt` record; worlds are built fresh per case."""
    def send_seq(mode="packed", seq="req", fail=None):
        cache, m = sender_world("sequence")
        undo = _fail_on_call(stream, "_pool_rows", fail) if fail else None
        try:
            return attempt(lambda: transfer.send_sequence(cache, m, seq, dst=1, mode=mode,
                                                          timeout=TIMEOUT), cache, m)
        finally:
            undo and undo()

    def send_pre(prompt=PROMPT):
        cache, m = sender_world("prefix")
        return attempt(lambda: transfer.send_prefix(cache, m, prompt, dst=1, timeout=TIMEOUT),
                       cache, m)

    def recv_seq(hold=False, fail=None, **pool_kw):
        cache, m = pool(seed=3, **pool_kw)
        if hold:
            m.add_sequence("req", 3)
        undo = _fail_on_call(stream, "_pool_rows", fail) if fail else None
        try:
            out = attempt(lambda: transfer.recv_sequence(cache, m, "req", src=0,
                                                         timeout=TIMEOUT), cache, m)
        finally:
            undo and undo()
        out["landed"] = "req" in m and sequence_blocks_ok(cache, m, "req")
        return out

    def recv_pre(**pool_kw):
        cache, m = pool(seed=4, **pool_kw)
        return attempt(lambda: transfer.recv_prefix(cache, m, src=0, timeout=TIMEOUT), cache, m)

    unknown_prompt = [7] * 41
    return [
        ("seq_id held", send_seq, lambda: recv_seq(hold=True),
         ("ValueError", "holds that seq_id already"), ("ValueError", "already exists")),
        ("no prefix caching", send_pre, lambda: recv_pre(caching=False),
         ("ValueError", "prefix caching off"), ("ValueError", "enable_prefix_caching")),
        ("other head_dim", send_seq, lambda: recv_seq(head_dim=16),
         ("ValueError", "shape differs"), ("ValueError", "differs from this pool's")),
        ("other dtype", send_pre, lambda: recv_pre(dtype=torch.float16),
         ("ValueError", "shape differs"), ("ValueError", "differs from this pool's")),
        ("no room", send_seq, lambda: recv_seq(num_blocks=6),
         ("ValueError", "no free blocks"), ("OutOfBlocksError", "")),
        ("no room for a prefix", send_pre, lambda: recv_pre(num_blocks=6),
         ("ValueError", "no free blocks"), ("OutOfBlocksError", "")),
        ("prompt not computed", lambda: send_pre(unknown_prompt), recv_pre,
         ("ValueError", "compute the prompt first"), ("ValueError", "refused to send")),
        ("unknown seq_id", lambda: send_seq(seq="ghost"), recv_seq,
         ("ValueError", "unknown sequence"), ("ValueError", "refused to send")),
        ("other call", send_pre, recv_seq,
         ("ValueError", "other kind of call"), ("ValueError", "send_prefix")),
        ("other call, the other way", send_seq, recv_pre,
         ("ValueError", "other kind of call"), ("ValueError", "send_sequence")),
        ("a gather fails half-way", lambda: send_seq(mode="per_layer", fail=2), recv_seq,
         ("RuntimeError", "planted failure"), ("TransferError", "gave up half-way")),
        ("a scatter fails half-way", lambda: send_seq(mode="per_layer"),
         lambda: recv_seq(fail=2),
         ("TransferError", "did not keep the payload"), ("RuntimeError", "planted failure")),
        ("then a transfer succeeds", send_seq, recv_seq, (None, ""), (None, "")),
    ]


def refusals(rank, *, names=None, kill=None):
    """Every case of :func:`_refusal_cases` (or those ``names``), one after the other, on the
    same process group; ``kill = (rank, phase, nth)`` as :func:`one_transfer`'s."""
    if kill is not None and kill[0] == rank:
        die_at(*kill[1:])
    out = {}
    for name, send, recv, _, _ in _refusal_cases():
        if names is None or name in names:
            out[name] = (send if rank == 0 else recv)()
    return out


def test_every_refusal_and_failure_half_way_is_answered_promptly_and_undone():
    res = run_pair(refusals, deadline=60)
    assert "crashed" not in res[0] and "crashed" not in res[1], res
    for name, _, _, *expected in _refusal_cases():
        for rank in (0, 1):
            side, (error, words) = res[rank][name], expected[rank]
            assert side["error"] == error and words in side["message"], (name, rank, side)
            assert side["seconds"] < PROMPTLY, (name, rank, side["seconds"])
            assert not side["problems"] and not side["stale"], (name, rank, side)
            if error is not None:
                assert side["same"], (name, rank, "the state changed")
    assert res[1]["then a transfer succeeds"]["landed"], "the ranks are out of step"


#: (refusal case, the rank that refuses): each refuser dies while it sends its refusal.
REFUSERS = [("seq_id held", 1), ("no prefix caching", 1), ("other head_dim", 1), ("no room", 1),
            ("no room for a prefix", 1), ("prompt not computed", 0), ("unknown seq_id", 0)]


@pytest.mark.parametrize("name, dies", REFUSERS, ids=[r[0] for r in REFUSERS])
def test_a_peer_that_dies_while_refusing(name, dies):
    """The refusal never arrives: the survivor raises a TransferError at once, holding what it
    held before."""
    res = run_pair(refusals, names=[name], kill=(dies, "refusing", 1))
    assert res[dies] is None, f"rank {dies} was to die"
    assert_undone(res[1 - dies][name])


def test_a_refused_send_prefix_without_a_group_leaves_the_sender_as_it_was():
    """Issue 36, scenario 1 (no process group needed): nothing registered, no hit after; in a
    used pool (OTHER cached: PROMPT's first 2 blocks, and blocks holding other K/V) too."""
    for used in (False, True):
        cache, m = pool(seed=5)
        if used:
            compute(cache, m, "other", OTHER)
            m.free_sequence("other")
        side = attempt(lambda c=cache, m=m: transfer.send_prefix(c, m, PROMPT, dst=1), cache, m)
        assert side["error"] == "ValueError" and "compute the prompt first" in side["message"]
        assert side["same"] and len(m.cached_blocks()) == 3 * used and not side["stale"]
        assert m.add_sequence("x", token_ids=PROMPT) == 8 * used


# ---- the bugs of issue 36 planted back ------------------------------------------------------


def _plant(monkeypatch, tmp_path, module, edits):
    """Load ``module`` with ``edits`` and make the transfer calls use it."""
    mutant = mutant_of(module, edits, tmp_path, monkeypatch)
    originals = dict(vars(module))
    for user in {sequence_module, prefix_module, transfer} - {module}:
        for name, value in list(vars(user).items()):
            if name in vars(mutant) and value is originals.get(name):
                monkeypatch.setattr(user, name, getattr(mutant, name))
    return mutant


UNDO = ("    except BaseException:\n        manager.free_sequence(seq_id, num_computed=0)\n"
        "        raise")
PLANTED = {
    "1: send_prefix registers the prompt before it checks it": (prefix_module, [(
        "        blocks = manager.cached_prefix_blocks(ids[:full])",
        "        manager.add_sequence(('t', 0), token_ids=ids[: full + 1])\n"
        "        manager.free_sequence(('t', 0))\n"
        "        blocks = manager.cached_prefix_blocks(ids[:full])")]),
    "2: a dead sender's prefix leaves its hashes": (handshake, [(
        UNDO, UNDO.replace("free_sequence(seq_id, num_computed=0)", "free_sequence(seq_id)"))]),
    "3: a dead sender's sequence stays half-landed": (handshake, [(
        UNDO, "    except BaseException:\n        raise")]),
    "9: a refusal is not answered": (handshake, [(
        '    link.say(code, phase="refusing")\n    raise error', "    raise error")]),
}


def _caught(mistake) -> bool:
    """Run the fault scenarios that guard against ``mistake``; True if one fails."""
    checks = {
        "1": lambda: test_a_refused_send_prefix_without_a_group_leaves_the_sender_as_it_was(),
        "2": lambda: test_a_peer_dies(0, "prefix", "per_layer", "sending the payload", 2),
        "3": lambda: test_a_peer_dies(0, "sequence", "per_layer", "sending the payload", 3),
        # (the receiver goes on to its next call, alive: a sender without an answer waits)
        "9": lambda: _refusals_answered(["seq_id held", "then a transfer succeeds"]),
    }[mistake.split(":")[0]]
    try:
        checks()
    except AssertionError:
        return True
    return False


def _refusals_answered(names):
    """The sender of the first case raises the refusal's ValueError, promptly."""
    side = run_pair(refusals, names=names, deadline=60)[0][names[0]]
    assert side["error"] == "ValueError" and side["seconds"] < PROMPTLY, side


@pytest.mark.parametrize("mistake", PLANTED)
def test_each_planted_bug_is_caught(mistake, tmp_path, monkeypatch):
    module, edits = PLANTED[mistake]
    _plant(monkeypatch, tmp_path, module, edits)
    if mistake.startswith("9"):  # the sender waits out its timeout: keep it short
        monkeypatch.setattr(sys.modules[__name__], "TIMEOUT", 3.0)
    assert _caught(mistake), f"the fault suite missed the planted bug: {mistake}"
