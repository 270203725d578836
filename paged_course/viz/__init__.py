"""The course's pictures, one module per topic; every name is also here.

    from paged_course import viz
    viz.draw_block_tables(manager)

- ``style`` (all lessons): request colours, a block drawn as slots;
- ``blocks`` (01-03): block tables, contiguous vs paged, token lookup, memory shares, the
  decode trace;
- ``kernels`` (00, 04, 05): masked programs, one program's walk, SM occupancy, what a kernel
  read;
- ``sharing`` (07): shared blocks and copy-on-write, the prefix tree;
- ``prefill`` (08): the causal mask with a cached prefix, tiles, the roofline;
- ``two_pools`` (11): two engines' pools and the blocks moving between them;
- ``explorers`` (02, 07): the interactive explorers (ipywidgets).

Every static picture is a pure function that returns a :class:`matplotlib.figure.Figure`
(never shown, never registered with pyplot), so a notebook displays it as a cell's value and
the same image appears on GitHub, in nbconvert HTML and in CI.
"""

from __future__ import annotations

from paged_course.viz.blocks import (
    draw_block_tables,
    draw_contiguous_vs_paged,
    draw_decode_trace,
    draw_memory_shares,
    draw_token_lookup,
)
from paged_course.viz.explorers import NUMBER_BOX_WIDTH, BlockTableExplorer, SharingExplorer
from paged_course.viz.kernels import (
    draw_masked_programs,
    draw_memory_reads,
    draw_program_walk,
    draw_running_max,
    draw_sm_occupancy,
    reads_from_probe,
)
from paged_course.viz.sharing import (
    CACHED_COLOR,
    COPY_COLOR,
    SHARED_EDGE,
    draw_prefix_tree,
    draw_shared_blocks,
)
from paged_course.viz.style import EMPTY_COLOR, FREE_COLOR, PALETTE, seq_color

__all__ = [
    "CACHED_COLOR", "COPY_COLOR", "EMPTY_COLOR", "FREE_COLOR", "NUMBER_BOX_WIDTH", "PALETTE",
    "SHARED_EDGE", "BlockTableExplorer", "SharingExplorer", "draw_block_tables",
    "draw_contiguous_vs_paged", "draw_decode_trace", "draw_masked_programs",
    "draw_memory_reads", "draw_memory_shares", "draw_prefix_tree", "draw_program_walk",
    "draw_running_max", "draw_shared_blocks", "draw_sm_occupancy", "draw_token_lookup",
    "reads_from_probe", "seq_color",
]
