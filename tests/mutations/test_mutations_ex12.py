"""Lesson 12's likely mistakes, planted into the solution: the exercise tests must catch each."""

from __future__ import annotations

import pytest

from tests.mutations.mutate import Mutation, assert_caught

NAME = "ex12_serving"

MUTATIONS = [
    # 12.1 reserved_blocks
    Mutation("12.1 pow2 of the whole request, not of its output",
             "tokens = prompt_len + (1 << (output_len - 1).bit_length())",
             "tokens = 1 << (prompt_len + output_len - 1).bit_length()", keyword="12_1"),
    Mutation("12.1 next power of two off by one (bit_length of n, not n - 1)",
             "(1 << (output_len - 1).bit_length())", "(1 << output_len.bit_length())",
             keyword="12_1"),
    Mutation("12.1 a reservation longer than max_model_len",
             "return blocks_needed(min(tokens, max_model_len), block_size)",
             "return blocks_needed(tokens, block_size)", keyword="12_1"),
    Mutation("12.1 tokens, not blocks",
             "return blocks_needed(min(tokens, max_model_len), block_size)",
             "return min(tokens, max_model_len)", keyword="12_1"),
    Mutation("12.1 floor instead of ceiling",
             "return blocks_needed(min(tokens, max_model_len), block_size)",
             "return min(tokens, max_model_len) // block_size", keyword="12_1"),
    Mutation("12.1 paging reserves the whole request too",
             "        tokens = prompt_len\n", "        tokens = prompt_len + output_len\n",
             keyword="12_1"),
    Mutation("12.1 an unknown policy treated as paged",
             "    else:\n        raise ValueError", "    elif False:\n        raise ValueError",
             keyword="12_1"),
    # 12.2 sustained_rate
    Mutation("12.2 the last point within, not interpolated",
             "return r0 + (bound - l0) / (l1 - l0) * (r1 - r0)", "return r0", keyword="12_2"),
    Mutation("12.2 the first point above, not interpolated",
             "return r0 + (bound - l0) / (l1 - l0) * (r1 - r0)", "return r1", keyword="12_2"),
    Mutation("12.2 interpolating from the wrong end",
             "return r0 + (bound - l0) / (l1 - l0) * (r1 - r0)",
             "return r1 - (bound - l0) / (l1 - l0) * (r1 - r0)", keyword="12_2"),
    Mutation("12.2 a latency equal to the bound counts as above",
             "if l1 > bound:", "if l1 >= bound:", keyword="12_2"),
    Mutation("12.2 the lowest rate above the bound gives the lowest rate",
             "    if latencies[0] > bound:\n        return None\n", "", keyword="12_2"),
    Mutation("12.2 the last crossing, not the first",
             "    for r0, r1, l0, l1 in zip(rates, rates[1:], latencies, latencies[1:], "
             "strict=False):",
             "    for r0, r1, l0, l1 in reversed(list(zip(rates, rates[1:], latencies, "
             "latencies[1:], strict=False))):", keyword="12_2"),
    Mutation("12.2 never above: None instead of the highest rate",
             "    return rates[-1]\n", "    return None\n", keyword="12_2"),
    # 12.3 admission_order
    Mutation("12.3 shortest prefix first", "0 if aged else -cached_tokens[i]",
             "0 if aged else cached_tokens[i]", keyword="12_3"),
    Mutation("12.3 aging ignored", "aged = overtaken[i] >= max_overtakes", "aged = False",
             keyword="12_3"),
    Mutation("12.3 the aged sorted by their prefix too", "0 if aged else -cached_tokens[i]",
             "-cached_tokens[i]", keyword="12_3"),
    Mutation("12.3 aged one overtake late", "aged = overtaken[i] >= max_overtakes",
             "aged = overtaken[i] > max_overtakes", keyword="12_3"),
    Mutation("12.3 the aged go last", "return (not aged, 0 if aged else -cached_tokens[i], i)",
             "return (aged, 0 if aged else -cached_tokens[i], i)", keyword="12_3"),
    Mutation("12.3 ties to the later arrival",
             "return (not aged, 0 if aged else -cached_tokens[i], i)",
             "return (not aged, 0 if aged else -cached_tokens[i], -i)", keyword="12_3"),
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=str)
def test_mutation_is_caught(mutation, tmp_path):
    assert_caught(NAME, mutation, tmp_path)
