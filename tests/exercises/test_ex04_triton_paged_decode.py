"""Checks for lesson 04's exercises (a Triton paged decode kernel), on fresh random inputs.

Run against the worked solutions (default) or your file:
``pytest tests/exercises/test_ex04_triton_paged_decode.py --impl exercises``.
In the notebook: ``course.check("ex04_triton_paged_decode", keyword="load_kv_tile")``.

The Triton tests run in Triton's interpreter on a CPU (slow, so the sizes are tiny) and
compiled on a GPU.
"""

# ruff: noqa: E741  (m, l, acc: the running max, sum and output, as in the FlashAttention papers)

from __future__ import annotations

import math
import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from paged_ref import _device
from paged_course.checks import assert_close, assert_equal
from paged_course.testing import make_paged_inputs
from tests.conftest import load_exercise, run_kernel
from tests.exercises.isolated import run_script

DEVICE = _device.triton_device()
ROOT = Path(__file__).resolve().parents[2]
NAME = "ex04_triton_paged_decode"

needs_triton = pytest.mark.skipif(not _device.HAS_TRITON, reason="triton is not installed")


@pytest.fixture
def ex(request):
    return load_exercise(request.config, NAME)


# ---- Exercise 4.1: online_softmax_update --------------------------------------------------------


def _start(groups, head_dim):
    return (torch.full((groups,), -math.inf), torch.zeros(groups), torch.zeros(groups, head_dim))


def test_online_update_docstring_example(ex):
    m, l, acc = _start(1, 1)
    m, l, acc = ex.online_softmax_update(m, l, acc, torch.tensor([[0.0, math.log(3)]]),
                                         torch.tensor([[4.0], [8.0]]))
    assert_close(m, torch.tensor([math.log(3)], dtype=torch.float64), name="m after tile 1")
    assert_close(l, torch.tensor([4 / 3], dtype=torch.float64), name="l after tile 1")
    assert_close(acc, torch.tensor([[28 / 3]], dtype=torch.float64), name="acc after tile 1")
    m, l, acc = ex.online_softmax_update(m, l, acc, torch.tensor([[math.log(3)]]),
                                         torch.tensor([[2.0]]))
    assert_close(l, torch.tensor([7 / 3], dtype=torch.float64), name="l after tile 2")
    assert_close(acc / l[:, None], torch.tensor([[34 / 7]], dtype=torch.float64),
                 name="acc / l after tile 2")


def _fold(ex, scores, v, tile):
    """Run the update tile by tile; check m and l after every tile; return acc / l."""
    groups, length = scores.shape
    m, l, acc = _start(groups, v.shape[1])
    s64 = scores.double()
    for t0 in range(0, length, tile):
        m, l, acc = ex.online_softmax_update(m, l, acc, scores[:, t0:t0 + tile], v[t0:t0 + tile])
        seen = s64[:, : t0 + tile]
        want_m = seen.max(dim=1).values
        assert_equal(m, want_m.float(), name=f"m (running max) after tokens 0..{t0 + tile - 1}")
        assert_close(l, torch.exp(seen - want_m[:, None]).sum(dim=1),
                     name=f"l (sum of exp(score - m)) after tokens 0..{t0 + tile - 1}")
    return acc / l[:, None]


@pytest.mark.parametrize(
    "groups, head_dim, length, tile, spread",
    [(4, 8, 12, 12, 1.0), (4, 8, 23, 5, 1.0), (3, 4, 9, 1, 1.0), (2, 16, 40, 8, 150.0)],
    ids=["one_tile", "tiles_of_5", "tiles_of_1", "large_scores"],
)
def test_online_update_matches_two_pass(ex, groups, head_dim, length, tile, spread):
    """Tile by tile must equal softmax(scores) @ v computed in one go (float64)."""
    gen = torch.Generator().manual_seed(41 + length)
    scores = torch.randn(groups, length, generator=gen) * spread  # 150: exp overflows unless
    v = torch.randn(length, head_dim, generator=gen)              # the max is subtracted
    out = _fold(ex, scores, v, tile)
    expected = torch.softmax(scores.double(), dim=1) @ v.double()
    assert_close(out, expected, name=f"acc / l after all tiles (tile = {tile})")


def test_online_update_rescales_when_the_max_grows(ex):
    """Scores that rise tile after tile: every tile brings a new max."""
    gen = torch.Generator().manual_seed(42)
    scores = torch.sort(torch.randn(3, 24, generator=gen) * 20, dim=1).values
    v = torch.randn(24, 8, generator=gen)
    out = _fold(ex, scores, v, 4)
    assert_close(out, torch.softmax(scores.double(), dim=1) @ v.double(), name="acc / l")


def test_online_update_masked_tokens(ex):
    """-inf scores (masked tokens) get zero weight."""
    gen = torch.Generator().manual_seed(43)
    scores = torch.randn(4, 16, generator=gen)
    v = torch.randn(16, 8, generator=gen)
    masked = torch.rand(16, generator=gen) < 0.4
    masked[0] = False
    scores[:, masked] = -math.inf
    v[masked] = 0.0
    out = _fold(ex, scores, v, 4)
    keep = ~masked
    expected = torch.softmax(scores[:, keep].double(), dim=1) @ v[keep].double()
    assert_close(out, expected, name="acc / l with masked tokens")


def test_online_update_all_masked_tile_changes_nothing(ex):
    """A first tile with every score -inf: the state stays (-inf, 0, 0), never NaN."""
    m, l, acc = _start(2, 4)
    m, l, acc = ex.online_softmax_update(m, l, acc, torch.full((2, 3), -math.inf),
                                         torch.zeros(3, 4))
    for name, got in (("m", m), ("l", l), ("acc", acc)):
        assert not got.isnan().any(), f"{name} has NaN after an all -inf tile: {got.tolist()}"
    assert_equal(m, torch.full((2,), -math.inf), name="m after an all -inf tile")
    assert_equal(l, torch.zeros(2), name="l after an all -inf tile")
    assert_equal(acc, torch.zeros(2, 4), name="acc after an all -inf tile")
    gen = torch.Generator().manual_seed(44)
    scores, v = torch.randn(2, 5, generator=gen), torch.randn(5, 4, generator=gen)
    m, l, acc = ex.online_softmax_update(m, l, acc, scores, v)
    assert_close(acc / l[:, None], torch.softmax(scores.double(), 1) @ v.double(),
                 name="acc / l after a real tile")


def test_online_update_leaves_its_arguments_alone(ex):
    gen = torch.Generator().manual_seed(45)
    m, l, acc = torch.randn(3, generator=gen), torch.rand(3, generator=gen) + 1, torch.randn(3, 4)
    scores, v = torch.randn(3, 6, generator=gen) + 2, torch.randn(6, 4, generator=gen)
    before = [t.clone() for t in (m, l, acc, scores, v)]
    ex.online_softmax_update(m, l, acc, scores, v)
    for name, old, new in zip(("m", "l", "acc", "scores", "v"), before, (m, l, acc, scores, v),
                              strict=True):
        assert torch.equal(old, new), f"online_softmax_update modified its argument {name}"


# ---- Exercise 4.2: load_kv_tile -----------------------------------------------------------------


def _expected_tile(cache, table_row, seq_len, kv_head, start, tile):
    """[tile, HEAD_DIM_PAD] float64: real rows for tokens < seq_len, zeros elsewhere."""
    block_size, head_dim = cache.shape[1], cache.shape[3]
    pad = max(16, 1 << (head_dim - 1).bit_length())
    out = torch.zeros(tile, pad, dtype=torch.float64)
    for i in range(tile):
        t = start + i
        if t < seq_len:
            out[i, :head_dim] = cache[int(table_row[t // block_size]), t % block_size,
                                      kv_head].double().cpu()
    return out


@needs_triton
def test_load_kv_tile_docstring_example(ex):
    gen = torch.Generator().manual_seed(46)
    cache = torch.randn(8, 4, 2, 16, generator=gen).to(DEVICE)
    tables = torch.tensor([[7, 2, -1]], dtype=torch.int32, device=DEVICE)
    lens = torch.tensor([6], dtype=torch.int32, device=DEVICE)
    got = run_kernel(ex.gather_kv_tile, cache, tables, lens, 0, 1, 4, tile=4)
    expected = torch.zeros(4, 16, dtype=torch.float64)
    expected[0], expected[1] = cache[2, 0, 1].double().cpu(), cache[2, 1, 1].double().cpu()
    assert_close(got, expected, name="tile for tokens 4..7 (block 2, then past the end)")


@needs_triton
@pytest.mark.parametrize(
    "seq_lens, block_size, head_dim, dtype, b, kv_head, start, tile",
    [([37, 20], 16, 64, torch.float32, 0, 1, 32, 16),   # straddles the end of the sequence
     ([37, 20], 16, 64, torch.float32, 1, 0, 16, 16),   # runs past the table row's width
     ([9, 30], 4, 80, torch.float16, 1, 1, 0, 32),      # spans 8 blocks; 80 of 128 columns
     ([5, 12], 1, 80, torch.bfloat16, 1, 0, 0, 16),     # one token per block
     ([16, 3], 16, 64, torch.float32, 1, 1, 0, 16)],    # a short sequence: mostly masked
    ids=["straddle_end", "past_table", "bs4_d80_f16", "bs1_bf16", "short"],
)
def test_load_kv_tile_matches_the_table(ex, seq_lens, block_size, head_dim, dtype, b, kv_head,
                                        start, tile):
    inp = make_paged_inputs(seq_lens, num_q_heads=4, num_kv_heads=2, head_dim=head_dim,
                            block_size=block_size, dtype=dtype, device=DEVICE, poison="nan",
                            seed=47 + block_size + start)
    got = run_kernel(ex.gather_kv_tile, inp.k_cache, inp.block_tables, inp.seq_lens, b, kv_head,
                     start, tile=tile)
    assert got.dtype == dtype, f"the tile should keep the cache's dtype {dtype}, got {got.dtype}"
    expected = _expected_tile(inp.k_cache, inp.block_tables[b].tolist(), seq_lens[b], kv_head,
                              start, tile)
    assert_close(got, expected, rel_tol=0.0,
                 name=f"tile of sequence {b}, KV head {kv_head}, tokens {start}..{start + tile - 1}"
                      f" (rows past token {seq_lens[b] - 1} and columns past {head_dim - 1}: 0)")


# The probes below run in a process of their own (a wrong kernel there crashes the process
# instead of raising). They load the exercise module from its file, whichever that is (yours, the solution,
# or a mutant planted by tests/mutations).
_PROBE_HEADER = '''
import importlib.util
import sys
import torch
import paged_ref  # noqa: F401  (interpreter on a CPU)
import triton
import triton.language as tl
from paged_ref import _device

spec = importlib.util.spec_from_file_location("exercise_under_test", {path!r})
ex = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ex)
'''


def run_probe(ex, body: str, tmp_path) -> tuple[int, str]:
    """Run ``body`` (with ``ex`` loaded from ``ex.__file__``) in a process of its own (a fork of
    this one on a CPU: see tests/exercises/isolated.py); return its exit status and output. A
    stub's NotImplementedError comes back out as NotImplementedError."""
    script = tmp_path / "probe.py"
    script.write_text(_PROBE_HEADER.format(path=str(ex.__file__)) + textwrap.dedent(body))
    returncode, text = run_script(script, ROOT)
    found = re.search(r"Exercise \d+\.\d+[a-z]?: \w+", text)
    if returncode != 0 and "NotImplementedError" in text and found:
        raise NotImplementedError(found.group(0))
    return returncode, text


_INT64_PROBE = '''


@triton.jit
def probe(out_ptr, cache_ptr, table_ptr, shift, seq_len, stride_block, stride_tok, stride_head,
          BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr):
    tok = tl.arange(0, TILE)
    offs_d = tl.arange(0, HEAD_DIM)
    # The cache pointer is moved back by `shift` elements and the block ids forward by as many
    # blocks: only 64-bit arithmetic lands back on the real rows.
    tile = ex.load_kv_tile(cache_ptr - shift, table_ptr, tok, tok < seq_len, 1, stride_block,
                           stride_tok, stride_head, offs_d, offs_d < HEAD_DIM, BLOCK_SIZE)
    tl.store(out_ptr + tok[:, None] * HEAD_DIM + offs_d[None, :], tile)


dev = _device.triton_device()
gen = torch.Generator().manual_seed(48)
cache = torch.randn(3, 4, 2, 16, generator=gen).to(dev)
big = 2**33 // cache.stride(0)            # block id offset: big * block stride = 2**33
real = [2, 0, 1]
table = torch.tensor(real + [-1], dtype=torch.int32)
table[:3] += big
out = torch.zeros(16, 16, device=dev)
probe[(1,)](out, cache, table.to(dev), big * cache.stride(0), 10, cache.stride(0),
            cache.stride(1), cache.stride(2), BLOCK_SIZE=4, HEAD_DIM=16, TILE=16)
expected = torch.zeros(16, 16)
for t in range(10):
    expected[t] = cache[real[t // 4], t % 4, 1].cpu()
sys.exit(0 if torch.equal(out.cpu(), expected) else 3)
'''


@needs_triton
def test_load_kv_tile_uses_64bit_offsets(ex, tmp_path):
    """Block ids near 2**26 with a block stride of 128 elements: block * stride = 2**33.

    Runs in a process of its own, because an int32 product wraps to an address outside the
    cache and crashes the process instead of raising."""
    returncode, text = run_probe(ex, _INT64_PROBE, tmp_path)
    if returncode == 3:
        raise AssertionError("load_kv_tile read the wrong rows for block ids whose offset "
                             "(block * stride_block = 2**33 elements) does not fit in int32: "
                             "cast the block ids to int64 before multiplying")
    if returncode != 0:
        tail = "\n".join(text.strip().splitlines()[-6:])
        raise AssertionError(
            f"the kernel crashed (exit status {returncode}) for block ids whose offset "
            f"block * stride_block = 2**33 elements does not fit in int32. In int32 the product "
            f"wraps around to an address outside the cache: cast the block ids to int64 before "
            f"multiplying.\n{tail}"
        )


_GUARD_PROBE = '''
import ctypes
import mmap

# Two pages of memory; the second made unreadable (a "guard page"). The block table row is the
# last 3 int32s of the first page: reading the table one entry past the row touches the guard
# page and the process dies with SIGSEGV, as a GPU kernel would read out of bounds.
PAGE = mmap.PAGESIZE
buf = mmap.mmap(-1, 2 * PAGE)
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
if libc.mprotect(base + PAGE, PAGE, 0) != 0:  # PROT_NONE
    sys.exit(4)
page = torch.frombuffer(buf, dtype=torch.int32, count=PAGE // 4)
row = page[-3:].view(1, 3)
row.copy_(torch.tensor([[4, 1, 6]], dtype=torch.int32))
gen = torch.Generator().manual_seed(58)
cache = torch.randn(8, 4, 2, 16, generator=gen)
lens = torch.tensor([10], dtype=torch.int32)         # 3 blocks of 4: tokens 0..9
tile = ex.gather_kv_tile(cache, row, lens, 0, 1, 0, tile=16)   # tokens 0..15: tok // 4 <= 3
expected = torch.zeros(16, 16)
for t in range(10):
    expected[t] = cache[[4, 1, 6][t // 4], t % 4, 1]
sys.exit(0 if torch.equal(tile, expected) else 3)
'''


@needs_triton
@pytest.mark.skipif(DEVICE != "cpu" or not sys.platform.startswith("linux"),
                    reason="the guard page works for Triton's CPU interpreter on Linux")
def test_load_kv_tile_masks_the_block_table_load(ex, tmp_path):
    """A tile that runs past the end of the table row must not read the table there.

    The row sits just before an unreadable page of memory: an unmasked load of the block ids
    (tokens 12..15 look up entry 3 of a 3-entry row) crashes the process."""
    returncode, text = run_probe(ex, _GUARD_PROBE, tmp_path)
    if returncode == 3:
        raise AssertionError("load_kv_tile gathered the wrong tile for a 10-token sequence whose "
                             "3-entry table row ends at an unreadable page")
    if returncode != 0:
        tail = "\n".join(text.strip().splitlines()[-6:])
        raise AssertionError(
            f"the kernel crashed (exit status {returncode}): it read the block table past the "
            f"end of the row (tokens 12..15 of a 10-token sequence look up entry 3 of a 3-entry "
            f"row). Mask the block-id load with t_mask: past a sequence's end the table holds "
            f"garbage, and past the row's end it is not the table at all.\n{tail}"
        )


# ---- Exercise 4.3: attend_sequence, through the given kernel and wrapper ------------------------


@needs_triton
@pytest.mark.parametrize(
    "seq_lens, hq, hkv, head_dim, block_size, dtype, poison",
    [([0, 1, 16, 37, 48, 5], 8, 2, 64, 16, torch.float32, "nan"),
     ([3, 0, 17, 1, 33], 2, 2, 80, 1, torch.float32, "large"),
     ([1, 16, 29, 0], 8, 2, 80, 16, torch.float16, "large"),
     ([20, 0, 7, 32], 2, 2, 64, 16, torch.float16, "nan"),
     ([12, 1, 0, 33], 8, 2, 64, 1, torch.bfloat16, "nan")],
    ids=["f32_gqa4_bs16_d64", "f32_mha_bs1_d80", "f16_gqa4_bs16_d80", "f16_mha_bs16_d64",
         "bf16_gqa4_bs1_d64"],
)
def test_attend_sequence_matches_reference(ex, seq_lens, hq, hkv, head_dim, block_size, dtype,
                                        poison):
    inp = make_paged_inputs(seq_lens, num_q_heads=hq, num_kv_heads=hkv, head_dim=head_dim,
                            block_size=block_size, dtype=dtype, device=DEVICE, poison=poison,
                            seed=49 + head_dim + block_size)
    out = run_kernel(ex.paged_decode, *inp.args())
    assert out.shape == inp.q.shape and out.dtype == dtype, (
        f"expected output {tuple(inp.q.shape)} {dtype}, got {tuple(out.shape)} {out.dtype}"
    )
    assert_close(out, inp.reference(), name=f"paged_decode output, lengths {seq_lens}")


@needs_triton
def test_attend_sequence_many_tiles_with_peaky_scores(ex):
    """100 tokens = 4 tiles of 32 with large scores: the running max moves between tiles."""
    inp = make_paged_inputs([100, 70], num_q_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
                            device=DEVICE, seed=50)
    inp.q *= 6.0
    out = run_kernel(ex.paged_decode, *inp.args())
    assert_close(out, inp.reference(), name="paged_decode output, scaled-up queries")


@needs_triton
def test_attend_sequence_uses_the_scale(ex):
    inp = make_paged_inputs([9, 40], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                            device=DEVICE, seed=51)
    out = run_kernel(ex.paged_decode, *inp.args(), scale=0.3)
    assert_close(out, inp.reference(scale=0.3), name="paged_decode output with scale=0.3")


@needs_triton
def test_attend_sequence_empty_sequences_are_zero(ex):
    inp = make_paged_inputs([0, 0, 0], num_q_heads=4, num_kv_heads=2, head_dim=64,
                            block_size=16, device=DEVICE, poison="nan", seed=52)
    out = run_kernel(ex.paged_decode, *inp.args())
    assert not out.isnan().any(), f"NaN in the output at {out.isnan().nonzero()[:3].tolist()}"
    assert_equal(out.cpu(), torch.zeros(3, 4, 64), name="output for sequences of length 0")
