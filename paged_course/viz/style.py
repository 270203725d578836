"""Shared drawing parts of the course's pictures: request colours, a block drawn as slots.

Every request keeps one colour in every picture (:func:`seq_color`); free blocks are grey
(:data:`FREE_COLOR`), empty slots white (:data:`EMPTY_COLOR`).
"""

from __future__ import annotations

import zlib
from collections.abc import Hashable

import matplotlib
from matplotlib.patches import Rectangle

#: Colours for requests (tab10 without its grey, which marks free blocks).
PALETTE = [c for i, c in enumerate(matplotlib.colormaps["tab10"].colors) if i != 7]
FREE_COLOR = "#d9d9d9"
EMPTY_COLOR = "#ffffff"


def seq_color(seq_id: Hashable):
    """The colour of request ``seq_id``: fixed per id, so it stays put as others come and go."""
    if isinstance(seq_id, int) and not isinstance(seq_id, bool):
        index = seq_id
    else:
        index = zlib.crc32(str(seq_id).encode())
    return PALETTE[index % len(PALETTE)]


def draw_block(ax, x, y, width, height, filled, block_size, color, *, gid, edge=None,
               cells=True, linewidth=1.6):
    """A block as ``block_size`` slot cells, the first ``filled`` of them coloured.

    Returns the outline rectangle (its gid is ``gid``). With ``cells=False``, or block sizes
    over 16, the filled part is one bar instead of separate cells.
    """
    edge = edge or color
    if cells and block_size <= 16:
        cell = width / block_size
        for s in range(block_size):
            ax.add_patch(Rectangle((x + s * cell, y), cell, height, linewidth=0.4,
                                   facecolor=color if s < filled else EMPTY_COLOR,
                                   edgecolor="white" if s < filled else "#bbbbbb"))
    else:
        ax.add_patch(Rectangle((x, y), width * filled / block_size, height, linewidth=0,
                               facecolor=color))
    outline = Rectangle((x, y), width, height, facecolor="none", edgecolor=edge,
                        linewidth=linewidth)
    outline.set_gid(gid)
    ax.add_patch(outline)
    return outline


def pct(part: int, whole: int) -> str:
    """``part`` as a whole-number percentage of ``whole`` ("n/a" when ``whole`` is 0)."""
    return "n/a" if whole == 0 else f"{100 * part / whole:.0f}%"
