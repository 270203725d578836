"""course.set_threads: a torch thread count that holds up on a small, busy machine (one per
two physical cores, at most four; OMP_NUM_THREADS wins)."""

from __future__ import annotations

import pytest
import torch

from paged_course import threads

# Two sockets, hyper-threads: logical CPUs 0-3 are physical cores (0,0) (0,1) (1,0) (1,1) and
# CPUs 4-7 their second threads.
CPUINFO = "".join(
    f"processor\t: {cpu}\nphysical id\t: {cpu // 2 % 2}\ncore id\t\t: {cpu % 2}\n\n"
    for cpu in range(8))


def test_physical_cores_counts_hyperthreads_once():
    assert threads.physical_cores(CPUINFO, usable=set(range(8))) == 4
    assert threads.physical_cores(CPUINFO, usable={0, 4}) == 1  # one core, both its threads
    assert threads.physical_cores("", usable={0, 1, 2}) == 3  # no cpuinfo: logical CPUs


@pytest.mark.parametrize("cores, expected", [(1, 1), (2, 1), (3, 1), (4, 2), (6, 3), (8, 4),
                                             (64, 4)])
def test_one_thread_per_two_physical_cores_at_most_four(cores, expected):
    assert threads.default_threads(env={}, cores=cores, quota=None) == expected


def test_a_container_quota_and_omp_num_threads_are_respected():
    assert threads.default_threads(env={}, cores=16, quota=2.0) == 1
    assert threads.default_threads(env={"OMP_NUM_THREADS": "3"}, cores=2, quota=None) == 3
    assert threads.default_threads(env={"OMP_NUM_THREADS": "junk"}, cores=8, quota=None) == 4


def test_set_threads_sets_torch(monkeypatch):
    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(threads, "default_threads", lambda: 1)
        assert threads.set_threads() == 1 and torch.get_num_threads() == 1
        assert threads.set_threads(2) == 2 and torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="positive int"):
            threads.set_threads(0)
    finally:
        torch.set_num_threads(before)


def ranks_threads(rank: int, world_size: int) -> int:
    """(runs in each spawned rank) the rank's torch thread count."""
    return torch.get_num_threads()


def test_each_spawned_rank_takes_its_share(monkeypatch):
    """Lesson 11's two CPU ranks split the thread budget instead of each taking every CPU."""
    from paged_course import two_ranks

    monkeypatch.setattr(two_ranks, "default_threads", lambda: 4)
    assert two_ranks.rank_threads(2) == 2
    monkeypatch.setattr(two_ranks, "default_threads", lambda: 1)
    assert two_ranks.rank_threads(2) == 1
    monkeypatch.undo()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # else torch's default obeys it too
    got = two_ranks.run_two_ranks(ranks_threads, backend="gloo")
    assert got == {0: two_ranks.rank_threads(2), 1: two_ranks.rank_threads(2)}
