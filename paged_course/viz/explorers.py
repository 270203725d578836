"""Interactive explorers: grow, finish, fork and share requests and watch the block tables.

:class:`BlockTableExplorer` (lesson 02) wraps a :class:`paged_ref.KVCacheManager` in ipywidgets
buttons; :class:`SharingExplorer` (lesson 07) adds forks, a shared system prompt and the prefix
tree. Their actions are plain methods (``start``, ``add_token``, ``add_tokens``, ``step``,
``finish``, ``reset``; ``fork``, ``ask``) that work without a display; in a notebook the
explorer shows the live widget and, for viewers without a kernel, the current picture as a PNG.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Hashable, Sequence

from matplotlib.figure import Figure

from paged_course.viz.blocks import draw_block_tables
from paged_course.viz.sharing import draw_prefix_tree, draw_shared_blocks
from paged_ref.cache_math import blocks_needed
from paged_ref.memory.allocator import OutOfBlocksError
from paged_ref.memory.manager import KVCacheManager

#: Width of the explorer's number boxes (label + 5 digits + the spinner arrows).
NUMBER_BOX_WIDTH = "190px"


def png_bytes(fig: Figure, dpi: int = 80) -> bytes:
    """``fig`` as PNG bytes (whatever matplotlib backend the kernel has)."""
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=dpi)
    return png.getvalue()


class LiveWidget:
    """An ipywidgets app that also carries a picture of what it shows now.

    In a notebook it displays one output holding both: JupyterLab shows the live widget;
    GitHub, nbconvert and a notebook saved without widget state show the PNG
    (tools/execute_notebooks.py keeps only that part) instead of a placeholder text.

    widget:  the ipywidgets app
    picture: returns the Figure the widget shows now
    text:    the output's plain-text form
    """

    def __init__(self, widget, picture: Callable[[], Figure], text: str, *, dpi: int = 80):
        self.widget, self.picture, self.text, self.dpi = widget, picture, text, dpi

    def _ipython_display_(self) -> None:
        from IPython.display import display

        bundle = self.widget._repr_mimebundle_()
        bundle["image/png"] = png_bytes(self.picture(), dpi=self.dpi)
        bundle["text/plain"] = self.text
        display(bundle, raw=True)


class BlockTableExplorer:
    """Grow, finish and start requests in a small KV cache and watch the block tables.

        explorer = BlockTableExplorer(num_blocks=32, block_size=4)
        explorer            # in a notebook: the buttons and the live picture
        explorer.add_token(0); explorer.figure()   # the same without widgets

    Actions return ``True`` when they changed the cache and ``False`` otherwise (out of
    blocks, unknown request, bad count); :attr:`message` says what happened. Out of blocks
    never changes anything. Request ids are 0, 1, 2, ... in the order started.
    """

    def __init__(self, num_blocks: int = 32, block_size: int = 4,
                 prompts: Sequence[int] = (6, 3, 9), *, pool_columns: int = 8) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prompts = tuple(prompts)
        self.pool_columns = pool_columns
        self._widget = None
        self.reset()

    # ---- actions (no display needed) ----------------------------------------------------------

    def reset(self) -> None:
        """Empty the cache and start the initial requests again."""
        self.manager = KVCacheManager(self.num_blocks, self.block_size)
        self._next_id = 0
        for p in self.prompts:
            self.start(p)
        self.message = f"reset: {len(self.manager)} requests, prompts {list(self.prompts)}"
        self._refresh()

    def start(self, prompt_len: int) -> int | None:
        """Start a new request with a prompt of ``prompt_len`` tokens; return its id or None."""
        seq_id = self._next_id
        try:
            self.manager.add_sequence(seq_id, prompt_len)
        except (OutOfBlocksError, ValueError, TypeError) as err:
            self.message = f"cannot start a request of {prompt_len} tokens: {err}"
            self._refresh()
            return None
        self._next_id += 1
        table = self.manager.block_table(seq_id)
        self.message = f"started req {seq_id}: {prompt_len} prompt tokens in blocks {table}"
        self._refresh()
        return seq_id

    def add_token(self, seq_id: Hashable) -> bool:
        """Append one token to request ``seq_id`` (a decode step for that request)."""
        return self.add_tokens(seq_id, 1)

    def add_tokens(self, seq_id: Hashable, n: int) -> bool:
        """Append ``n`` tokens to request ``seq_id``, all or nothing."""
        if seq_id not in self.manager:
            self.message = f"no request {seq_id!r}"
        elif n < 1:
            self.message = f"add at least one token (got {n})"
        else:
            length = self.manager.seq_len(seq_id)
            have = len(self.manager.block_table(seq_id))
            need = blocks_needed(length + n, self.block_size) - have
            if need > self.manager.num_free_blocks:
                self.message = (f"OUT OF BLOCKS: req {seq_id} needs {need} new block(s) for "
                                f"{n} more token(s) but only {self.manager.num_free_blocks} "
                                f"are free. Nothing changed; finish a request to free blocks.")
            else:
                slots = [self.manager.append_slot(seq_id) for _ in range(n)]
                shown = slots if n <= 4 else [*slots[:2], "...", slots[-1]]
                self.message = (f"req {seq_id}: +{n} token(s) → length {length + n}, slots "
                                f"{shown}, new blocks: {need}")
                self._refresh()
                return True
        self._refresh()
        return False

    def step(self) -> bool:
        """One decode step: one token for every request at once (all or nothing)."""
        seqs = self.manager.seq_ids
        if not seqs:
            self.message = "no requests to step"
            self._refresh()
            return False
        try:
            slots = self.manager.append_slots(seqs)
        except OutOfBlocksError as err:
            self.message = f"OUT OF BLOCKS: {err}. Nothing changed; finish a request."
            self._refresh()
            return False
        self.message = f"decode step: slot mapping {slots}"
        self._refresh()
        return True

    def finish(self, seq_id: Hashable) -> bool:
        """Finish request ``seq_id``: all its blocks go back to the pool."""
        if seq_id not in self.manager:
            self.message = f"no request {seq_id!r}"
            self._refresh()
            return False
        table = self.manager.block_table(seq_id)
        self.manager.free_sequence(seq_id)
        self.message = self._finished(seq_id, table)
        self._refresh()
        return True

    def _finished(self, seq_id: Hashable, table: list[int]) -> str:
        """The message after ``seq_id`` (which held ``table``) is freed."""
        return f"finished req {seq_id}: blocks {table} are free again"

    def figure(self) -> Figure:
        """The current picture (:func:`draw_block_tables`)."""
        return draw_block_tables(self.manager, pool_columns=self.pool_columns)

    # ---- widgets ------------------------------------------------------------------------------

    @property
    def widget(self):
        """The ipywidgets app (built on first use)."""
        if self._widget is None:
            self._build_widget()
            self._refresh()
        return self._widget

    def _ipython_display_(self):
        """The live widget, plus the current picture as a PNG for viewers without a kernel.

        JupyterLab shows the widget; GitHub, nbconvert and a notebook whose widget state was
        not saved show the PNG (tools/execute_notebooks.py keeps only that part).
        """
        LiveWidget(self.widget, self.figure, f"{type(self).__name__}: {self.message}",
                   dpi=80)._ipython_display_()

    def _png(self) -> bytes:
        return png_bytes(self.figure(), dpi=80)

    def _build_widget(self) -> None:
        import ipywidgets as w

        self._request = w.Dropdown(description="request", layout=w.Layout(width="160px"))
        # The label gets its own width ("initial": as wide as its text), so the number box
        # keeps room for 5 digits (with the default label width, "200" showed as "2").
        label = {"description_width": "initial"}
        self._count = w.BoundedIntText(value=4, min=1, max=10_000, description="N",
                                       style=label, layout=w.Layout(width=NUMBER_BOX_WIDTH))
        self._prompt = w.BoundedIntText(value=5, min=0, max=10_000, description="prompt",
                                        style=label, layout=w.Layout(width=NUMBER_BOX_WIDTH))
        buttons = {
            "+1 token": lambda _: self.add_token(self._request.value),
            "+N tokens": lambda _: self.add_tokens(self._request.value, self._count.value),
            "finish": lambda _: self.finish(self._request.value),
            "decode step (all)": lambda _: self.step(),
            "start new request": lambda _: self.start(self._prompt.value),
            "reset": lambda _: self.reset(),
        }
        made = {}
        for label, action in buttons.items():
            b = w.Button(description=label, layout=w.Layout(width="auto"))
            b.on_click(action)
            made[label] = b
        self._status = w.HTML()
        self._out = w.Output()
        self._widget = w.VBox([
            w.HBox([self._request, made["+1 token"], self._count, made["+N tokens"],
                    made["finish"]]),
            w.HBox([made["decode step (all)"], self._prompt, made["start new request"],
                    made["reset"]]),
            self._status,
            self._out,
        ])

    def _refresh(self) -> None:
        if self._widget is None:
            return
        from IPython.display import Image, display

        seqs = self.manager.seq_ids
        current = self._request.value
        self._request.options = [(f"req {s}", s) for s in seqs]
        if seqs:  # keep the chosen request while it lives, else the oldest one
            self._request.value = current if current in seqs else seqs[0]
        colour = "#b00020" if self.message.startswith(("OUT", "cannot")) else "#333333"
        self._status.value = f"<b style='color:{colour}'>{self.message}</b>"
        with self._out:
            self._out.clear_output(wait=True)
            display(Image(data=self._png()))


class SharingExplorer(BlockTableExplorer):
    """:class:`BlockTableExplorer` with sharing: fork a request, start requests that share a
    system prompt (prefix cache), and watch copy-on-write and the prefix tree.

        ex = SharingExplorer(num_blocks=24, block_size=4, system_prompt_len=8)
        ex.ask(3)        # a request: the system prompt + 3 new tokens (prefix-cache lookup)
        ex.fork(0)       # request 0 forks (parallel sampling): every block shared
        ex.add_token(1)  # the fork writes into the shared last block: copy-on-write
        ex.figure()      # tables + pool (shared blocks, the copy) and the prefix tree

    Token ids are made up: the system prompt is ``1 .. system_prompt_len``; every other token
    is a fresh id, so only the system prompt (and forks) are shared.
    """

    def __init__(self, num_blocks: int = 24, block_size: int = 4, prompts: Sequence[int] = (),
                 *, system_prompt_len: int = 8, enable_prefix_caching: bool = True,
                 pool_columns: int = 8) -> None:
        self.system_prompt = list(range(1, system_prompt_len + 1))
        self.enable_prefix_caching = enable_prefix_caching
        self.copies: list[tuple[int, int]] = []
        self._next_token = 1000
        super().__init__(num_blocks, block_size, prompts, pool_columns=pool_columns)

    def _fresh_tokens(self, n: int) -> list[int]:
        self._next_token += n
        return list(range(self._next_token - n, self._next_token))

    def reset(self) -> None:
        """Empty the cache (and the prefix cache) and start the initial requests again."""
        self.manager = KVCacheManager(self.num_blocks, self.block_size,
                                      enable_prefix_caching=self.enable_prefix_caching)
        self._next_id, self.copies = 0, []
        for p in self.prompts:
            self.start(p)
        self.message = f"reset: {len(self.manager)} requests"
        self._refresh()

    def start(self, prompt_len: int) -> int | None:
        """Start a request of ``prompt_len`` fresh tokens (shares nothing)."""
        return self.start_tokens(self._fresh_tokens(prompt_len)) if prompt_len else None

    def ask(self, question_len: int) -> int | None:
        """Start a request: the system prompt + ``question_len`` fresh tokens."""
        return self.start_tokens(self.system_prompt + self._fresh_tokens(question_len))

    def start_tokens(self, token_ids: Sequence[int]) -> int | None:
        """Start a request with these token ids; with prefix caching, reuse cached blocks."""
        seq_id = self._next_id
        try:
            cached = self.manager.add_sequence(seq_id, token_ids=list(token_ids))
        except (OutOfBlocksError, ValueError, TypeError) as err:
            self.message = f"cannot start a request of {len(token_ids)} tokens: {err}"
            self._refresh()
            return None
        self._next_id += 1
        self.copies = []
        self.message = (f"started req {seq_id}: {len(token_ids)} prompt tokens, {cached} "
                        f"found in the prefix cache (blocks shared, not computed), blocks "
                        f"{self.manager.block_table(seq_id)}")
        self._refresh()
        return seq_id

    def fork(self, seq_id: Hashable) -> int | None:
        """Fork request ``seq_id`` (one more sample of it): the child shares every block."""
        if seq_id not in self.manager:
            self.message = f"no request {seq_id!r}"
            self._refresh()
            return None
        child = self._next_id
        self.manager.fork(seq_id, child)
        self._next_id += 1
        self.copies = []
        table = self.manager.block_table(child)
        self.message = (f"forked req {seq_id} → req {child}: blocks {table} shared, no K/V "
                        f"copied; holders now {[self.manager.ref_count(b) for b in table]}")
        self._refresh()
        return child

    def add_tokens(self, seq_id: Hashable, n: int) -> bool:
        """Append ``n`` tokens to ``seq_id``, all or nothing; a write into a shared last block
        is a copy-on-write (shown in red)."""
        if seq_id not in self.manager or n < 1:
            self.message = f"no request {seq_id!r}" if n >= 1 else f"add at least one token ({n})"
            self._refresh()
            return False
        m, length = self.manager, self.manager.seq_len(seq_id)
        table = m.block_table(seq_id)
        need = blocks_needed(length + n, self.block_size) - len(table)
        need += length % self.block_size != 0 and m.ref_count(table[-1]) > 1
        if need > m.num_free_blocks:
            self.message = (f"OUT OF BLOCKS: req {seq_id} needs {need} new block(s) but only "
                            f"{m.num_free_blocks} are free. Nothing changed.")
            self._refresh()
            return False
        for token in self._fresh_tokens(n):
            m.append_slot(seq_id, token)
        self.copies = m.take_copies()
        done = f"copy-on-write {self.copies}" if self.copies else "no copy"
        self.message = f"req {seq_id}: +{n} token(s) → length {length + n}, {done}"
        self._refresh()
        return True

    def step(self) -> bool:
        """One decode step for every request (all or nothing); copy-on-writes shown in red."""
        seqs = self.manager.seq_ids
        try:
            self.manager.append_slots(seqs, self._fresh_tokens(len(seqs)))
        except OutOfBlocksError as err:
            self.message = f"OUT OF BLOCKS: {err}. Nothing changed; finish a request."
            self._refresh()
            return False
        self.copies = self.manager.take_copies()
        self.message = f"decode step for {len(seqs)} requests, copy-on-writes {self.copies}"
        self._refresh()
        return bool(seqs)

    def finish(self, seq_id: Hashable) -> bool:
        """Finish ``seq_id``: each block loses a holder; cached ones stay, evictable."""
        self.copies = []
        return super().finish(seq_id)

    def _finished(self, seq_id: Hashable, table: list[int]) -> str:
        holders = [self.manager.ref_count(b) for b in table]
        return (f"finished req {seq_id}: blocks {table} lost a holder (now {holders}); "
                f"full blocks nobody holds stay cached until the pool needs them")

    def figure(self) -> Figure:
        """Tables + pool (shared blocks, the last copy-on-write) above the prefix tree."""
        fig = Figure(figsize=(12, 4.2 + 0.62 * max(len(self.manager), -(-self.num_blocks
                                                                        // self.pool_columns))),
                     layout="constrained")
        top, bottom = fig.subfigures(2, 1, height_ratios=[1.6, 1])
        draw_shared_blocks(self.manager, copies=self.copies, pool_columns=self.pool_columns,
                           fig=top)
        draw_prefix_tree(self.manager, fig=bottom)
        return fig

    def _build_widget(self) -> None:
        import ipywidgets as w

        super()._build_widget()
        fork = w.Button(description="fork (one more sample)", layout=w.Layout(width="auto"))
        fork.on_click(lambda _: self.fork(self._request.value))
        ask = w.Button(description="ask: system prompt + N tokens",
                       layout=w.Layout(width="auto"))
        ask.on_click(lambda _: self.ask(self._count.value))
        rows = list(self._widget.children)
        self._widget.children = (*rows[:2], w.HBox([fork, ask]), *rows[2:])
