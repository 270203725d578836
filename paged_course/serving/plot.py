"""Lesson 12's pictures: the queue over time, and normalized latency against request rate."""

from __future__ import annotations

import matplotlib.pyplot as plt

from paged_course.serving.driver import RunResult
from paged_course.serving.workload import Trace

COLORS = {"paged": "tab:green", "reserve_oracle": "tab:blue", "reserve_pow2": "tab:orange",
          "reserve_max": "tab:red"}
LABELS = {"paged": "paged (vLLM)", "reserve_oracle": "reserve oracle (Orca Oracle)",
          "reserve_pow2": "reserve pow2 (Orca Pow2)", "reserve_max": "reserve max (Orca Max)"}


def plot_arrivals(traces: dict[str, Trace], seconds_per_token: float, title: str = ""):
    """Per trace (label -> :class:`Trace`), one panel: each request a bar from its arrival for
    as long as its output takes alone (``output_len * seconds_per_token``), and the number of
    bars that overlap (right axis): the batch the load asks for, before memory has a say.
    Returns the figure."""
    fig, axes = plt.subplots(1, len(traces), figsize=(5.2 * len(traces), 3.2), squeeze=False)
    for ax, (label, trace) in zip(axes[0], traces.items(), strict=True):
        starts = [r.arrival_s for r in trace.requests]
        ends = [r.arrival_s + r.output_len * seconds_per_token for r in trace.requests]
        ax.barh(range(len(starts)), [e - s for s, e in zip(starts, ends, strict=True)],
                left=starts, height=0.8, color="tab:blue", alpha=0.6)
        ax.set_xlabel("time (s)")
        ax.set_ylabel("request (arrival order)")
        events = sorted([(t, 1) for t in starts] + [(t, -1) for t in ends])
        t, n = [0.0], [0]
        for when, step in events:
            t += [when, when]
            n += [n[-1], n[-1] + step]
        twin = ax.twinx()
        twin.plot(t, n, color="black", lw=1)
        twin.set_ylabel("requests at once", fontsize=8)
        ax.set_title(label, fontsize=9)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_timeline(runs: dict[str, RunResult], title: str = "", axes=None):
    """One panel per run (policy -> :class:`RunResult`): requests in the batch (running) and
    waiting behind it, over the run's clock. Returns the figure."""
    if axes is None:
        fig, axes = plt.subplots(len(runs), 1, figsize=(8, 1.7 * len(runs) + 0.6), sharex=True,
                                 squeeze=False)
        axes = axes[:, 0]
    fig = axes[0].figure
    for ax, (policy, res) in zip(axes, runs.items(), strict=True):
        t = [s.start_s for s in res.steps]
        running = [s.shape.seqs for s in res.steps]
        waiting = [max(0, s.in_flight - s.shape.seqs) for s in res.steps]
        ax.stackplot(t, running, waiting, colors=[COLORS.get(policy, "gray"), "lightgray"],
                     labels=["running (in the batch)", "waiting (queued)"], step="post")
        ax.set_ylabel("requests")
        ax.set_title(LABELS.get(policy, policy), fontsize=9, loc="left")
        ax.legend(loc="upper left", fontsize=7)
    axes[-1].set_xlabel("time (s" + (", simulated)" if next(iter(runs.values())).simulated
                                     else ")"))
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def plot_curves(records: list[dict], title: str = "", simulated: bool = False):
    """The paper's Fig. 12 from result records (:func:`~paged_course.serving.sweep.records`):
    one panel per dataset (a row per ``"model"`` where records have one), mean normalized
    latency (ms/token) against request rate per policy, the latency bound dashed and each
    policy's sustained rate dotted. Returns the figure."""
    models = list(dict.fromkeys(r.get("model") for r in records))
    datasets = list(dict.fromkeys(r["dataset"] for r in records))
    fig, axes = plt.subplots(len(models), len(datasets), squeeze=False,
                             figsize=(5.2 * len(datasets), 3.4 * len(models) + 0.4))
    for row, model in zip(axes, models, strict=True):
        for ax, name in zip(row, datasets, strict=True):
            recs = [r for r in records if r["dataset"] == name and r.get("model") == model]
            for rec in recs:
                pts = sorted(rec["curve"], key=lambda p: p["rate_rps"])
                color = COLORS.get(rec["policy"], "gray")
                ax.plot([p["rate_rps"] for p in pts],
                        [p["mean_normalized_latency_s"] * 1e3 for p in pts], "o-", ms=4,
                        color=color, label=LABELS.get(rec["policy"], rec["policy"]))
                if rec["sustained_rate_rps"]:
                    ax.axvline(rec["sustained_rate_rps"], color=color, lw=0.8, ls=":")
            if recs:
                bound = recs[0]["latency_bound_s"] * 1e3
                ax.axhline(bound, color="black", ls="--", lw=1,
                           label=f"bound ({bound:.2f} ms/token)")
                ax.set_ylim(0, bound * 2.5)  # NOTE: exploded points would flatten the rest
            ax.set_xlabel("request rate (requests/s" + (", simulated)" if simulated else ")"))
            ax.set_ylabel("normalized latency (ms/token)")
            ax.set_title(f"{model}, {name}" if model else name, fontsize=10)
            ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig
