"""The CUDA decode kernels' shared-memory layouts against their model (paged_course.banks):
the swizzle keeps each copied line whole and spreads the fragment reads over the banks, rows
of 64 bytes need one offset a thread, and the TMA-fed ring's token order and offsets; the
model's functions are the sources' (common.cuh's swizzled, int4_tma_decode.cu's row_token)."""

from __future__ import annotations

import itertools

import pytest

from paged_course import banks
from paged_ref.kernels.cuda import build


def source(name: str) -> str:
    return build.SOURCE.with_name(name).read_text()


def test_swizzle_is_the_kernels():
    assert banks.SWIZZLE_SOURCE in source("common.cuh")


def test_swizzle_keeps_each_line_whole():
    """Every 128-byte line of a tile (a line of the cache, copied by one instruction) stays one
    line of shared memory, its 16-byte chunks only permuted: the copies stay line-aligned.
    Rows padded by 16 bytes do not (the planted mistake this guards against)."""
    for row_bytes, line in itertools.product((32, 64, 128, 256), range(64)):
        chunks = sorted(banks.swizzled(128 * line + 16 * c, row_bytes) for c in range(8))
        assert chunks == [128 * line + 16 * c for c in range(8)]
        at = [128 * line + 16 * c for c in range(8)]
        assert all(banks.swizzled(a + b, row_bytes) == banks.swizzled(a, row_bytes) + b
                   for a in at for b in range(16))
    for row_bytes in (32, 64, 128, 256):
        assert banks.lines_stay_whole("swizzled", row_bytes)
        assert not banks.lines_stay_whole("padded", row_bytes)


def test_wavefront_count_sees_a_conflict():
    same_bank = [128 * lane for lane in range(32)]  # 32 lanes, one bank, 32 different words
    assert banks.wavefronts(same_bank, 4) == 32
    assert banks.wavefronts([4 * lane for lane in range(32)], 4) == 1  # 32 banks: one pass
    assert banks.wavefronts([16 * lane for lane in range(32)], 16) == 4  # 512 bytes: four


@pytest.mark.parametrize("kind", ["fp8", "int4"])
@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_swizzled_reads_conflict_no_more_than_padded_rows(kind, head_dim):
    """The fragment reads cost no more shared-memory wavefronts than with rows padded by 16
    bytes (the layout before), and the unswizzled, unpadded layout (the planted mistake)
    costs more where it matters (rows of 64 bytes and more)."""
    swz, padded, plain = (banks.step_wavefronts(kind, head_dim, layout)
                          for layout in ("swizzled", "padded", "plain"))
    assert swz <= padded
    row_bytes = head_dim if kind == "fp8" else head_dim // 2
    if row_bytes >= 64:
        assert plain > swz
    if row_bytes <= 128:  # all but FP8 head_dim 256: no conflict at all
        assert swz == banks.ideal_wavefronts(kind, head_dim)


def one_offset_rule_holds(place) -> bool:
    """What int4_decode relies on for rows of 64 bytes (INT4 head_dim 128; FragmentOffsets and
    Int4Copier): for every lane, row r + 8 lies 512 bytes past row r (K reads, copies) and
    row 2t + 1 at row 2t's offset ^ 64 (V reads), at each byte a lane reads or copies."""
    for lane in range(32):
        g, t = lane // 4, lane % 4
        k = place(g, t * 16)
        v = place(2 * t, g * 8)
        if place(g + 8, t * 16) != k + 512:
            return False
        if [place(2 * t + 1, g * 8), place(2 * t + 8, g * 8), place(2 * t + 9, g * 8)] != [
                v ^ 64, v + 512, (v ^ 64) + 512]:
            return False
        row0, piece = lane // 4, lane % 4  # (the copies: rows row0, row0 + 8)
        if place(row0 + 8, 16 * piece) != place(row0, 16 * piece) + 512:
            return False
    return True


def test_rows_of_64_bytes_need_one_offset_a_thread():
    assert one_offset_rule_holds(lambda r, b: banks.place("swizzled", r, b, 64))
    # the planted mistake: the 128-byte rows' pattern (c ^ n % 8) breaks the rule
    assert not one_offset_rule_holds(lambda r, b: banks.swizzled(64 * r + b, 128))


def test_tma_ring_reads_take_the_fewest_wavefronts_in_row_token_order():
    """Every head's fragment reads of a TMA tile take 24 wavefronts a tile when the MMA rows
    take the tokens as row_token says (K's conflict-free, V's two a group of lanes), the
    fewest of any order of the tile's first 8 rows (checked over all 40,320); in plain order
    (the planted mistake) 40, and with bits 0 and 1 swapped 32."""
    assert banks.ideal_wavefronts("int4", 128) == 16
    for head in range(build.TMA_HEADS):
        assert banks.tma_step_wavefronts(head) == 24
        assert banks.tma_step_wavefronts(head, order=lambda r: r) == 40
        assert banks.tma_step_wavefronts(
            head, order=lambda r: (r & ~3) | ((r & 1) << 1) | ((r >> 1) & 1)) == 32
    fewest = min(banks.tma_step_wavefronts(0, order=lambda r, p=p: p[r % 8] + r // 8 * 8)
                 for p in itertools.permutations(range(8)))
    assert fewest == 24
    assert sorted(map(banks.row_token, range(16))) == list(range(16))  # a permutation


def test_tma_ring_offsets_are_where_the_tma_unit_puts_the_rows():
    """The .cu's one-offset-a-thread formulas (mirrored in banks.tma_offsets) name the bytes
    of the rows each read wants: K rows g, g + 8 and V rows 2t + (j & 1) + 8 (j >> 1), as
    tokens row_token(row), 16 (K) or 8 (V) bytes at t * 16 and g * 8 of the head's 64."""
    assert ("int row_token(int r) { return r ^ ((r >> 1) & 1); }"  # the same order
            in source("int4_tma_decode.cu"))
    for head, lane in itertools.product(range(8), range(32)):
        g, t = lane // 4, lane % 4
        k_at, v_at = banks.tma_offsets(head, lane)
        for j in range(2):
            token = banks.row_token(8 * j + g)
            assert [k_at + 4096 * j + b for b in range(16)] == [
                banks.tma_place(token, head, 16 * t + b) for b in range(16)]
        for j in range(4):
            token = banks.row_token(2 * t + (j & 1) + 8 * (j >> 1))
            at = v_at[j & 1] + 4096 * (j >> 1)
            assert [at + b for b in range(8)] == [
                banks.tma_place(token, head, 8 * g + b) for b in range(8)]
