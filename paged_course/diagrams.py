"""Pictures of three lessons' key ideas, drawn from what a cell just computed or measured.

* :func:`draw_program_ids` (lesson 00): which program of a launch wrote which element, from a
  kernel's own output; the lanes a mask switched off stay unwritten.
* :func:`call_timeline` / :func:`draw_call_timeline` (lesson 06): host and GPU lanes of a few
  consecutive decode calls, scheduled from measured step times (the committed ``host_us`` and the
  kernel's GPU time): with the checks on the host (a read-back before every launch) the GPU waits
  for the host; with a plan the host queues the next call while the kernel runs.
* :func:`draw_engine_loop` (lesson 09): the serving engine's loop, schedule -> layout -> run ->
  sample -> update, with the numbers of one recorded step.
"""

from __future__ import annotations

from dataclasses import dataclass

from matplotlib.figure import Figure
from matplotlib.patches import FancyArrowPatch, FancyBboxPatch

#: A lane a mask switched off: no program wrote it.
NOT_WRITTEN = -1


def draw_program_ids(owner: list[int], block: int, n: int, *, title: str = "") -> Figure:
    """One row of cells, element ``i`` coloured by ``owner[i]``, the program id that stored it
    (:data:`NOT_WRITTEN` where none did), with the programs' ``block``-wide spans outlined and
    the data's end ``n`` marked.

    Args:
        owner: per element of the launch's whole span (``programs * block``), the program id
            that wrote it, or -1.
        block: elements per program (``BLOCK``).
        n: the data's length; lanes at ``n`` and past it should be -1 (masked).
    """
    import matplotlib.pyplot as plt

    if block < 1 or len(owner) % block:
        raise ValueError(f"len(owner)={len(owner)} must be a positive multiple of block={block}")
    programs = len(owner) // block
    colors = plt.get_cmap("tab10").colors
    fig = Figure(figsize=(min(12, 0.42 * len(owner) + 1), 1.9), layout="constrained")
    ax = fig.subplots()
    for i, pid in enumerate(owner):
        if pid == NOT_WRITTEN:
            ax.add_patch(plt.Rectangle((i, 0), 1, 1, facecolor="white", edgecolor="0.6",
                                       hatch="///"))
        else:
            ax.add_patch(plt.Rectangle((i, 0), 1, 1, facecolor=colors[pid % 10],
                                       edgecolor="white"))
            ax.text(i + 0.5, 0.5, str(pid), ha="center", va="center", fontsize=8, color="white")
    for p in range(programs):
        ax.add_patch(plt.Rectangle((p * block, 0), block, 1, fill=False, edgecolor="k", lw=1.5))
        ax.text(p * block + block / 2, 1.15, f"program {p}", ha="center", fontsize=8)
    ax.axvline(n, color="r", ls="--", lw=1.5)
    ax.text(n, -0.35, f"n = {n}", color="r", ha="center", fontsize=8)
    ax.set_xlim(-0.2, len(owner) + 0.2)
    ax.set_ylim(-0.6, 1.5)
    ax.axis("off")
    written = sum(p != NOT_WRITTEN for p in owner)
    ax.set_title(title or f"{programs} programs x {block} lanes: {written} elements written, "
                 f"{len(owner) - written} lanes masked (hatched)", fontsize=9)
    return fig


# ---- lesson 06: a timeline of calls --------------------------------------------------------

#: The host steps of a call whose values are checked on the host, in order
#: (``paged_course.cost.STEPS``); ``check_values`` ends with a read-back.
HOST_STEPS = ("check_shapes", "check_values", "dispatch_and_scratch", "allocate_out", "launch")


@dataclass(frozen=True)
class Segment:
    """One bar of a timeline: ``lane`` ("host" or "GPU"), what runs, from ``start`` to ``end``
    (µs), for call number ``call``."""

    lane: str
    label: str
    start: float
    end: float
    call: int


def call_timeline(steps_us: dict, kernel_us: float, calls: int = 3, *,
                  planned: bool) -> list[Segment]:
    """Host and GPU segments of ``calls`` back-to-back decode calls, scheduled from measured
    durations.

    Without a plan each call runs :data:`HOST_STEPS`; ``check_values`` copies values to the host,
    so it cannot end before the GPU has finished what was queued (the previous kernel): the host
    waits, then checks. With a plan a call is one host step (``planned_call``: shape checks and
    the launch) and never waits. Either way a kernel starts when its launch is done and the GPU
    is free, and runs ``kernel_us``.

    Args:
        steps_us: host µs per step (a ``host_us`` row of a decode result), with ``planned_call``.
        kernel_us: the kernel's GPU time, µs.
        calls: how many consecutive calls.
        planned: schedule planned calls (True) or calls checked on the host (False).

    Returns:
        The segments, in time order per lane; "wait" segments mark the host blocked on the GPU.
    """
    if kernel_us < 0 or calls < 1:
        raise ValueError(f"kernel_us={kernel_us} must be >= 0 and calls={calls} >= 1")
    host, gpu_free, out = 0.0, 0.0, []
    for call in range(calls):
        if planned:
            out.append(Segment("host", "planned call", host, host + steps_us["planned_call"],
                               call))
            host += steps_us["planned_call"]
        else:
            for step in HOST_STEPS:
                if step == "check_values" and gpu_free > host:
                    out.append(Segment("host", "wait", host, gpu_free, call))
                    host = gpu_free
                out.append(Segment("host", step, host, host + steps_us[step], call))
                host += steps_us[step]
        start = max(host, gpu_free)
        out.append(Segment("GPU", "kernel", start, start + kernel_us, call))
        gpu_free = start + kernel_us
    return out


def timeline_end(segments: list[Segment]) -> float:
    """When the last kernel of a timeline ends, µs."""
    return max(s.end for s in segments if s.lane == "GPU")


def draw_call_timeline(cases: list[tuple[str, dict, float]], calls: int = 3, *,
                       title: str = "") -> Figure:
    """One panel per ``(name, steps_us, kernel_us)`` case: host and GPU lanes of ``calls``
    calls checked on the host (top pair) and planned (bottom pair), from :func:`call_timeline`."""
    import matplotlib.pyplot as plt

    colors = dict(zip(HOST_STEPS, plt.get_cmap("tab10").colors, strict=False))
    colors |= {"planned call": "0.55", "wait": "white", "kernel": "black"}
    fig = Figure(figsize=(10, 1.9 * len(cases) + 0.6), layout="constrained")
    axes = fig.subplots(len(cases), 1, squeeze=False)[:, 0]
    for ax, (name, steps, kernel_us) in zip(axes, cases, strict=True):
        lanes = []
        for planned in (False, True):
            segs = call_timeline(steps, kernel_us, calls, planned=planned)
            mode = "plan" if planned else "checks on host"
            lanes += [(f"{mode}: host", [s for s in segs if s.lane == "host"]),
                      (f"{mode}: GPU", [s for s in segs if s.lane == "GPU"])]
            end = timeline_end(segs)
            ax.text(end, len(lanes) - 1, f"  {calls} calls end at {end:.0f} µs", va="center",
                    fontsize=7)
        for y, (_, segs) in enumerate(lanes):
            for s in segs:
                hatch = "///" if s.label == "wait" else None
                edge = "white" if s.label == "kernel" else "0.3"
                ax.barh(y, s.end - s.start, left=s.start, height=0.6, color=colors[s.label],
                        edgecolor=edge, hatch=hatch, lw=0.8)
        ax.set_yticks(range(len(lanes)), [lane for lane, _ in lanes], fontsize=8)
        ax.invert_yaxis()
        ax.set_title(f"{name}: kernel {kernel_us:.0f} µs on the GPU", fontsize=9)
        ax.set_xlabel("µs")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colors[k]) for k in (*HOST_STEPS, "planned call")]
    handles += [plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="0.3", hatch="///"),
                plt.Rectangle((0, 0), 1, 1, color="black")]
    fig.legend(handles, [*HOST_STEPS, "planned call", "host waits for the GPU", "kernel"],
               loc="outside lower center", ncol=4, fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


# ---- lesson 09: the engine loop ------------------------------------------------------------

#: The five stages of one engine step, with what each does.
LOOP = (("schedule", "pick chunks within the token\nbudget and the free blocks"),
        ("layout", "one flat batch: ids, positions,\nslot mapping, block tables"),
        ("run", "every layer writes K/V through the\nslot mapping, attends via the tables"),
        ("sample", "one greedy token per request\nwhose chunk reached its end"),
        ("update", "append tokens; finish, free\nblocks; admit from the queue"))


def loop_facts(event, num_layers: int | None = None) -> dict[str, str]:
    """What one recorded step (a ``paged_ref.engine.StepEvent``) did, per stage of :data:`LOOP`."""
    prefills = sum(n > 1 for _, _, n in event.ran)
    decodes = len(event.ran) - prefills
    run = f"{num_layers} layers" if num_layers else "the model"
    update = [f"{len(event.new_tokens)} tokens appended"]
    update += [f"finished {event.finished}"] if event.finished else []
    update += [f"{event.num_free_blocks} blocks free"]
    schedule = f"{prefills} prefill chunk(s), {decodes} decode(s)"
    if event.admitted:
        schedule += f"\nadmitted {event.admitted}"
    if event.preempted:
        schedule += f"\npreempted {event.preempted}"
    return {"schedule": schedule,
            "layout": f"{event.num_tokens} tokens, {len(event.ran)} requests",
            "run": f"{run}, once over {event.num_tokens} tokens",
            "sample": f"{len(event.new_tokens)} new token(s)",
            "update": "\n".join(update)}


def draw_engine_loop(event=None, *, num_layers: int | None = None, title: str = "") -> Figure:
    """The engine's step as a loop of five boxes (:data:`LOOP`), each with the numbers of
    ``event`` (a recorded ``StepEvent``) when given."""
    import math

    facts = loop_facts(event, num_layers) if event is not None else {}
    fig = Figure(figsize=(10, 5.4), layout="constrained")
    ax = fig.subplots()
    ax.set_xlim(-1.75, 1.75)
    ax.set_ylim(-1.35, 1.35)
    ax.set_aspect("equal")
    ax.axis("off")
    centers = [(1.2 * math.sin(2 * math.pi * i / 5), 0.95 * math.cos(2 * math.pi * i / 5))
               for i in range(5)]
    for i, ((name, what), (x, y)) in enumerate(zip(LOOP, centers, strict=True)):
        ax.add_patch(FancyBboxPatch((x - 0.52, y - 0.32), 1.04, 0.62, boxstyle="round,pad=0.02",
                                    facecolor=f"C{i}", alpha=0.18, edgecolor=f"C{i}"))
        ax.text(x, y + 0.19, f"{i + 1} · {name}", ha="center", fontsize=10, weight="bold")
        ax.text(x, y + 0.03, what, ha="center", va="center", fontsize=7)
        if name in facts:
            ax.text(x, y - 0.12, facts[name], ha="center", va="top", fontsize=7, color="C3")
        nx, ny = centers[(i + 1) % 5]
        ax.add_patch(FancyArrowPatch((x + 0.55 * (nx - x) / 1.5, y + 0.55 * (ny - y) / 1.5),
                                     (nx - 0.55 * (nx - x) / 1.5, ny - 0.55 * (ny - y) / 1.5),
                                     arrowstyle="-|>", mutation_scale=14, color="0.3",
                                     connectionstyle="arc3,rad=-0.25"))
    head = f"step {event.step} of a run" if event is not None else "one engine step"
    ax.text(0, 0, title or head, ha="center", va="center", fontsize=9, style="italic")
    return fig
