"""How much memory does sharing blocks save? Simulations for lesson 07, run on the real
:class:`paged_ref.KVCacheManager` (fork, copy-on-write, prefix caching), with lesson 01's
request lengths (:func:`paged_course.simulate.sample_requests`).

Units: tokens and blocks. ``saving`` = 1 - blocks held with sharing / blocks the same
sequences would hold without it (each sequence its own copy), summed over every decode step of
every request: the time average of a serving run in which many requests are in flight, as in
the PagedAttention paper (Kwon et al., SOSP 2023, §6.3: "the number of blocks we saved by
sharing divided by the number of total blocks without sharing").

* **parallel sampling** (:func:`parallel_sampling_saving`): ``n`` samples of one prompt. The
  prompt is added once and forked ``n - 1`` times; each sample then decodes its own output
  (lengths drawn independently, or all of the request's length). Only the prompt is shared.
* **beam search** (:func:`beam_search_saving`): ``width`` beams. At every step each new beam
  picks its parent uniformly at random among the current beams (a model of which candidates
  survive the top-``width`` cut; real scores are not simulated): ``fork`` the parents, free the
  old beams, append one token each. Beams share the prompt *and* their common history.
* **a shared system prompt** (:func:`system_prompt_run`): many requests whose prompts start
  with the same system prompt, served first-come-first-served from a fixed pool, with prefix
  caching on or off: the prefix-cache hit rate and how many requests run at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from paged_course.simulate import Requests, sample_requests
from paged_ref.cache_math import blocks_needed
from paged_ref.memory.allocator import OutOfBlocksError
from paged_ref.memory.manager import KVCacheManager

#: Mean prompt / output lengths in tokens (PagedAttention paper, Table 1 / Fig. 11).
DATASETS = {"ShareGPT-like": (161.31, 337.99), "Alpaca-like": (19.31, 58.45)}

#: Memory saved by sharing in the PagedAttention paper, in percent (lowest, highest) over
#: n / width = 2, 4, 6, per dataset (ours are lognormal fits of the paper's ShareGPT and Alpaca
#: traces) and method. Kwon et al., "Efficient Memory Management for Large Language Model
#: Serving with PagedAttention", SOSP 2023, §6.3 and Fig. 15, measured serving OPT-13B:
#: "6.1% - 9.8% memory saving on parallel sampling and 37.6% - 55.2% on beam search [Alpaca].
#: In the same experiments with the ShareGPT dataset, we saw 16.2% - 30.5% memory saving on
#: parallel sampling and 44.3% - 66.3% on beam search."
PAPER_SAVING = {
    "ShareGPT-like": {"parallel sampling": (16.2, 30.5), "beam search": (44.3, 66.3)},
    "Alpaca-like": {"parallel sampling": (6.1, 9.8), "beam search": (37.6, 55.2)},
}
PAPER_COLUMN = "paper % (OPT-13B, n/width 2-6)"


def dataset(name: str, n: int, seed: int = 0, max_len: int = 2048) -> Requests:
    """``n`` requests with the lengths of :data:`DATASETS` ``[name]`` (lognormal, lesson 01)."""
    if name not in DATASETS:
        raise ValueError(f"name must be one of {tuple(DATASETS)}, got {name!r}")
    prompt_mean, output_mean = DATASETS[name]
    return sample_requests(n, seed=seed, prompt_mean=prompt_mean, output_mean=output_mean,
                           max_len=max_len)


@dataclass
class SavingResult:
    """Block-steps held with and without sharing, summed over the run."""

    held: int  #: sum over steps of blocks held (shared blocks once)
    unshared: int  #: sum over steps of each sequence's ceil(len / block_size)
    copies: int  #: copy-on-writes performed

    @property
    def saving(self) -> float:
        """``1 - held / unshared``: the fraction of KV memory sharing saves."""
        return 1 - self.held / self.unshared


def _measure(m: KVCacheManager, result: SavingResult) -> None:
    result.held += m.num_blocks - m.num_free_blocks
    result.unshared += sum(blocks_needed(m.seq_len(s), m.block_size) for s in m.seq_ids)
    result.copies += len(m.take_copies())


def parallel_sampling_saving(requests: Requests, n: int, block_size: int = 16,
                             seed: int = 0, *, same_length: bool = False) -> SavingResult:
    """Saving of ``n`` samples per prompt. Each sample's output length is drawn from
    ``requests.output`` independently (samples finish at different steps), or, with
    ``same_length``, every sample decodes the request's own output length."""
    rng = np.random.default_rng(seed)
    result = SavingResult(0, 0, 0)
    for p, o in zip(requests.prompt.tolist(), requests.output.tolist(), strict=True):
        outputs = [o] * n if same_length else rng.choice(requests.output, size=n).tolist()
        m = KVCacheManager(blocks_needed(p + max(outputs), block_size) * n, block_size)
        m.add_sequence(0, p)
        for i in range(1, n):
            m.fork(0, i)
        for step in range(max(outputs)):
            _measure(m, result)
            for i in [i for i in m.seq_ids if outputs[i] == step]:
                m.free_sequence(i)  # this sample is done
            m.append_slots(m.seq_ids)
    return result


def beam_search_saving(requests: Requests, width: int, block_size: int = 16,
                       seed: int = 0) -> SavingResult:
    """Saving of beam search with ``width`` beams, each request decoding its output length."""
    rng = np.random.default_rng(seed)
    result = SavingResult(0, 0, 0)
    for p, o in zip(requests.prompt.tolist(), requests.output.tolist(), strict=True):
        m = KVCacheManager(blocks_needed(p + o, block_size) * width * 2, block_size)
        m.add_sequence(("beam", 0), p)
        beams = [("beam", 0)]
        for step in range(o):
            parents = [beams[int(j)] for j in rng.integers(0, len(beams), size=width)]
            children = [(step, j) for j in range(width)]
            for parent, child in zip(parents, children, strict=True):
                m.fork(parent, child)
            for b in beams:
                m.free_sequence(b)
            beams = children
            m.append_slots(beams)
            _measure(m, result)
    return result


def beams_common_ancestor_steps(width: int, trials: int = 2000, seed: int = 0) -> float:
    """In :func:`beam_search_saving`'s model (each new beam picks its parent uniformly at
    random among the ``width`` beams), how many steps back all current beams first share one
    ancestor, averaged over ``trials`` (the Wright-Fisher coalescent: ``2 (width - 1)``)."""
    rng = np.random.default_rng(seed)
    total = 0
    for _ in range(trials):
        lineages = width
        while lineages > 1:  # one step back: each lineage's parent, distinct ones survive
            lineages = len(set(rng.integers(0, width, size=lineages).tolist()))
            total += 1
    return total / trials


def saving_table(num_requests: int = 100, block_size: int = 16, seed: int = 0,
                 sizes=(2, 4, 6), max_len: int = 2048) -> list[dict]:
    """One row per dataset x method x size: our saving (%) next to the paper's range.

    ``max_len`` clips prompt + output (the long tail of beam search is what takes time)."""
    rows = []
    for name in DATASETS:
        reqs = dataset(name, num_requests, seed=seed, max_len=max_len)
        for method, fn in (("parallel sampling", parallel_sampling_saving),
                           ("beam search", beam_search_saving)):
            for k in sizes:
                r = fn(reqs, k, block_size, seed=seed)
                rows.append({"dataset": name, "method": method, "n / width": k,
                             "saving %": round(100 * r.saving, 1), "copies on write": r.copies})
    return with_paper(rows)


def with_paper(rows: list[dict]) -> list[dict]:
    """``rows`` of :func:`saving_table` (or read back from its JSON) with the paper's range
    for each row's dataset and method (:data:`PAPER_SAVING`) and where ours falls: "below",
    "within" or "above" it. Any paper column the rows already carry is replaced."""
    out = []
    for row in rows:
        lo, hi = PAPER_SAVING[row["dataset"]][row["method"]]
        ours = row["saving %"]
        where = "below" if ours < lo else "above" if ours > hi else "within"
        kept = {k: v for k, v in row.items() if not k.startswith("paper %") and k != "vs paper"}
        out.append({**kept, PAPER_COLUMN: f"{lo}-{hi}", "vs paper": where})
    return out


def compare_with_paper(rows: list[dict]) -> dict[tuple[str, str], dict[str, list[int]]]:
    """Per (dataset, method): the sizes (n / width) whose saving falls below, within and
    above the paper's range, e.g. ``{("Alpaca-like", "beam search"): {"below": [],
    "within": [2], "above": [4, 6]}}``."""
    summary: dict[tuple[str, str], dict[str, list[int]]] = {}
    for row in with_paper(rows):
        where = summary.setdefault((row["dataset"], row["method"]),
                                   {"below": [], "within": [], "above": []})
        where[row["vs paper"]].append(row["n / width"])
    return summary


@dataclass
class SystemPromptResult:
    """A serving run of requests that share a system prompt."""

    enable_prefix_caching: bool
    hit_rate: float  #: prompt tokens served from the prefix cache / all prompt tokens
    mean_running: float  #: requests running at once, averaged over steps with a queue
    steps: int  #: decode steps until every request finished
    peak_running: int = 0  #: most requests running at once


def system_prompt_run(requests: Requests, system_tokens: int, num_blocks: int, *,
                      enable_prefix_caching: bool, block_size: int = 16,
                      seed: int = 0) -> SystemPromptResult:
    """Serve ``requests`` whose prompts are ``system_tokens`` shared tokens + their own
    prompt (random token ids) from ``num_blocks`` blocks, first come first served; each
    step every running request appends one token; a finished request is freed (with prefix
    caching its full prompt blocks stay cached)."""
    longest = system_tokens + int(requests.total.max())
    if blocks_needed(longest, block_size) > num_blocks:
        raise ValueError(f"a request of {longest} tokens does not fit in num_blocks="
                         f"{num_blocks} blocks of {block_size}: it would be preempted forever")
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 32000, size=system_tokens).tolist()
    m = KVCacheManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    queue = list(range(len(requests)))[::-1]
    remaining: dict[int, int] = {}
    running_sum = saturated = steps = 0
    peak = 0
    admit = True  # after a preemption, admit no one until a request finishes
    while queue or remaining:
        while queue and admit:
            i = queue[-1]
            prompt = system + rng.integers(0, 32000, size=int(requests.prompt[i])).tolist()
            try:
                m.add_sequence(i, token_ids=prompt)
            except OutOfBlocksError:
                break
            queue.pop()
            remaining[i] = int(requests.output[i])
        if not remaining:
            raise RuntimeError(f"request {queue[-1]} does not fit in {num_blocks} blocks")
        steps += 1
        peak = max(peak, len(remaining))
        if queue:
            saturated += 1
            running_sum += len(remaining)
        try:
            m.append_slots(list(remaining))
        except OutOfBlocksError:  # full: the newest request waits (recomputed later)
            newest = list(remaining)[-1]
            m.free_sequence(newest)
            del remaining[newest]
            queue.append(newest)
            admit = False
            continue
        for i in [i for i, left in remaining.items() if left <= 1]:
            m.free_sequence(i)
            del remaining[i]
            admit = True
        remaining = {i: left - 1 for i, left in remaining.items()}
    return SystemPromptResult(enable_prefix_caching, m.stats().prefix_hit_rate,
                              running_sum / max(1, saturated), steps, peak)
