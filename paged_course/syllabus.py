"""The course's lessons, 00 to 12, and which of them exist in this checkout.

A lesson *exists* when its notebook ``notebooks/NN_*.ipynb`` is there; the others are planned.
Lesson 00 prints this table from the files, so it never claims a lesson that is not written.
Each lesson's time is in the README's syllabus (``tools/lesson_times.py`` writes it).
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
    Lesson(0, "set-up", "check the machine; a ten-line Triton kernel, in the interpreter or "
           "compiled", "no"),
    Lesson(1, "KV cache", "the KV cache on a tiny attention; bytes per token of real models; "
           "contiguous reservation vs paging, simulated", "no"),
    Lesson(2, "block allocator", "allocator, block tables, `append_slot`, slot mapping; the "
           "block-table explorer", "no"),
    Lesson(3, "gather attention", "the reference: gather K/V through the table, masked "
           "softmax; a prefill + decode loop", "no"),
    Lesson(4, "Triton paged decode", "a Triton kernel that reads blocks in place with an "
           "online softmax", "timings only"),
    Lesson(5, "split-KV", "flash-decoding: split long sequences across programs, merge by "
           "log-sum-exp", "timings only"),
    Lesson(6, "the cost around the kernel", "where a call's time goes; plan once, run many; "
           "CUDA graphs; page size; the roofline", "timings only"),
    Lesson(7, "sharing blocks", "reference counts, fork, copy-on-write, prefix caching with "
           "LRU eviction, a host tier", "no"),
    Lesson(8, "paged prefill", "many query rows per sequence: the causal mask shifted by a "
           "cached prefix, chunked prefill, a tiled Triton kernel", "timings only"),
    Lesson(9, "serving engine", "`paged_ref.engine` serves SmolLM2-135M: continuous batching, "
           "chunked prefill, preemption, prefix caching; your scheduler policies",
           "timings only"),
    Lesson(10, "quantised KV caches", "FP8 (e4m3) and INT4 caches with their scales, the "
           "quantising write, de-quantising kernels", "timings only"),
    Lesson(11, "two GPUs", "moving a prompt's KV blocks between engines (disaggregated "
           "prefill and decode); two processes on a CPU", "timings only (two)"),
    Lesson(12, "serving under load", "Poisson arrivals, latency against request rate, paging "
           "vs reservation: the paper's headline, measured", "timings only"),
)

#: Lessons 00-05 are the core path; 06-12 extend it.
CORE = range(0, 6)


def notebook(lesson: Lesson, folder: Path | None = None) -> Path | None:
    """The lesson's notebook ``NN_*.ipynb`` in ``folder`` (default ``notebooks/``), or None."""
    found = sorted((folder or ROOT / "notebooks").glob(f"{lesson.number:02d}_*.ipynb"))
    return found[0] if found else None


def syllabus_markdown(folder: Path | None = None) -> str:
    """The lessons as a Markdown table; the state column comes from the notebook files."""
    lines = ["| lesson | state | path | what you build | GPU needed? |", "|---|---|---|---|---|"]
    for lesson in LESSONS:
        nb = notebook(lesson, folder)
        state = f"ready: `{nb.name}`" if nb else "planned"
        path = "core" if lesson.number in CORE else "extension"
        lines.append(f"| {lesson.number:02d} {lesson.topic} | {state} | {path} | "
                     f"{lesson.builds} | {lesson.gpu} |")
    return "\n".join(lines)
