"""Likely mistakes in the runner's fused ops, planted one at a time: the engine tests must fail.

Each :class:`Planted` edits one module's source (``paged_ref/...``, a text substitution that
must apply exactly once), loads the edit from a real file (Triton reads a kernel's source from
its file), swaps the module's public functions / classes for the mutant's, then runs the
selected tests in this process (``pytest -x -k keyword``) and fails unless one of them fails.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
from dataclasses import dataclass

import pytest

from tests.mutations.mutate import ROOT, Mutation, mutant_of

pytest.importorskip("transformers")


@dataclass(frozen=True)
class Planted:
    module: str                    # the module that holds the mistake
    mutation: Mutation             # the edit; mutation.keyword selects the tests
    test_file: str                 # tests/engine/<file>.py
    also_in: tuple[str, ...] = ()  # modules that imported its names (patched there too)

    def __str__(self) -> str:
        return self.mutation.description


KERNELS, FUSED, RUNNER = ("paged_ref.kernels.triton.fused", "paged_ref.models.fused",
                          "paged_ref.engine.runner")
FUSED_TESTS, RUNNER_TESTS = "tests/engine/test_fused.py", "tests/engine/test_runner.py"
NORM_TRITON = "add_rms_norm and triton"
ROPE_TRITON = "rope_write_matches and triton"
SILU_TRITON = "silu_mul and triton"

PLANTED = [
    Planted(KERNELS, Mutation("rms norm: eps outside the rsqrt", "tl.rsqrt(variance + eps)",
                              "(tl.rsqrt(variance) + eps)", NORM_TRITON), FUSED_TESTS),
    Planted(KERNELS, Mutation("rms norm: mean over the padded block, not the hidden size",
                              "/ HIDDEN  #", "/ BLOCK  #", NORM_TRITON), FUSED_TESTS),
    Planted(KERNELS, Mutation("rms norm: the residual add forgotten",
                              "h = _round(h + delta, dtype)", "h = _round(h, dtype)",
                              NORM_TRITON), FUSED_TESTS),
    Planted(KERNELS, Mutation("rotary: rotate_half without its minus sign",
                              "_round(x_lo * cos_lo, DTYPE) - _round(",
                              "_round(x_lo * cos_lo, DTYPE) + _round(", ROPE_TRITON),
            FUSED_TESTS),
    Planted(KERNELS, Mutation("rotary: k stored without rotation",
                              "lo, hi = _rotate(k_src, ok, cos_lo, cos_hi, sin_lo, sin_hi, "
                              "HALF, dtype)",
                              "lo, hi = tl.load(k_src, mask=ok), tl.load(k_src + HALF, mask=ok)",
                              ROPE_TRITON), FUSED_TESTS),
    Planted(KERNELS, Mutation("K/V written to row t, not to slot_mapping[t]",
                              "slot = tl.load(slot_mapping_ptr + t).to(tl.int64)", "slot = t",
                              ROPE_TRITON), FUSED_TESTS),
    Planted(KERNELS, Mutation("silu without the sigmoid", "gate / (1.0 + tl.exp(-gate))",
                              "gate", SILU_TRITON), FUSED_TESTS),
    Planted(KERNELS, Mutation("silu applied to up instead of gate",
                              ("src = gate_up_ptr + t * (2 * INTER) + offs",
                               "up = tl.load(src + INTER,"),
                              ("src = gate_up_ptr + t * (2 * INTER) + INTER + offs",
                               "up = tl.load(src - INTER,"), SILU_TRITON), FUSED_TESTS),
    Planted(FUSED, Mutation("torch rms norm: eps outside the rsqrt",
                            "torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)",
                            "(torch.rsqrt(x.pow(2).mean(-1, keepdim=True)) + eps)",
                            "add_rms_norm and torch"), FUSED_TESTS),
    Planted(FUSED, Mutation("fused projections drop their biases",
                            "bias = torch.cat([m.bias for m in linears]) if all(has_bias) "
                            "else None",
                            "bias = None", "fuse_linears_is"), FUSED_TESTS),
    Planted(RUNNER, Mutation("q/k/v stacked as q, v, k",
                             "fused.fuse_linears(a.q_proj, a.k_proj, a.v_proj)",
                             "fused.fuse_linears(a.q_proj, a.v_proj, a.k_proj)",
                             "projection_biases"), RUNNER_TESTS,
            also_in=("paged_ref.engine.engine",)),
    Planted(RUNNER, Mutation("the MLP's residual add normalised by the layer's own post-"
                             "attention norm, not the next layer's input norm",
                             "self._add_norm(h, layer.mlp.down_proj(m), 2 * i + 2)",
                             "self._add_norm(h, layer.mlp.down_proj(m), 2 * i + 1)",
                             "projection_biases"), RUNNER_TESTS,
            also_in=("paged_ref.engine.engine",)),
    Planted(RUNNER, Mutation("a replayed step returns a token for every row, also for a "
                             "1-token prompt chunk that samples not",
                             "return tokens[:batch][rows], hidden[:batch][rows]",
                             "return tokens[:batch], hidden[:batch][rows]", "hidden_states"),
            RUNNER_TESTS, also_in=("paged_ref.engine.engine",)),
]


def load_mutant(planted: Planted, folder, monkeypatch):
    """The module with the mistake planted, loaded from ``folder`` under a name of its own."""
    return mutant_of(importlib.import_module(planted.module), planted.mutation.edits(), folder,
                     monkeypatch)


def run_tests(test_file: str, keyword: str) -> tuple[int, str]:
    args = [str(ROOT / test_file), "-k", keyword, "-x", "-q", "--no-header", "--tb=line",
            "-o", "addopts=", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
            "--capture=no", "-W", "ignore"]
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = pytest.main(args)
    return int(code), out.getvalue()


@pytest.mark.parametrize("planted", PLANTED, ids=str)
def test_planted_mistake_is_caught(planted, tmp_path, monkeypatch):
    # Import every module concerned before patching any: a module first imported while its
    # source is patched would keep the mutant after the test (monkeypatch would "restore" it).
    modules = [importlib.import_module(m) for m in (planted.module, *planted.also_in)]
    mutant = load_mutant(planted, tmp_path, monkeypatch)
    for name in getattr(modules[0], "__all__", ("ModelRunner",)):
        for module in modules:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(mutant, name))
    code, output = run_tests(planted.test_file, planted.mutation.keyword)
    tail = "\n".join(output.strip().splitlines()[-6:])
    assert code != pytest.ExitCode.OK, f"mutation survived: {planted}\n{tail}"
    assert code == pytest.ExitCode.TESTS_FAILED, f"the tests did not run properly:\n{tail}"
