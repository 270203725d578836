"""What every benchmark suite (``python -m paged_bench NAME``) shares.

* :func:`suite_parser`: the command line every suite starts from: ``--out``, and ``--cases``
  / ``--backends`` (comma-separated names, checked against the suite's own) where it has them;
* :func:`check_then_time`: the loop each case runs. A *runner* is ``label -> (backend, info,
  fn)``: ``fn()`` returns the output, ``info`` goes into the result row. Every runner runs
  once and its output is checked (a float64 reference, a relative error) before anything is
  timed; one that raises (a config needing more shared memory than exists, a peer that cannot
  read this cache) is reported and left out. Then a GPU warm-up and ``passes`` timing passes;
* :func:`flashinfer_page_table`: our block tables as FlashInfer's paged-KV arguments.

The result file: :func:`paged_course.results.environment` (GPU, versions, date) and
:func:`paged_course.results.write_result`; the timers: :mod:`paged_course.timing`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from paged_course.results import RESULTS, gpu_kind
from paged_course.timing import time_ms, warm_up_gpu
from paged_ref.cache_math import cdiv, tokens_in_block


def name_list(known: Iterable[str], what: str) -> Callable[[str], list[str]]:
    """An argparse ``type``: ``"a,b"`` -> ``["a", "b"]``, each one of ``known`` (else argparse
    says which ``what`` is unknown and exits with status 2)."""
    known = list(known)

    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        unknown = [n for n in names if n not in known]
        if unknown:
            raise argparse.ArgumentTypeError(
                f"unknown {what} {', '.join(unknown)} (from: {', '.join(known)})")
        return names

    return parse


def suite_parser(suite: str, doc: str, *, out: str, cases: Iterable[str] | None = None,
                 backends: Iterable[str] | None = None,
                 out_help: str = "JSON path (the plot goes beside it)") -> argparse.ArgumentParser:
    """The parser a suite adds its own options to: ``prog`` and the description (``doc``'s first
    line), ``--out`` (a :class:`~pathlib.Path`, default ``results/<this machine's GPU kind>/<out>``:
    the file the lessons read), and where given ``--cases`` and ``--backends`` (default: all of
    them; parsed into lists of names)."""
    p = argparse.ArgumentParser(prog=f"python -m paged_bench {suite}",
                                description=doc.strip().split("\n")[0])
    for option, names, what in (("--cases", cases, "case"), ("--backends", backends, "backend")):
        if names is not None:
            names = list(names)
            p.add_argument(option, type=name_list(names, what), default=",".join(names),
                           help="comma-separated, from: " + ", ".join(names))
    p.add_argument("--out", type=Path, default=RESULTS / gpu_kind() / out, help=out_help)
    return p


def sync() -> None:
    """Wait for the GPU (nothing to wait for on a CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@dataclass
class Measured:
    """One runner that ran, was checked and timed."""

    label: str
    backend: str
    info: dict
    fn: Callable[[], object]
    error: object  #: what ``check`` returned for its output (a relative error, or several)
    ms_passes: list[float]

    @property
    def ms(self) -> float:
        """The better pass: an idle GPU starts at low clocks, and small cases never load it
        enough to ramp them up."""
        return min(self.ms_passes)

    def row(self, case: str, **fields) -> dict:
        """A result row: ``case``, ``backend``, ``label``, ``ms``, ``rel_err``, then ``fields``
        (which may replace any of those), then the runner's ``info``."""
        return {"case": case, "backend": self.backend, "label": self.label, "ms": self.ms,
                "rel_err": self.error, **fields, **self.info}


def check_then_time(case: str, runners: dict, check: Callable[[object], object], *,
                    passes: int = 2, timer: Callable[[Callable], float] = time_ms
                    ) -> list[Measured]:
    """Run every runner once and ``check`` its output, then time those that ran.

    ``runners``: ``label -> (backend, info, fn)``. A runner whose call raises is printed as
    skipped (with ``case``) and left out. ``check(output)`` is stored as
    :attr:`Measured.error`. Then (on a GPU, after :func:`warm_up_gpu`) ``passes`` rounds of
    ``timer`` over all of them (:func:`~paged_course.timing.time_ms`: do_bench median,
    L2 flushed), so that every kernel is compiled before the first one is timed.
    """
    checked = {}
    for label, (_, _, fn) in runners.items():
        try:
            out = fn()
            sync()
        except Exception as exc:
            print(f"{case} {label}: skipped ({type(exc).__name__}: {str(exc)[:160]})")
            continue
        checked[label] = check(out)
    if torch.cuda.is_available():
        warm_up_gpu()
    times = [{label: timer(runners[label][2]) for label in checked} for _ in range(passes)]
    return [Measured(label, *runners[label], error, [t[label] for t in times])
            for label, error in checked.items()]


def flashinfer_page_table(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int):
    """FlashInfer's paged-KV arguments for our cache (its "NHD" layout is ours):
    ``(indptr, indices, last_page_len)``, int32 on the tables' device. Sequence ``b``'s pages
    are ``indices[indptr[b]:indptr[b + 1]]`` (its used table entries), its last page holds
    ``last_page_len[b]`` tokens."""
    device = block_tables.device
    lens = seq_lens.tolist()
    pages = cdiv(seq_lens.long(), block_size)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=device)
    indptr[1:] = torch.cumsum(pages, 0)
    cols = torch.arange(block_tables.shape[1], device=device)
    indices = block_tables[cols[None, :] < pages[:, None]].to(torch.int32).contiguous()
    last = torch.tensor([tokens_in_block(n, cdiv(n, block_size) - 1, block_size) for n in lens],
                        dtype=torch.int32, device=device)
    return indptr, indices, last
