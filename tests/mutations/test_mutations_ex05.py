"""Lesson 05's likely mistakes, planted into the solution: the exercise tests must catch each."""

from __future__ import annotations

import pytest

from tests.mutations.mutate import Mutation, assert_caught

NAME = "ex05_split_kv"

MUTATIONS = [
    # 5.1 merge_partials (torch)
    Mutation("5.1 largest lse not subtracted: exp(lse) overflows",
             "w = torch.exp(lses - top)", "w = torch.exp(lses)", keyword="merge_partials"),
    Mutation("5.1 no -inf guard: -inf - -inf = NaN when every chunk is empty",
             "    top = torch.where(torch.isfinite(top), top, 0.0)", "    top = top",
             keyword="merge_partials"),
    Mutation("5.1 NaN outputs of empty chunks leak through (0 * nan)",
             "parts = torch.where(w[..., None] > 0, outs.to(acc), 0.0)", "parts = outs.to(acc)",
             keyword="merge_partials"),
    Mutation("5.1 merged lse forgets the max it subtracted",
             "return out.to(outs.dtype), top + torch.log(total)",
             "return out.to(outs.dtype), torch.log(total)", keyword="merge_partials"),
    Mutation("5.1 wrong lse base: log2 instead of the natural log",
             "return out.to(outs.dtype), top + torch.log(total)",
             "return out.to(outs.dtype), top + torch.log2(total)", keyword="merge_partials"),
    Mutation("5.1 wrong weight base: exp2 on natural-log lse's",
             "w = torch.exp(lses - top)", "w = torch.exp2(lses - top)", keyword="merge_partials"),
    Mutation("5.1 weights not normalised",
             "/ torch.where(total > 0, total, 1.0)[..., None]", "", keyword="merge_partials"),
    # 5.2 attend_chunk
    Mutation("5.2 missed mask: tokens past the chunk's end take part",
             "        t_mask = tok < end\n", "        t_mask = tok < end + TILE\n",
             keyword="attend_chunk and middle"),  # within the sequence: no read out of bounds
    Mutation("5.2 loop starts at token 0, not at the chunk's start",
             "for t0 in range(start, end, TILE):", "for t0 in range(0, end, TILE):",
             keyword="attend_chunk"),
    Mutation("5.2 acc not rescaled when the max grows",
             "acc = acc * alpha[:, None] + tl.dot(", "acc = acc + tl.dot(",
             keyword="attend_chunk"),
    Mutation("5.2 state normalised inside (acc / l returned as acc)",
             "    return m, l, acc\n", "    return m, l, acc / l[:, None]\n",
             keyword="attend_chunk"),
    Mutation("5.2 -inf not given to masked tokens (score 0 instead)",
             '        scores = tl.where(t_mask[None, :], scores, float("-inf"))'
             "  # [GROUP_PAD, TILE]\n", "", keyword="attend_chunk"),
    # 5.3 partial_attention_kernel
    Mutation("5.3 empty chunks write too (lse -inf, output NaN)",
             "    if start < seq_len:\n", "    if start <= seq_len + chunk_size:\n",
             keyword="partial_attention_kernel_skips_empty_chunks"),
    Mutation("5.3 chunk end not cut at the sequence's length",
             "end = tl.minimum(start + chunk_size, seq_len)", "end = start + chunk_size",
             keyword="partial_attention_kernel", isolate=True),
    Mutation("5.3 chunk end at the sequence's length (chunks overlap)",
             "end = tl.minimum(start + chunk_size, seq_len)", "end = seq_len",
             keyword="partial_attention_kernel"),
    Mutation("5.3 wrong lse base: log2",
             "tl.store(part_lse_ptr + row, m + tl.log(l), mask=g_mask)",
             "tl.store(part_lse_ptr + row, m + tl.log2(l), mask=g_mask)",
             keyword="partial_attention_kernel"),
    Mutation("5.3 lse forgets the running max",
             "tl.store(part_lse_ptr + row, m + tl.log(l), mask=g_mask)",
             "tl.store(part_lse_ptr + row, tl.log(l), mask=g_mask)",
             keyword="partial_attention_kernel"),
    Mutation("5.3 partial output not normalised",
             "                 acc / l[:, None], mask=g_mask[:, None])",
             "                 acc, mask=g_mask[:, None])", keyword="partial_attention_kernel"),
    Mutation("5.3 wrong GQA head mapping: query head h = g * Hkv + kv_head",
             "        heads = kv_head * GROUP + offs_g\n        g_mask",
             "        heads = offs_g * tl.num_programs(1) + kv_head\n        g_mask",
             keyword="partial_attention_kernel"),
    Mutation("5.3 flat index without the chunk count",
             "row = (b * (tl.num_programs(1) * GROUP) + heads) * num_chunks + c",
             "row = (b * (tl.num_programs(1) * GROUP) + heads) + c",
             keyword="partial_attention_kernel"),
    # 5.4 merge_chunks_kernel
    Mutation("5.4 reads every chunk, the never-written ones too",
             "for c in range(0, used):", "for c in range(0, num_chunks):",
             keyword="merge_chunks_kernel"),
    Mutation("5.4 empty sequence gives NaN (0 / 0)",
             "out = acc / tl.where(l_i > 0, l_i, 1.0)", "out = acc / l_i",
             keyword="merge_chunks_kernel"),
    Mutation("5.4 acc not rescaled when the max grows",
             "acc = acc * alpha + w * o", "acc = acc + w * o", keyword="merge_chunks_kernel"),
    Mutation("5.4 wrong weight base: exp2 on natural-log lse's",
             ("alpha = tl.exp(m_i - m_new)", "w = tl.exp(lse - m_new)"),
             ("alpha = tl.exp2(m_i - m_new)", "w = tl.exp2(lse - m_new)"),
             keyword="merge_chunks_kernel"),
    Mutation("5.4 used chunks rounded down (the last partial chunk is dropped)",
             "used = tl.cdiv(seq_len, chunk_size)", "used = seq_len // chunk_size",
             keyword="merge_chunks_kernel"),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=str)
def test_mutation_is_caught(mutation, tmp_path):
    assert_caught(NAME, mutation, tmp_path)
