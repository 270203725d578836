"""Watch the serving engine's block tables step by step (lesson 09).

:class:`StepRecorder` is an ``on_step`` callback for :meth:`paged_ref.engine.Engine.generate`:
it keeps every :class:`~paged_ref.engine.StepEvent`. :func:`draw_step` draws one event with
lesson 02's :func:`~paged_course.viz.draw_block_tables` (requests -> blocks, the pool);
:meth:`StepRecorder.widget` is a slider (and play button) over the recorded steps.

    rec = StepRecorder()
    engine.generate(prompts, 16, on_step=rec)
    rec.widget()          # in a notebook; rec.figure(5) without widgets
    rec.table()           # one row per step: ran, admitted, preempted, finished, free blocks
"""

from __future__ import annotations

from matplotlib.figure import Figure

from paged_course.viz.blocks import draw_block_tables
from paged_course.viz.explorers import LiveWidget, png_bytes
from paged_ref.memory.manager import CacheStats


class _Snapshot:
    """The read-only part of a ``KVCacheManager`` that ``draw_block_tables`` reads."""

    def __init__(self, event) -> None:
        self.num_blocks, self.block_size = event.num_blocks, event.block_size
        self.seq_ids = sorted(event.block_tables)
        self._tables, self._lens = event.block_tables, event.seq_lens
        used = len({b for t in self._tables.values() for b in t})
        tokens = sum(self._lens.values())
        self._stats = CacheStats(
            num_blocks=self.num_blocks, block_size=self.block_size, blocks_used=used,
            blocks_free=self.num_blocks - used, tokens_stored=tokens,
            slots_reserved_empty=max(0, used * self.block_size - tokens),
            num_sequences=len(self.seq_ids))

    def block_table(self, seq_id):
        return list(self._tables[seq_id])

    def seq_len(self, seq_id):
        return self._lens[seq_id]

    def stats(self) -> CacheStats:
        return self._stats


def describe(event) -> str:
    """One line: what the step ran and what changed."""
    kinds = ["decode" if n == 1 else f"prefill {n}" for _, _, n in event.ran]
    parts = [f"step {event.step}: {len(event.ran)} requests, {event.num_tokens} tokens "
             f"({kinds.count('decode')} decodes)"]
    for name in ("admitted", "preempted", "finished"):
        ids = getattr(event, name)
        if ids:
            parts.append(f"{name} {ids}")
    if event.cached_tokens:
        parts.append(f"{event.cached_tokens} prompt tokens from the prefix cache")
    return "; ".join(parts)


def draw_step(event, *, pool_columns: int = 16) -> Figure:
    """The block tables and the pool after ``event``'s step (shared blocks: one owner drawn)."""
    return draw_block_tables(_Snapshot(event), title=describe(event), pool_columns=pool_columns,
                             arrows=False)


class StepRecorder:
    """Keeps the engine's step events; pass it as ``on_step``."""

    def __init__(self) -> None:
        self.events: list = []

    def __call__(self, event) -> None:
        self.events.append(event)

    def figure(self, step: int, **kw) -> Figure:
        return draw_step(self.events[step], **kw)

    def table(self) -> list[dict]:
        """One row per step (for ``tabulate`` or a DataFrame)."""
        return [{"step": e.step, "requests": len(e.ran), "tokens": e.num_tokens,
                 "admitted": e.admitted, "preempted": e.preempted, "finished": e.finished,
                 "free_blocks": e.num_free_blocks} for e in self.events]

    def widget(self, **kw):
        """A slider and a play button over the recorded steps, the picture below (a
        :class:`~paged_course.viz.explorers.LiveWidget`: a saved notebook shows step 0's
        picture, not a placeholder). Without ipywidgets (plain Python, a Jupyter without the
        extension's package), it says so and returns the last step's picture instead."""
        if not self.events:
            raise ValueError("no steps recorded: pass the recorder as on_step= to generate")
        try:
            import ipywidgets as w
            from IPython.display import Image, display
        except ImportError as err:
            print(f"no slider here ({err.name} is not installed: pip install ipywidgets); "
                  f"the last of {len(self.events)} steps:")
            return self.figure(len(self.events) - 1, **kw)

        out = w.Output()
        slider = w.IntSlider(0, 0, max(0, len(self.events) - 1), description="step")
        play = w.Play(min=0, max=slider.max, interval=700)
        w.jslink((play, "value"), (slider, "value"))

        def now() -> Figure:
            return self.figure(slider.value, **kw)

        def show(change=None):
            with out:
                out.clear_output(wait=True)
                display(Image(data=png_bytes(now(), dpi=70)))

        slider.observe(show, names="value")
        show()
        return LiveWidget(w.VBox([w.HBox([play, slider]), out]), now,
                          f"StepRecorder: {len(self.events)} steps", dpi=70)
