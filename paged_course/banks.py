"""Shared-memory banks and cache lines for the CUDA decode kernels' tiles (lesson 10).

The kernels (``paged_ref/kernels/cuda/``) copy each 16-token tile of K and V into
shared memory, 16 bytes a lane, then each thread reads its MMA fragments back. Two things
decide whether that is fast, and both can be counted on paper:

* **bank conflicts** of the fragment reads: shared memory has 32 banks of 4 bytes; a warp's
  16-byte loads are served 8 lanes at a time (8-byte ones 16, 4-byte ones 32), and two lanes
  of a group that touch *different* words of one bank cost an extra pass (a wavefront);
* **whole lines**: the L2 serves the copy one request per 128-byte shared-memory line it
  lands in, so a cache line that lands across two lines costs two requests.

Three layouts of a tile whose rows are ``row_bytes`` long: ``"plain"`` (rows one after
another), ``"padded"`` (each row ``row_bytes + 16`` apart: the usual cure for conflicts) and
``"swizzled"`` (rows one after another, the 16-byte chunks of each 128-byte line permuted:
chunk ``c`` of line ``n`` at ``c ^ (n % 8)`` for rows of 128 bytes or more, at
``c ^ 2 (n % 4)`` for shorter rows; :func:`swizzled`, what the kernels use).
``tests/kernels/cuda/test_banks.py`` checks :func:`swizzled` is ``common.cuh``'s.

    from paged_course import banks
    banks.table()     # wavefronts of every format / head_dim / layout, and whole lines
"""

from __future__ import annotations

LAYOUTS = ("plain", "padded", "swizzled")
#: The .cu's swizzled<ROW>(), verbatim: rows shorter than 128 bytes, then the others.
SWIZZLE_SOURCE = ("if constexpr (ROW < 128) return at ^ (((at >> 7) & 3) << 5);\n"
                  "  return at ^ (((at >> 7) & 7) << 4);")


def swizzled(at: int, row_bytes: int = 128) -> int:
    """Where logical byte ``at`` of a tile of ``row_bytes``-byte rows lives: chunk c of
    128-byte line n at c ^ (n % 8), or c ^ 2 (n % 4) when rows are shorter than 128 bytes
    (two or more a line: then the pattern depends on bits 1-2 of a 64-byte row, so a thread's
    reads of rows r and r + 8 are 512 bytes apart whatever r is)."""
    if row_bytes < 128:
        return at ^ (((at >> 7) & 3) << 5)
    return at ^ (((at >> 7) & 7) << 4)


def place(layout: str, row: int, byte: int, row_bytes: int) -> int:
    """Shared-memory byte of ``byte`` of tile row ``row`` in ``layout``."""
    if layout == "plain":
        return row * row_bytes + byte
    if layout == "padded":
        return row * (row_bytes + 16) + byte
    if layout == "swizzled":
        return swizzled(row * row_bytes + byte, row_bytes)
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def wavefronts(addresses: list[int], size: int) -> int:
    """Wavefronts of one warp-wide shared-memory load of ``size`` bytes a lane (4, 8 or 16):
    per group of lanes served together, the most distinct 4-byte words in one bank."""
    per_group = {4: 32, 8: 16, 16: 8}[size]
    total = 0
    for first in range(0, 32, per_group):
        banks: dict[int, set[int]] = {}
        for at in addresses[first:first + per_group]:
            for word in range(at // 4, (at + size) // 4):
                banks.setdefault(word % 32, set()).add(word)
        total += max(len(words) for words in banks.values())
    return total


def fragment_reads(kind: str, head_dim: int) -> tuple[int, list[tuple[int, list[tuple]]]]:
    """``(row_bytes, [(size, [(row, byte) of lane 0..31]), ...])``: the shared-memory loads of
    one tile step, as the kernels' ``read_words`` calls make them (lane = 4 g + t): K rows
    ``8 j + g`` at ``t x`` (bytes a thread reads), V rows ``2t + (j & 1) + 8 (j >> 1)`` at
    ``g x`` (...); 16 bytes a load at most. ``kind``: ``"fp8"`` (a byte a channel) or
    ``"int4"`` (two channels a byte)."""
    if kind not in ("fp8", "int4"):
        raise ValueError(f"kind must be 'fp8' or 'int4', got {kind!r}")
    row = head_dim if kind == "fp8" else head_dim // 2
    k_bytes, v_bytes = (head_dim // 4, head_dim // 8) if kind == "fp8" else (
        head_dim // 8, head_dim // 16)
    reads = []
    for j in range(2):
        for piece in range(0, k_bytes, 16):
            reads.append((min(k_bytes, 16), [(8 * j + lane // 4, lane % 4 * k_bytes + piece)
                                             for lane in range(32)]))
    for j in range(4):
        for piece in range(0, v_bytes, 16):
            reads.append((min(v_bytes, 16), [(2 * (lane % 4) + (j & 1) + 8 * (j >> 1),
                                              lane // 4 * v_bytes + piece) for lane in range(32)]))
    return row, reads


def step_wavefronts(kind: str, head_dim: int, layout: str) -> int:
    """Wavefronts of one tile step's fragment reads in ``layout``."""
    row, reads = fragment_reads(kind, head_dim)
    return sum(wavefronts([place(layout, r, b, row) for r, b in lanes], size)
               for size, lanes in reads)


def ideal_wavefronts(kind: str, head_dim: int) -> int:
    """The fewest a step's loads can take (no conflicts): size / 4 per load."""
    return sum(size // 4 for size, _ in fragment_reads(kind, head_dim)[1])


def lines_stay_whole(layout: str, row_bytes: int, rows: int = 16) -> bool:
    """Does every 128-byte line of the cache (a whole row when ``row_bytes`` is 128, or a
    128-byte part of a longer one) land in one 128-byte line of shared memory?"""
    for r in range(rows):
        for start in range(0, row_bytes, 128):
            ends = {place(layout, r, b, row_bytes) // 128
                    for b in range(start, min(start + 128, row_bytes), 16)}
            if len(ends) != 1:
                return False
    return True


def table() -> list[dict]:
    """Every format and head_dim the kernels take: each layout's wavefronts a tile step (and
    the ideal), and whether cache lines stay whole."""
    rows = []
    for kind in ("fp8", "int4"):
        for head_dim in (64, 128, 256):
            row_bytes = head_dim if kind == "fp8" else head_dim // 2
            rows.append(dict(kind=kind, head_dim=head_dim, row_bytes=row_bytes,
                             ideal=ideal_wavefronts(kind, head_dim),
                             **{layout: step_wavefronts(kind, head_dim, layout)
                                for layout in LAYOUTS},
                             **{f"{layout}_lines_whole": lines_stay_whole(layout, row_bytes)
                                for layout in LAYOUTS}))
    return rows


# --- the TMA-fed INT4 kernel's ring (int4_decode_tma: head_dim 128, 8 heads a CTA) -------
#
# The TMA unit writes a tile of all 8 heads as 16 tokens x 4 head pairs x 128 bytes, 128-byte
# swizzled (16-byte chunk c of 128-byte row r at c ^ (r % 8)). A warp reads one head: half of
# each row. The swizzle of row 4 token + pair depends on the token's parity only, so lanes
# served together conflict unless they read tokens of both parities: the MMA rows take the
# tokens in the order of :func:`row_token` (bit 0 flipped where bit 1 is set). K's reads are
# then conflict-free and V's take twice the ideal (four tokens a group, two of each parity):
# 24 wavefronts a tile, the fewest any order of the rows gets (16 with no conflict at all).

def tma_place(token: int, head: int, byte: int) -> int:
    """Shared-memory byte of ``byte`` (0..63) of ``head``'s row of ``token`` in a TMA tile."""
    at = 128 * (4 * token + head // 2) + 64 * (head % 2) + byte
    return at ^ (((at >> 7) & 7) << 4)


def row_token(row: int) -> int:
    """The token of MMA row ``row`` (0..15) in int4_decode_tma (the .cu's row_token)."""
    return row ^ ((row >> 1) & 1)


def tma_step_wavefronts(head: int, order=row_token) -> int:
    """Wavefronts of one tile step's fragment reads of ``head`` in a TMA tile, the MMA rows
    taking tokens ``order(row)`` (:func:`row_token`, or e.g. ``lambda r: r``)."""
    _, reads = fragment_reads("int4", 128)
    return sum(wavefronts([tma_place(order(r), head, b) for r, b in lanes], size)
               for size, lanes in reads)


def tma_offsets(head: int, lane: int) -> tuple[int, list[int]]:
    """The .cu's ``k_at`` and ``v_at[e]`` (less the ring's base; v_at from the V tile) for
    ``lane`` of the warp of ``head``, by its formulas: K rows g, g + 8 at k_at + 4096 j; V
    rows 2t + e + 8 (j >> 1), e = j & 1, at v_at[e] + 4096 (j >> 1)."""
    g, t, pair, side = lane // 4, lane % 4, head // 2, head % 2
    k_token = row_token(g)
    k_at = (4 * k_token + pair) * 128 + ((4 * side + t) ^ (4 * (k_token & 1) + pair)) * 16
    v_at = []
    for e in range(2):
        v_token = row_token(2 * t + e)
        v_at.append((4 * v_token + pair) * 128
                    + ((4 * side + g // 2) ^ (4 * (v_token & 1) + pair)) * 16 + (g % 2) * 8)
    return k_at, v_at
