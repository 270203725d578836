"""How many CPU threads torch should use in a lesson: a count that holds up on a small, busy
machine.

    course.set_threads()          # a lesson's setup cell, before the model runs; returns it

torch's default is one thread per logical CPU. On a 2-core laptop or a shared runner that is
already busy, those threads spin waiting for each other and a model lesson slows down many
times over (lesson 09 took 549 s instead of 30 s on such a machine, and the chat CLI ran at
0.4 tok/s instead of 7 tok/s with one thread). One thread per two physical cores, at most
four, loses little on an idle machine and never collapses; ``OMP_NUM_THREADS``, when set,
wins.
"""

from __future__ import annotations

import os
from pathlib import Path

MAX_THREADS = 4


def _usable_cpus() -> set[int] | None:
    """The logical CPUs this process may run on (None where the OS does not say)."""
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def physical_cores(cpuinfo: str | None = None, usable: set[int] | None = None) -> int:
    """Physical cores among the usable logical CPUs (hyper-threads counted once).

    Args:
        cpuinfo: the text of ``/proc/cpuinfo`` (read from the machine when None).
        usable:  logical CPU ids to count (this process's affinity when None).
    Returns:
        at least 1; the logical CPU count where ``/proc/cpuinfo`` says nothing.
    """
    usable = _usable_cpus() if usable is None else usable
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    cores, cpu, package = set(), None, "0"
    for line in cpuinfo.splitlines() + [""]:
        key, _, value = (part.strip() for part in line.partition(":"))
        if key == "processor":
            cpu = int(value)
        elif key == "physical id":
            package = value
        elif key == "core id" and (usable is None or cpu in usable):
            cores.add((package, value))
    if cores:
        return len(cores)
    return max(1, len(usable) if usable else (os.cpu_count() or 1))


def _cgroup_cpus(path: Path = Path("/sys/fs/cgroup/cpu.max")) -> float | None:
    """The CPUs a container's quota allows (``cpu.max``: "quota period"), or None."""
    try:
        quota, period = path.read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def default_threads(env: dict[str, str] | None = None, cores: int | None = None,
                    quota: float | None = None) -> int:
    """The thread count :func:`set_threads` picks.

    Args:
        env:   the environment (``os.environ`` when None); a positive ``OMP_NUM_THREADS`` wins.
        cores: physical cores (:func:`physical_cores` when None).
        quota: CPUs a container quota allows (read from the cgroup when None).
    Returns:
        ``OMP_NUM_THREADS`` if set to a positive integer; else one thread per two physical
        cores (and per two CPUs of the quota), between 1 and :data:`MAX_THREADS`.
    """
    env = os.environ if env is None else env
    asked = env.get("OMP_NUM_THREADS", "").strip()
    if asked.isdigit() and int(asked) > 0:
        return int(asked)
    cores = physical_cores() if cores is None else cores
    quota = _cgroup_cpus() if quota is None else quota
    if quota:
        cores = min(cores, int(quota))
    return max(1, min(MAX_THREADS, cores // 2))


def set_threads(n: int | None = None) -> int:
    """Set torch's CPU threads to ``n`` (default :func:`default_threads`); return the count.

    Raises:
        ValueError: ``n`` is not a positive integer.
    """
    import torch

    if n is None:
        n = default_threads()
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int, got {n!r}")
    torch.set_num_threads(n)
    return n
