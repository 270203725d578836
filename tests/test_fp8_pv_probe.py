"""tools/gpu/fp8_pv_probe.py: every ``p @ V`` variant of the probe kernel against float64, in
Triton's interpreter at small sizes (the GPU run times them)."""

from __future__ import annotations

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

import paged_ref  # noqa: F401  (first: it sets TRITON_INTERPRET=1 on a CPU)

TOOLS = Path(__file__).parents[1] / "tools" / "gpu"
sys.path.insert(0, str(TOOLS))  # the script imports its neighbour quant_probe
SPEC = importlib.util.spec_from_file_location("fp8_pv_probe", TOOLS / "fp8_pv_probe.py")
probe = importlib.util.module_from_spec(SPEC)
sys.modules["fp8_pv_probe"] = probe  # (its dataclasses look their module up)
SPEC.loader.exec_module(probe)

#: One of each kind in the GPU sweep, at tiles that fit the small sequences here.
KINDS = sorted({dataclasses.replace(v, tile=32, warps=4, stages=3) for v in probe.sweep()},
               key=lambda v: v.label)


@pytest.fixture(scope="module")
def inputs():
    """2 sequences of 64 tokens (4 blocks of 16, shuffled, 3 garbage table entries each),
    2 KV heads of 4 query heads, head_dim 32."""
    return probe.make_inputs(batch=2, seq_len=64, kv_heads=2, group=4, head_dim=32,
                             block_size=16, device="cpu", seed=1, spare_entries=3)


#: The interpreter's float32 -> e4m3 cast (Triton 3.6) drops the carry when rounding up
#: reaches the next power of two (127.4 -> 64, not 128; triton-lang/triton#8322, #11897), so
#: e4m3 p is ~7e-2 off here, ~2.5e-2 on the GPU (probe.Variant.tolerance).
INTERPRETER_FP8_P_TOL = 0.1


def run(var, inputs):
    out = torch.empty_like(inputs.q)
    probe.launcher(var, inputs, out)()
    return out


@pytest.mark.parametrize("var", KINDS, ids=lambda v: v.label)
def test_variant_matches_float64(var, inputs):
    err = probe.rel_err(run(var, inputs), inputs.ref)
    # float16 p and V: the rounding of p (~2e-4)
    assert err <= (INTERPRETER_FP8_P_TOL if var.fp8_p else 1e-3), err


def test_fp8_p_variants_agree_with_each_other(inputs):
    """The same e4m3 p and V in every layout and product order: equal up to float32 sums,
    a check of V's two layouts and the transposed product tighter than the bound above."""
    outs = [run(v, inputs) for v in KINDS if v.fp8_p]
    assert len(outs) >= 3
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile", [16, 64])
def test_fma_tiles_and_block_size_8(tile):
    inp = probe.make_inputs(batch=2, seq_len=64, kv_heads=1, group=4, head_dim=16,
                            block_size=8, device="cpu", seed=2, spare_entries=1)
    out = torch.empty_like(inp.q)
    probe.launcher(probe.Variant("fma", qk="fma", group_pad=4, tile=tile), inp, out)()
    assert probe.rel_err(out, inp.ref) <= 1e-3


def test_sweep_is_small_and_starts_with_todays_kernel():
    rows = probe.sweep()
    assert 30 <= len(rows) <= 45 and len(set(rows)) == len(rows)
    assert rows[0] == probe.Variant("dot")  # today's kernel
    # e4m3 dots need a reduction (tile) of at least 32 on the GPU
    assert all(v.tile >= 32 for v in rows if v.fp8_p)


def test_tile_that_does_not_divide_the_sequence_is_refused(inputs):
    with pytest.raises(ValueError, match="seq_len"):
        probe.launcher(probe.Variant("dot", tile=128), inputs, torch.empty_like(inputs.q))
