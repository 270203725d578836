"""Two gloo ranks forked from the test process, one of which may be killed mid-call.

``paged_course.two_ranks.run_two_ranks`` spawns fresh interpreters (seconds each, to import
torch); a fault suite needs dozens of pairs, so these are forked (a third of a second a pair)
and report through files. A rank that dies (``os._exit``) reports nothing; its result is None.

    results = run_pair(body, deadline=20, **kwargs)   # body(rank, **kwargs) -> a picklable dict

``die_at(phase, nth)`` makes this process exit the moment its ``nth`` message of ``phase``
(a :class:`paged_ref.transfer.link.Link` phase, such as ``"sending the payload"``) is about to
be posted: a peer killed at a chosen point of the protocol.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from paged_course.two_ranks import free_port
from paged_ref.transfer import link as link_module

KILLED = 17  # the exit status of a rank killed on purpose


def die_at(phase: str, nth: int = 1, sleep: float = 0.0) -> None:
    """From now on, exit (status :data:`KILLED`) instead of posting the ``nth`` message of
    ``phase``; with ``sleep``, first stay silent that long (a peer that hangs, then dies)."""
    real = link_module.Link._post
    seen = [0]

    def post(self, op, tensor, this_phase):
        if this_phase == phase:
            seen[0] += 1
            if seen[0] == nth:
                time.sleep(sleep)
                os._exit(KILLED)
        return real(self, op, tensor, this_phase)

    link_module.Link._post = post


def _child(rank: int, port: int, out: Path, body, kwargs) -> None:
    status = 1
    try:
        torch.set_num_threads(1)  # (a forked child must not use the parent's thread pool)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=2, timeout=datetime.timedelta(seconds=30))
        result = body(rank, **kwargs)
        (out / f"rank{rank}.pkl").write_bytes(pickle.dumps(result))
        status = 0
    except BaseException as e:  # noqa: BLE001 -- reported to the test, which fails on it
        (out / f"rank{rank}.pkl").write_bytes(pickle.dumps({"crashed": repr(e)}))
    finally:
        os._exit(status)  # never return into the test runner's code


def run_pair(body, *, deadline: float = 30.0, **kwargs) -> dict[int, dict | None]:
    """Fork ranks 0 and 1, run ``body(rank, **kwargs)`` on each, return ``{rank: result}``
    (None for a rank that died). Ranks still running after ``deadline`` seconds are killed
    and reported as ``{"hung": True}``."""
    port = free_port()
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder)
        pids = {}
        for rank in (0, 1):
            pid = os.fork()
            if pid == 0:
                _child(rank, port, out, body, kwargs)
            pids[rank] = pid
        end = time.monotonic() + deadline
        waiting = dict(pids)
        while waiting and time.monotonic() < end:
            for rank, pid in list(waiting.items()):
                if os.waitpid(pid, os.WNOHANG)[0]:
                    del waiting[rank]
            time.sleep(0.01)
        for pid in waiting.values():
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        results: dict[int, dict | None] = {}
        for rank in (0, 1):
            path = out / f"rank{rank}.pkl"
            results[rank] = ({"hung": True} if rank in waiting else
                             pickle.loads(path.read_bytes()) if path.exists() else None)
        return results
