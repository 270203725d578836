"""The engine on a CUDA GPU (skipped without one): Triton kernels compiled, decode steps in
CUDA graphs, greedy tokens against transformers ``generate`` on random-weight models.

float32: identical tokens. bfloat16: the engine and transformers round differently (Triton's
fp32 accumulation vs SDPA), and random weights give near-tied logits, so a long greedy run may
part ways; the test checks the first tokens agree and records how many agree in all.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

pytestmark = pytest.mark.gpu  # (tests/conftest.py: skipped without a CUDA GPU)
pytest.importorskip("transformers")


def hf_greedy(model, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                         min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(0)
    lens = [1, 5, 16, 17, 40, 77, 130, 300]
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in lens]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cuda_graphs,steps", [(True, 1), (False, 1), (True, 8), (False, 3)])
def test_greedy_matches_transformers(prompts, dtype, cuda_graphs, steps):
    """Also with multi-step decoding (``num_scheduler_steps``: passes replayed back to back,
    inputs from pinned memory, one read-back)."""
    from paged_bench.engine import build_model
    from paged_ref.engine import Engine

    model = build_model("smollm2-135m", dtype=dtype)
    n = 24
    expected = [hf_greedy(model, p, n) for p in prompts]
    engine = Engine(model, num_blocks=160, block_size=16, max_num_seqs=8,
                    max_num_batched_tokens=256, cuda_graphs=cuda_graphs,
                    num_scheduler_steps=steps)
    passes, piecewise = [], []
    if cuda_graphs:  # (prefill and mixed steps of up to 256 tokens replay piecewise graphs)
        real = engine.runner.piecewise.run
        engine.runner.piecewise.run = lambda *a: piecewise.append(1) or real(*a)
    got = engine.generate(prompts, n, ignore_eos=True, on_step=lambda e: passes.append(e.passes))
    assert (engine.runner.graphs and piecewise) or not cuda_graphs
    assert max(passes) == steps
    if dtype == torch.float32:
        assert got == expected
    else:
        agree = [next((k for k, (a, b) in enumerate(zip(g, e, strict=False)) if a != b), n)
                 for g, e in zip(got, expected, strict=False)]
        print(f"bf16: tokens equal before the first difference, per prompt: {agree}")
        assert all(g[:1] == e[:1] for g, e in zip(got, expected, strict=False))
        assert sum(agree) >= 0.5 * n * len(prompts)


def test_multi_step_replays_give_the_one_pass_tokens(prompts):
    """bf16, CUDA graphs: the same kernels on the same buckets, so the same tokens, bit for bit,
    with 8 passes a step as with one."""
    from paged_bench.engine import build_model
    from paged_ref.engine import Engine

    model = build_model("smollm2-135m", dtype=torch.bfloat16)
    runs = [Engine(model, num_blocks=160, block_size=16, max_num_seqs=8,
                   num_scheduler_steps=k).generate(prompts, 40, ignore_eos=True) for k in (1, 8)]
    assert runs[0] == runs[1]


def test_small_pool_preempts_and_matches(prompts):
    from paged_bench.engine import build_model
    from paged_ref.engine import Engine

    model = build_model("smollm2-135m", dtype=torch.float32)
    expected = [hf_greedy(model, p, 12) for p in prompts]
    engine = Engine(model, num_blocks=24, block_size=16, max_num_batched_tokens=64)
    assert engine.generate(prompts, 12, ignore_eos=True) == expected
    assert engine.stats.preemptions > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_kernels_compiled_match_torch_ops(dtype):
    """The fused Triton kernels compiled (hidden 576, 9 / 3 heads, MLP 1536; and the 1B-like
    2048, 32 / 8, 8192): equal to the torch ops (transformers' arithmetic) up to rounding."""
    from paged_course.checks import assert_close
    from paged_ref.models import fused

    gen = torch.Generator(device="cuda").manual_seed(0)
    for hidden, hq, hkv, inter in ((576, 9, 3, 1536), (2048, 32, 8, 8192)):
        t, d = 37, 64

        def rand(*shape):
            return torch.randn(*shape, generator=gen, device="cuda").to(dtype)

        h, delta, w = rand(t, hidden), rand(t, hidden), rand(hidden)
        ref = fused.add_rms_norm(h, delta, w, 1e-5, backend="torch")
        got = fused.add_rms_norm(h, delta, w, 1e-5, backend="triton")
        assert torch.equal(got[0], ref[0])
        assert_close(got[1], ref[1].double(), name=f"add_rms_norm {hidden}")
        gu = rand(t, 2 * inter)
        assert_close(fused.silu_mul(gu, backend="triton"),
                     fused.silu_mul(gu, backend="torch").double(), name=f"silu_mul {inter}")
        qkv, pos = rand(t, (hq + 2 * hkv) * d), torch.randperm(4000, device="cuda")[:t]
        freqs = pos[:, None].float() / 10000 ** (torch.arange(0, d, 2, device="cuda") / d)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
        slots = torch.randperm(4 * t, device="cuda")[:t]
        out = {}
        for backend in ("torch", "triton"):
            caches = [torch.zeros(t, 4, hkv, d, dtype=dtype, device="cuda") for _ in range(2)]
            q = fused.rope_write_kv(qkv, cos, sin, *caches, slots, hq, backend=backend)
            out[backend] = (q, *caches)
        for name, a, b in zip(("q", "k cache", "v cache"), out["triton"], out["torch"],
                              strict=True):
            assert_close(a, b.double(), name=f"rope_write {name}")


def test_decode_step_launches_few_kernels():
    """A decode step (SmolLM2's shape, bf16): ~10 kernels a layer (was 41 with transformers'
    modules), counted with torch.profiler."""
    from paged_bench.engine import build_model, decode_step_kernels
    from paged_ref.engine import Engine
    from paged_ref.engine.runner import StepInputs

    model = build_model("smollm2-135m", dtype=torch.bfloat16)
    engine = Engine(model, num_blocks=64, block_size=16, max_num_seqs=8, cuda_graphs=False)
    step = StepInputs(input_ids=[5] * 4, positions=[40] * 4,
                      slot_mapping=[b * 3 * 16 + 2 * 16 + 8 for b in range(4)],
                      query_start_loc=list(range(5)), seq_lens=[41] * 4,
                      block_tables=[[3 * b, 3 * b + 1, 3 * b + 2] for b in range(4)],
                      sample_rows=list(range(4)))
    names = decode_step_kernels(engine.runner, step)
    layers = model.config.num_hidden_layers
    print(f"decode step: {len(names)} kernels, {len(names) / layers:.1f} a layer; by name:")
    for name, count in Counter(names).most_common():
        print(f"  {count:4d}  {name[:110]}")
    assert len(names) <= 16 * layers + 20, "transformers' modules: 41 a layer"


@pytest.mark.parametrize("cuda_graphs", [True, False])
def test_real_smollm2_greedy_matches_transformers_on_the_gpu(cuda_graphs):
    """SmolLM2-135M-Instruct's own weights in float32 on the GPU (lesson 09 where a learner has
    one): the engine's greedy tokens, stopping at EOS, are transformers' for each prompt alone.
    Skipped where the GGUF file or the ``gguf`` package is missing."""
    from paged_ref.engine import Engine, load_smollm2

    try:
        model, tokenizer = load_smollm2(device="cuda")
    except ImportError as err:
        pytest.skip(f"no SmolLM2 here: {err}")
    questions = ["Hi!", "What is 2 + 2?", "Write a haiku about memory.",
                 "Explain what a cache is, in one sentence.", "List three red fruits."]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False)) for q in questions]
    n = 40
    expected = []
    for p in prompts:
        ids = torch.tensor([p], device="cuda")
        out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=n)
        expected.append(out[0, len(p):].tolist())
    engine = Engine(model, num_blocks=64, block_size=16, max_num_batched_tokens=128,
                    cuda_graphs=cuda_graphs)
    assert all(expected) and engine.generate(prompts, n) == expected
    assert engine.runner.graphs or not cuda_graphs


def test_online_api_sampling_and_graphs_on_the_gpu(prompts):
    """The new step path on a GPU (CUDA graphs on, bf16 and float32): requests joining a running
    batch give transformers' greedy tokens (float32), seeded sampled requests beside them give
    the same tokens on every run and with graphs off (the sampler on the device, reading the
    graph's hidden states), an abort frees everything."""
    from paged_bench.engine import build_model
    from paged_ref.engine import Engine, SamplingParams

    model = build_model("smollm2-135m", dtype=torch.float32)
    expected = [hf_greedy(model, p, 16) for p in prompts]
    greedy = SamplingParams(max_tokens=16, ignore_eos=True)
    hot = [SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, top_k=50, seed=s,
                          ignore_eos=True) for s in range(len(prompts))]
    runs = []
    for cuda_graphs in (True, True, False):
        engine = Engine(model, num_blocks=200, block_size=16, max_num_seqs=16,
                        max_num_batched_tokens=256, cuda_graphs=cuda_graphs)
        assert bool(engine.runner.graphs) == cuda_graphs
        ids, final = {}, {}
        for step in range(400):
            if step < len(prompts):  # one greedy and one sampled request join each step
                ids[engine.add_request(prompts[step], greedy)] = ("greedy", step)
                ids[engine.add_request(prompts[step], hot[step])] = ("hot", step)
            if step == 3:
                engine.abort(max(ids))
                ids.pop(max(ids))
            final.update({o.request_id: o.output_token_ids for o in engine.step() if o.finished})
            if step >= len(prompts) and not engine.has_unfinished_requests():
                break
        m = engine.scheduler.manager
        assert not m.seq_ids and m.num_free_blocks == m.num_blocks
        got = {ids[rid]: out for rid, out in final.items()}
        assert [got["greedy", i] for i in range(len(prompts))] == expected
        runs.append({k: v for k, v in got.items() if k[0] == "hot"})
    assert runs[0] == runs[1] == runs[2], "seeded sampling differs between runs or graph modes"


def test_reservation_baselines_on_the_gpu(prompts):
    """Each reservation policy on the GPU (graphs on): transformers' tokens, nothing left."""
    from paged_bench.engine import build_model
    from paged_ref.engine import Engine

    model = build_model("smollm2-135m", dtype=torch.float32)
    expected = [hf_greedy(model, p, 8) for p in prompts]
    for policy in ("paged", "reserve_max", "reserve_pow2", "reserve_oracle"):
        engine = Engine(model, num_blocks=64, block_size=16, max_model_len=320,
                        reservation=policy)
        assert engine.generate(prompts, 8, ignore_eos=True) == expected, policy
        assert engine.scheduler.manager.num_free_blocks == 64


def test_parallel_samples_and_beam_search_on_the_gpu(prompts):
    """Forks on the GPU (float32, CUDA graphs on and off): sample i of a seeded request with
    n = 4 draws what a request seeded with ``sample_seed(i)`` draws alone (the 1-token prompt's
    first step is a replayed decode step whose row is sampled 4 times), graphs or not; beam
    search equals transformers' sequences and scores, graphs or not; nothing is left."""
    from paged_bench.engine import build_model
    from paged_ref.engine import Engine, SamplingParams
    from tests.engine.test_beam_search import assert_same_beams

    model = build_model("smollm2-135m", dtype=torch.float32)

    def hot(seed, n=1):
        return SamplingParams(max_tokens=12, temperature=0.9, top_k=50, seed=seed, n=n,
                              ignore_eos=True)

    def engine(cuda_graphs):
        e = Engine(model, num_blocks=200, block_size=16, max_num_seqs=32,
                   max_num_batched_tokens=512, cuda_graphs=cuda_graphs)
        assert bool(e.runner.graphs) == cuda_graphs
        return e

    samples = {}
    for cuda_graphs in (True, False):
        e = engine(cuda_graphs)
        samples[cuda_graphs] = e.generate(prompts[:4], params=[hot(s, n=4) for s in range(4)])
        assert not e.scheduler.manager.seq_ids
    assert samples[True] == samples[False], "graphs changed the samples"
    e = engine(True)
    for s, got in enumerate(samples[True]):
        alone = [e.generate([prompts[s]], params=hot(hot(s).sample_seed(i)))[0] for i in range(4)]
        assert got == alone, f"prompt {s}: a sample is not its own seed's"
    with torch.inference_mode():
        want = []
        for p in prompts[:4]:
            ids = torch.tensor([p], device="cuda")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), num_beams=4,
                                 num_return_sequences=4, do_sample=False, max_new_tokens=8,
                                 output_scores=True, return_dict_in_generate=True,
                                 eos_token_id=None, pad_token_id=0)
            want.append((out.sequences[:, len(p):].tolist(), out.sequences_scores.tolist()))
    for cuda_graphs in (True, False):
        e = engine(cuda_graphs)
        for out, w in zip(e.beam_search(prompts[:4], 4, 8, ignore_eos=True), want, strict=True):
            assert_same_beams(([c.token_ids for c in out.outputs],
                               [c.score for c in out.outputs]), w, f"graphs={cuda_graphs}")
        m = e.scheduler.manager
        assert not m.seq_ids and m.num_free_blocks == m.num_blocks
