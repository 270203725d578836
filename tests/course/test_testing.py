"""paged_course.testing helpers and the float64 split-partials reference."""

from __future__ import annotations

import torch

from paged_course.checks import assert_close
from paged_course.testing import interleaved_cache, make_paged_inputs, stack_padded
from paged_ref.reference import split_partials_reference


def test_stack_padded_fills_past_each_end():
    seqs = [torch.randn(3, 2), torch.randn(1, 2)]
    out = stack_padded(seqs, 4)
    assert out.shape == (2, 4, 2)
    assert torch.equal(out[0, :3], seqs[0]) and torch.equal(out[1, :1], seqs[1])
    assert out[0, 3:].isnan().all() and out[1, 1:].isnan().all()
    assert (stack_padded(seqs, 4, fill=0.0)[1, 1:] == 0).all()


def test_interleaved_cache_holds_what_was_written():
    lens = [5, 0, 9]
    mgr, cache, q, ks, vs = interleaved_cache(lens, block_size=4, num_q_heads=4,
                                              num_kv_heads=2, head_dim=8, seed=1)
    assert q.shape == (3, 4, 8) and [mgr.seq_len(s) for s in range(3)] == lens
    tables = [mgr.block_table(s) for s in range(3)]
    assert tables[0][1] > tables[2][0]  # grown in turns: the blocks interleave
    for s in (0, 2):
        k, v = cache.gather(0, tables[s], lens[s])
        assert torch.equal(k, ks[s]) and torch.equal(v, vs[s])


def test_split_partials_merge_to_the_reference():
    inp = make_paged_inputs([70, 0, 9, 33], num_q_heads=4, num_kv_heads=2, head_dim=16,
                            block_size=8, poison="nan", seed=3)
    outs, lses = split_partials_reference(*inp.args(), chunk_size=16)
    assert outs.shape == (5, 4, 4, 16) and lses.shape == (5, 4, 4)
    assert torch.isinf(lses[1:, 2]).all() and torch.isfinite(lses[:5, 0]).all()  # 9 tokens: 1
    weights = torch.nan_to_num(torch.softmax(lses, 0))
    merged = (weights[..., None] * torch.nan_to_num(outs)).sum(0)
    assert_close(merged, inp.reference(), name="merged partials")
