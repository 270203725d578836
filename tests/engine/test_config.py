"""Configuration checked at construction (issue 36, scenario 6), prompts of every accepted form,
and the command line's flags checked before the model loads (scenario 10)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from paged_ref import _device as device_module  # noqa: E402
from paged_ref import offline as offline_module  # noqa: E402
from paged_ref.engine import Engine, SamplingParams  # noqa: E402
from paged_ref.engine import engine as engine_module  # noqa: E402
from paged_ref.engine import scheduler as scheduler_module  # noqa: E402
from tests.engine.checks import hf_greedy  # noqa: E402
from tests.mutations.mutate import mutant_of  # noqa: E402

REFUSED = [
    (dict(attention_backend="bogus"), ValueError, "attention_backend must be one of"),
    (dict(attention_backend="triton_split"), ValueError, "attention_backend"),
    (dict(attention_backend="cuda"), ValueError, "attention_backend"),
    (dict(fused_backend="fast"), ValueError, "fused_backend"),
    (dict(max_num_seqs=2.5), TypeError, "max_num_seqs"),
    (dict(max_num_seqs=0), ValueError, "max_num_seqs"),
    (dict(max_num_batched_tokens=7.5), TypeError, "max_num_batched_tokens"),
    (dict(max_model_len=0), ValueError, "max_model_len must be >= 1"),
    (dict(max_model_len=-5), ValueError, "max_model_len"),
    (dict(max_model_len=3.0), TypeError, "max_model_len"),
    (dict(eos_token_id="12"), TypeError, "eos_token_id"),
    (dict(eos_token_id=[1, 2.0]), TypeError, r"eos_token_id\[1\]"),
    (dict(eos_token_id=-1), ValueError, "eos_token_id"),
    (dict(eos_token_id=torch.tensor(2.0)), TypeError, "eos_token_id"),
    (dict(cuda_graphs=True), ValueError, "cuda_graphs=True needs the model on a CUDA GPU"),
    (dict(cuda_graphs="yes"), TypeError, "cuda_graphs"),
    (dict(num_blocks=0), ValueError, "num_blocks"),
    (dict(block_size=1.5), TypeError, "block_size"),
    (dict(preemption_mode="drop"), ValueError, "preemption_mode"),
    (dict(reservation="orca"), ValueError, "reservation"),
]
if torch.cuda.is_available():  # (on a GPU these run, and are tested there)
    REFUSED = [r for r in REFUSED if "cuda_graphs" not in r[0]]


def check_refusals(cls, model):
    """Every configuration of REFUSED raises its error at construction."""
    for kw, error, match in REFUSED:
        with pytest.raises(error, match=match):
            cls(model, **{"num_blocks": 8, **kw})


def test_bad_configuration_is_refused_at_construction(tiny):
    check_refusals(Engine, tiny)


@pytest.mark.parametrize("eos,ids", [(5, {5}), (np.int64(5), {5}), (torch.tensor(5), {5}),
                                     ([np.int32(3), 4], {3, 4}), (torch.tensor([7, 8]), {7, 8}),
                                     (np.array([9]), {9}), ((), set())])
def test_eos_ids_in_every_integer_form(tiny, eos, ids):
    assert Engine(tiny, num_blocks=8, eos_token_id=eos).eos_ids == ids


def test_triton_where_it_cannot_run_is_refused(tiny, monkeypatch):
    monkeypatch.setattr(engine_module._device, "triton_runs_on", lambda device: False)
    for name in ("attention_backend", "fused_backend"):
        with pytest.raises(ValueError, match=f"{name}='triton' cannot run"):
            Engine(tiny, num_blocks=8, **{name: "triton"})


@pytest.fixture(scope="module")
def prompt_and_tokens(tiny):
    prompt = torch.randint(3, 256, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    return prompt, hf_greedy(tiny, prompt, 4)


@pytest.mark.parametrize("form", [list, tuple, np.array, torch.tensor,
                                  lambda p: np.array(p, dtype=np.int32),
                                  lambda p: [np.int64(t) for t in p]],
                         ids=["list", "tuple", "numpy", "tensor", "numpy-int32", "numpy-ints"])
def test_prompts_in_every_integer_form(tiny, prompt_and_tokens, form):
    prompt, expected = prompt_and_tokens
    engine = Engine(tiny, num_blocks=16, block_size=4)
    assert engine.generate([form(prompt)], 4, ignore_eos=True) == [expected]
    rid = engine.add_request(form(prompt), SamplingParams(max_tokens=4, ignore_eos=True))
    outs = [o for _ in range(4) for o in engine.step()]
    assert outs[-1].request_id == rid and outs[-1].output_token_ids == expected


@pytest.mark.parametrize("bad,match", [
    (lambda p: torch.tensor(p, dtype=torch.float32), "integer token ids"),
    (lambda p: np.array(p, dtype=np.float64), "integer token ids"),
    (lambda p: [float(t) for t in p], r"prompts\[0\]\[0\] must be an int"),
    (lambda p: torch.tensor([p]), "must be 1-D"),
    (lambda p: np.array(p[0]), "must be 1-D"),
    (lambda p: "hello", "encode text with the tokenizer first"),
])
def test_prompts_of_floats_or_other_shapes_are_type_errors(tiny, prompt_and_tokens, bad, match):
    prompt, _ = prompt_and_tokens
    engine = Engine(tiny, num_blocks=16, block_size=4)
    with pytest.raises(TypeError, match=match):
        engine.generate([bad(prompt)], 2)
    with pytest.raises(TypeError, match=match.replace(r"prompts\[0\]", "prompt_ids")):
        engine.add_request(bad(prompt))
    with pytest.raises(TypeError, match="SamplingParams"):
        engine.add_request(prompt, dict(max_tokens=3))
    assert not engine.requests and not engine.scheduler.has_work()


# ---- scenario 6 planted back: each check removed must be caught ---------------------------

PLANTED_CONFIG = {
    "backends not checked": (device_module, [(
        "        if value not in ENGINE_BACKENDS:\n", "        if False:\n")]),
    "max_model_len=0 becomes the default": (engine_module, [(
        "if max_model_len is None\n", "if not max_model_len\n")]),
    "EOS ids iterated (a string becomes its digits)": (engine_module, [(
        'as_token_ids("eos_token_id", eos_token_id, scalar=True)',
        "[int(t) for t in eos_token_id]")]),
    "cuda_graphs not checked (AssertionError mid-construction)": (device_module, [(
        'if cuda_graphs and device.type != "cuda":', "if False:")]),
    "a float max_num_seqs accepted": (scheduler_module, [(
        'self.max_num_seqs = check_int("max_num_seqs", max_num_seqs, minimum=1)',
        "self.max_num_seqs = max_num_seqs")]),
    "a float max_num_batched_tokens accepted": (scheduler_module, [(
        'check_int("max_num_batched_tokens",', '(lambda name, n, minimum: n)(None,')]),
}


@pytest.mark.parametrize("name", PLANTED_CONFIG)
def test_planted_config_bug_is_caught(tiny, monkeypatch, tmp_path, name):
    module, edits = PLANTED_CONFIG[name]
    if "cuda_graphs" in name and torch.cuda.is_available():
        pytest.skip("on a GPU cuda_graphs=True is right")
    mutant = mutant_of(module, edits, tmp_path, monkeypatch)
    if module is scheduler_module:
        monkeypatch.setattr(engine_module, "Scheduler", mutant.Scheduler)
    if module is device_module:  # (the engine's checks of its backends live there)
        monkeypatch.setattr(engine_module, "_device", mutant)
    cls = mutant.Engine if module is engine_module else Engine
    with pytest.raises((pytest.fail.Exception, AssertionError)):
        check_refusals(cls, tiny)


#: Scenario 6's unclear errors planted back: token ids that only a torch tensor may carry.
PLANTED_TOKEN_IDS = {
    "a NumPy prompt refused": [("if isinstance(value, (torch.Tensor, np.ndarray)):",
                                "if isinstance(value, torch.Tensor):")],
    "a 0-d tensor EOS refused": [("if value.ndim not in ((0, 1) if scalar else (1,)):",
                                  "if value.ndim != 1:")],
}


@pytest.mark.parametrize("name", PLANTED_TOKEN_IDS)
def test_planted_token_id_forms_are_caught(tiny, prompt_and_tokens, monkeypatch, tmp_path, name):
    from paged_ref.sampling import params as params_module

    mutant = mutant_of(params_module, PLANTED_TOKEN_IDS[name], tmp_path, monkeypatch)
    for module in (engine_module, offline_module):  # (EOS ids; prompts: offline.check_prompt)
        monkeypatch.setattr(module, "as_token_ids", mutant.as_token_ids)
    caught = 0
    for check in (lambda: test_eos_ids_in_every_integer_form(tiny, np.int64(5), {5}),
                  lambda: test_eos_ids_in_every_integer_form(tiny, torch.tensor(5), {5}),
                  lambda: test_prompts_in_every_integer_form(tiny, prompt_and_tokens,
                                                             np.array)):
        try:
            check()
        except TypeError:
            caught += 1
    assert caught, f"the planted bug was missed: {name}"


# ---- the command line: flags checked before the model loads -----------------------------


class FakeTokenizer:
    def apply_chat_template(self, turns, **kw):
        return list(range(3, 3 + 30))  # a 30-token chat


@pytest.fixture
def cli(monkeypatch):
    """``main(argv)`` of the CLI with the model loader refused (nothing may load it before
    the flags are checked) and a fake tokenizer of 30-token prompts."""
    import transformers

    from paged_ref import chat as entry
    from paged_ref.models import loader

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the flags were checked")

    monkeypatch.setattr("paged_ref.engine.load_smollm2", no_model)
    monkeypatch.setattr(loader, "converted_folder", lambda: "folder")
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        classmethod(lambda cls, folder: FakeTokenizer()))
    return entry.main


@pytest.mark.parametrize("argv,match", [
    (["--max-new-tokens", "-1"], "--max-new-tokens must be >= 1"),
    (["--num-blocks", "0"], "--num-blocks must be >= 1"),
    (["--block-size", "0"], "--block-size must be >= 1"),
    (["--threads", "0"], "--threads must be >= 1"),
    (["--num-blocks", "x"], "invalid int value"),
    (["--backend", "bogus"], "invalid choice: 'bogus'"),
    (["--num-blocks", "2", "--block-size", "16"], "--num-blocks 2 is too small"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--num-blocks", "-3"],
     "no CUDA GPU here" if not torch.cuda.is_available() else "--num-blocks must be"),
])
def test_cli_refuses_a_bad_flag_in_one_line(cli, capsys, argv, match):
    with pytest.raises(SystemExit) as exit_info:
        cli(["--prompt", "hi", *argv])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert match in err and err.startswith("python -m paged_ref.chat: error:")


#: Scenario 10 planted back: each check of the flags removed (the model loads, then fails).
PLANTED_CLI = {
    "counts below 1 accepted": (
        [("value is not None and value < 1):", "False):")],
        ["--max-new-tokens", "-1"]),
    "a pool too small for the prompt found only by the engine": (
        [("if need > args.num_blocks:", "if False:")], ["--num-blocks", "2", "--block-size",
                                                        "16"]),
    "--device cuda without a GPU": (
        [('if args.device.startswith("cuda") and not torch.cuda.is_available():', "if False:")],
        ["--device", "cuda"]),
}


@pytest.mark.parametrize("name", PLANTED_CLI)
def test_planted_cli_bug_is_caught(cli, capsys, monkeypatch, tmp_path, name):
    from paged_ref import chat as entry

    if "cuda" in name and torch.cuda.is_available():
        pytest.skip("on a GPU --device cuda is right")
    edits, argv = PLANTED_CLI[name]
    mutant = mutant_of(entry, edits, tmp_path, monkeypatch)
    match = {"counts": "--max-new-tokens must be >= 1", "a": "is too small",
             "--device": "no CUDA GPU here"}[name.split(" ")[0]]
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        test_cli_refuses_a_bad_flag_in_one_line(mutant.main, capsys, argv, match)


def test_cli_thread_count_follows_the_idle_cores(monkeypatch):
    from paged_ref import chat as entry

    monkeypatch.setattr(entry.os, "sched_getaffinity", lambda pid: set(range(2)), raising=False)
    for load, threads in ((0.0, 2), (1.2, 1), (5.0, 1)):
        monkeypatch.setattr(entry.os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        assert entry.cpu_threads() == threads
    monkeypatch.setattr(entry.os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(entry.os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    assert entry.cpu_threads() == 4
