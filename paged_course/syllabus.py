"""The course's lessons, 00 to 12, and which of them exist in this checkout.

A lesson *exists* when its notebook ``notebooks/NN_*.ipynb`` is there; the others are planned.
Lesson 00 prints this table from the files, so it never claims a lesson that is not written.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from paged_course import ROOT


@dataclass(frozen=True)
class Lesson:
    number: int
    topic: str
    builds: str
    gpu: str  # "no", or what needs a GPU


LESSONS = (
    Lesson(0, "set-up", "the machine check and a first Triton kernel", "no"),
    Lesson(1, "KV cache", "why a KV cache exists; how much memory contiguous reservation "
           "wastes (simulation)", "no"),
    Lesson(2, "block allocator", "a block allocator, block tables, slot mapping; the "
           "block-table explorer", "no"),
    Lesson(3, "gather attention", "attention that gathers K/V through the block table "
           "(the torch reference)", "no"),
    Lesson(4, "Triton paged decode", "a one-pass Triton paged decode kernel", "timings only"),
    Lesson(5, "split-KV", "flash-decoding: split the KV cache, merge with log-sum-exp",
           "timings only"),
    Lesson(6, "the cost around the kernel", "host checks, syncs, launches, CUDA graphs, "
           "plan/run; page size and the roofline", "timings only"),
    Lesson(7, "sharing blocks", "reference counts, copy-on-write, prefix caching with "
           "eviction", "no"),
    Lesson(8, "paged prefill", "prefill over the paged cache: chunked prefill, prefix hits",
           "timings only"),
    Lesson(9, "a serving engine", "a small engine on a real LLM: more requests per GPU, "
           "measured", "timings only"),
    Lesson(10, "quantised KV caches", "FP8 / INT4 caches with scales", "timings only"),
    Lesson(11, "two GPUs", "moving KV blocks between GPUs", "yes (two)"),
    Lesson(12, "serving under load", "Poisson arrivals, latency against request rate, paging "
           "vs reservation: the paper's headline, measured", "timings only"),
)


def notebook(lesson: Lesson, folder: Path | None = None) -> Path | None:
    """The lesson's notebook ``NN_*.ipynb`` in ``folder`` (default ``notebooks/``), or None."""
    found = sorted((folder or ROOT / "notebooks").glob(f"{lesson.number:02d}_*.ipynb"))
    return found[0] if found else None


def syllabus_markdown(folder: Path | None = None) -> str:
    """The lessons as a Markdown table; the state column comes from the notebook files."""
    lines = ["| lesson | state | what you build | GPU needed? |", "|---|---|---|---|"]
    for lesson in LESSONS:
        nb = notebook(lesson, folder)
        state = f"ready: `{nb.name}`" if nb else "planned"
        lines.append(f"| {lesson.number:02d} {lesson.topic} | {state} | {lesson.builds} | "
                     f"{lesson.gpu} |")
    return "\n".join(lines)
