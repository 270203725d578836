"""What lesson 09 says of the committed engine runs on SmolLM2's real weights
(``results/h200/engine_smollm2_real.json``, ``engine_smollm2_same_machine.json``), checked
on the JSON: the real weights keep the ordering of the random ones; on one machine, in one
run, the two models' engine speeds are within 5 %; two machines differ by more than that."""

from __future__ import annotations

import json

from paged_course import ROOT

H200 = ROOT / "results" / "h200"


def rows(name: str) -> dict:
    return {r["shape"]: r for r in json.loads((H200 / name).read_text())["throughput"]}


def test_real_weights_keep_the_ordering():
    real = rows("engine_smollm2_real.json")["smollm2-135m-real"]
    assert real["engine"]["max_requests_held"] > real["static_generate"]["max_requests_held"]
    assert (real["engine"]["output_tok_s"] > real["generate_batch"]["output_tok_s"]
            > real["static_generate"]["output_tok_s"])
    assert real["engine"]["output_tokens"] == real["static_generate"]["output_tokens"] == 256 * 128


def test_one_machine_two_models_within_five_percent_two_machines_further_apart():
    same = rows("engine_smollm2_same_machine.json")
    random_w, real_w = (same[s]["engine"]["output_tok_s"] for s in ("smollm2-135m",
                                                                      "smollm2-135m-real"))
    assert abs(real_w / random_w - 1) < 0.05
    other_machine = rows("engine_smollm2_real.json")["smollm2-135m-real"]["engine"]["output_tok_s"]
    assert abs(other_machine / real_w - 1) > 2 * abs(real_w / random_w - 1)
