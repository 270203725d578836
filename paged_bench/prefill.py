"""``python -m paged_bench prefill``: prefill attention against tensor-core compute.

Prefill is compute-bound, so the yardstick is TFLOP/s, not GB/s:

1. Measures this GPU's dense bf16 matmul rate (8192^3 ``torch.matmul``): the practical ceiling.
2. Runs each backend on the prefill cases below (bf16, 32 query / 8 KV heads, head_dim 128,
   block 16): ``triton`` (our kernel, launched directly on inputs checked once, like a serving
   engine that validates a step once), ``auto`` (the public ``paged_prefill``, checks
   included), ``auto_planned`` (the public call with a :func:`paged_ref.plan_prefill` made once:
   no value read back), ``torch`` (the reference, where it fits in memory), and the peers:
   FlashInfer's ``BatchPrefillWithPagedKVCacheWrapper`` (NHD, page 16; ``plan`` outside the
   timing) and PyTorch SDPA (flash, causal) on a contiguous cache (no paging: the ceiling).
   FLOPs are counted exactly for the causal mask (:func:`paged_ref.cache_math.attention_flops`).
   Every output is checked against a float64 answer on the last rows of every sequence (the
   rows that see the most keys). Times: ``triton.testing.do_bench`` medians, L2 flushed.
3. Also: the tile-shape sweep (``--sweep-configs``), the write path (``write_kv`` with torch
   vs the Triton store kernel, GB/s) and decode run as a case of the prefill kernel vs the
   decode kernels (GB/s), and writes JSON stamped with GPU, versions and date + a plot.
4. ``--kv-formats fp8,int4,...``: each case again over a quantised cache (rows with
   ``kind: "prefill_quant"`` and ``kv_format``): our kernel de-quantising in registers, the
   torch backend (gather and de-quantise, then attend) and FlashInfer's prefill over an FP8
   cache (per-tensor scale), each checked against float64 of the de-quantised cache.

On a machine without a CUDA GPU it refuses and lists the cases with their FLOPs and bytes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from paged_bench.common import check_then_time, flashinfer_page_table, suite_parser
from paged_bench.decode import SHAPE
from paged_course.results import environment, write_result
from paged_course.testing import PrefillInputs, make_prefill_inputs
from paged_course.timing import gbps, matmul_tflops, time_ms
from paged_ref.cache_math import attention_flops, dtype_bytes, kv_bytes_per_token
from paged_ref.quant import KVFormat, QuantizedKV

#: name -> [(seq_len, q_len), ...]: q_len new tokens at the end of a sequence of seq_len.
CASES: dict[str, list[tuple[int, int]]] = {
    "P8_L2048": [(2048, 2048)] * 8,
    "P8_L2048_prefix4096": [(6144, 2048)] * 8,
    "P1_L16384": [(16384, 16384)],
    "P32_chunk512_ctx8192": [(8192 + 512, 512)] * 32,
    "mixed_P4_L2048_D64_ctx4096": [(2048, 2048)] * 4 + [(4096, 1)] * 64,
}
OURS = ("torch", "triton", "auto", "auto_planned")
PEERS = ("flashinfer", "sdpa_contiguous")
#: The torch reference materialises [heads, q_len, seq_len] fp32 scores per sequence.
TORCH_MAX_SCORE_BYTES = 8 << 30
CHECK_ROWS = 64
DEVICE = "cuda"  # tests run the driver on the CPU with tiny shapes


def case_flops(pairs: list[tuple[int, int]]) -> int:
    return sum(attention_flops(s, q, SHAPE["num_q_heads"], SHAPE["head_dim"]) for s, q in pairs)


def case_bytes(pairs: list[tuple[int, int]], kv_format=None) -> int:
    """K and V of every cached token read once (in ``kv_format``, scales included; default
    the bf16 values), plus q and the output (bf16)."""
    stored = SHAPE["dtype"] if kv_format is None else KVFormat.parse(kv_format)
    per_token_kv = kv_bytes_per_token(num_layers=1, num_kv_heads=SHAPE["num_kv_heads"],
                                      head_dim=SHAPE["head_dim"], dtype=stored)
    per_row_q = 2 * SHAPE["num_q_heads"] * SHAPE["head_dim"] * dtype_bytes(SHAPE["dtype"])
    return sum(s * per_token_kv + q * per_row_q for s, q in pairs)


def build(pairs, seed=0, kv_format=None) -> PrefillInputs:
    seq_lens, q_lens = zip(*pairs, strict=True)
    inp = make_prefill_inputs(list(seq_lens), list(q_lens), device=DEVICE, seed=seed, **SHAPE)
    return inp if kv_format is None else inp.quantized(kv_format)


def last_rows(inp: PrefillInputs, rows: int):
    """(row indices, inputs for just those rows): the last ``rows`` queries of each sequence
    are themselves a valid prefill (same sequences, fewer query rows)."""
    starts = inp.query_start_loc.tolist()
    idx, new_starts = [], [0]
    for b in range(len(starts) - 1):
        n = min(rows, starts[b + 1] - starts[b])
        idx += range(starts[b + 1] - n, starts[b + 1])
        new_starts.append(new_starts[-1] + n)
    idx_t = torch.tensor(idx, device=DEVICE)
    sub = PrefillInputs(inp.q[idx_t], inp.k_cache, inp.v_cache, inp.block_tables, inp.seq_lens,
                        torch.tensor(new_starts, dtype=torch.int32, device=DEVICE))
    return idx_t, sub


def reference_rows(inp: PrefillInputs):
    """(row indices, float64 answer for them), computed on the GPU in float64."""
    from paged_ref.prefill import prefill_attention_torch

    idx, sub = last_rows(inp, CHECK_ROWS)
    k, v = (c.dequantize(torch.float64) if isinstance(c, QuantizedKV) else c.double()
            for c in (sub.k_cache, sub.v_cache))  # (a quantised cache: the values it stands for)
    ref = prefill_attention_torch(sub.q.double(), k, v, sub.block_tables, sub.seq_lens,
                                  sub.query_start_loc)
    return idx, ref


def our_runners(inp, pairs, backends, configs):
    from paged_ref.kernels.triton.prefill import paged_prefill_triton
    from paged_ref.prefill import paged_prefill, prefill_attention_torch
    from paged_ref.prefill_plan import plan_prefill

    args = inp.args()
    q_lens = [q for _, q in pairs]
    out = torch.empty_like(inp.q)
    runners = {}
    if "triton" in backends:
        runners["triton"] = ("triton", {}, lambda: paged_prefill_triton(
            *args, query_lens=q_lens, out=out))
        for cfg in configs:
            label = config_label(cfg)
            runners[label] = ("triton", {"config": vars(cfg).copy(), "sweep": "configs"},
                              lambda c=cfg: paged_prefill_triton(*args, query_lens=q_lens,
                                                                 config=c, out=out))
    if "auto" in backends:
        runners["auto"] = ("auto", {"includes_checks": True}, lambda: paged_prefill(*args))
    if "auto_planned" in backends:  # plan_prefill once (as FlashInfer's plan()), then the call
        plan = plan_prefill(q_lens, [s for s, _ in pairs], num_q_heads=inp.q.shape[1],
                            num_kv_heads=inp.k_cache.shape[2], head_dim=inp.q.shape[2],
                            block_size=inp.k_cache.shape[1], dtype=inp.q.dtype,
                            device=inp.q.device, kv_format=getattr(inp.k_cache, "format", None))
        runners["auto_planned"] = ("auto_planned", {}, lambda: paged_prefill(*args, plan=plan))
    score_bytes = max(SHAPE["num_q_heads"] * q * s * 4 for s, q in pairs)
    if "torch" in backends and score_bytes <= TORCH_MAX_SCORE_BYTES:
        runners["torch"] = ("torch", {}, lambda: prefill_attention_torch(*args))
    return runners


def flashinfer_runner(inp: PrefillInputs) -> dict:
    """FlashInfer's paged prefill (NHD, the cache's own pages), plan() done once here."""
    try:
        import flashinfer
    except ImportError:
        return {}
    _, block_size, num_kv_heads, head_dim = inp.k_cache.shape
    indptr, indices, last = flashinfer_page_table(inp.block_tables, inp.seq_lens, block_size)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
    wrapper.plan(inp.query_start_loc, indptr, indices, last, inp.q.shape[1], num_kv_heads,
                 head_dim, block_size, causal=True, q_data_type=inp.q.dtype,
                 kv_data_type=inp.k_cache.dtype)
    return {"flashinfer": ("flashinfer", {"version": flashinfer.__version__},
                           lambda: wrapper.run(inp.q, (inp.k_cache, inp.v_cache)))}


def sdpa_runner(inp: PrefillInputs, pairs) -> dict:
    """SDPA, flash backend, on a contiguous [B, H, L, D] cache; only for batches of equal
    shapes (causal aligned bottom-right when a prefix is cached)."""
    if len(set(pairs)) != 1:
        return {}
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right

    from paged_ref.reference import gather_kv

    (seq_len, q_len), batch = pairs[0], len(pairs)
    k, v, _ = gather_kv(inp.k_cache, inp.v_cache, inp.block_tables, inp.seq_lens, seq_len)
    k, v = k.transpose(1, 2).contiguous(), v.transpose(1, 2).contiguous()  # [B, Hkv, L, D]
    q = inp.q.view(batch, q_len, *inp.q.shape[1:]).transpose(1, 2)  # [B, Hq, q_len, D]
    mask = None if q_len == seq_len else causal_lower_right(q_len, seq_len)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    group = q.shape[1] // k.shape[1]
    # Also with K/V repeated to every query head (plain multi-head attention), in case the
    # flash backend handles GQA less well than MHA.
    k_mha, v_mha = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)

    def run(k=k, v=v, gqa=True):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            if mask is None:
                o = sdpa(q, k, v, is_causal=True, enable_gqa=gqa)
            else:
                o = sdpa(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return o.transpose(1, 2).reshape(inp.q.shape)

    return {"sdpa_contiguous": ("sdpa_contiguous", {"flash": True, "gqa": True}, run),
            "sdpa_contiguous[mha]": ("sdpa_contiguous", {"flash": True, "gqa": False},
                                     lambda: run(k_mha, v_mha, False))}


def timed_rows(name, runners, idx, ref, pairs, peak, kv_format=None) -> list[dict]:
    """Check every runner's output rows ``idx`` against ``ref``, time the runners, and make
    their rows: TFLOP/s and its share of the matmul rate ``peak``, GB/s of the bytes read (in
    ``kv_format``). Over a quantised cache a row also gets ``kind``, ``kv_format`` and the
    format in its label."""
    from paged_course.checks import relative_error

    flops, nbytes = case_flops(pairs), case_bytes(pairs, kv_format)
    rows = []
    for m in check_then_time(name if kv_format is None else f"{name} {kv_format}", runners,
                             lambda out: relative_error(out[idx], ref), passes=1):
        tflops = flops / (m.ms * 1e-3) / 1e12
        row = m.row(name, tflops=tflops, pct_peak_tflops=100 * tflops / peak,
                    gbps=gbps(nbytes, m.ms), flops=flops, bytes=nbytes)
        if kv_format is not None:
            row.update(kind="prefill_quant", kv_format=kv_format, label=f"{m.label} {kv_format}")
        rows.append(row)
        print(f"{name:28s} {row['label']:26s} {m.ms:8.3f} ms {tflops:6.1f} TFLOP/s "
              f"({100 * tflops / peak:4.1f}% of matmul) err {m.error:.1e}", flush=True)
    return rows


def run_case(name, pairs, backends, configs, peak):
    inp = build(pairs)
    idx, ref = reference_rows(inp)
    runners = our_runners(inp, pairs, backends, configs)
    if "flashinfer" in backends:
        runners.update(flashinfer_runner(inp))
    if "sdpa_contiguous" in backends:
        try:
            runners.update(sdpa_runner(inp, pairs))
        except Exception as exc:
            print(f"{name} sdpa: skipped ({type(exc).__name__}: {str(exc)[:100]})")
    rows = timed_rows(name, runners, idx, ref, pairs, peak)
    for row in rows:  # the fastest label of each backend (e.g. SDPA with GQA or repeated K/V)
        row["best"] = row is max((r for r in rows if r["backend"] == row["backend"]
                                  and not r.get("sweep")), key=lambda r: r["tflops"])
    del inp, runners
    torch.cuda.empty_cache()
    return rows


def flashinfer_fp8_runner(inp: PrefillInputs) -> dict:
    """FlashInfer's paged prefill over the same FP8 codes (e4m3, one scale per tensor, given
    to ``run`` as ``k_scale`` / ``v_scale``), when installed. Its FA2 kernels: 0.5.3's Hopper
    (FA3) prefill does not compile for bf16 queries over an e4m3 cache."""
    try:
        import flashinfer
    except ImportError:
        return {}
    k, v = inp.k_cache, inp.v_cache
    _, block_size, num_kv_heads, head_dim = k.shape
    indptr, indices, last = flashinfer_page_table(inp.block_tables, inp.seq_lens, block_size)
    workspace = torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
    try:
        wrapper.plan(inp.query_start_loc, indptr, indices, last, inp.q.shape[1], num_kv_heads,
                     head_dim, block_size, causal=True, q_data_type=inp.q.dtype,
                     kv_data_type=k.data.dtype)
    except Exception as exc:  # (its JIT compiles here)
        print(f"flashinfer fp8 prefill: skipped ({type(exc).__name__}: {str(exc)[:160]})")
        return {}
    scales = dict(k_scale=float(k.scale), v_scale=float(v.scale))
    return {"flashinfer": ("flashinfer", {"version": flashinfer.__version__, "kernels": "fa2"},
                           lambda: wrapper.run(inp.q, (k.data, v.data), **scales))}


def quant_rows(name, pairs, kv_format, backends, peak) -> list[dict]:
    """One case over a ``kv_format`` cache: our kernel (``triton``), the torch backend where its
    scores fit, FlashInfer for per-tensor FP8; TFLOP/s and GB/s of the quantised bytes."""
    from paged_ref.kernels.triton.prefill import paged_prefill_triton
    from paged_ref.prefill import prefill_attention_torch

    inp = build(pairs, kv_format=kv_format)
    idx, ref = reference_rows(inp)
    args, q_lens, out = inp.args(), [q for _, q in pairs], torch.empty_like(inp.q)
    runners = {}
    if "triton" in backends:
        runners["triton"] = ("triton", {}, lambda: paged_prefill_triton(
            *args, query_lens=q_lens, out=out))
    if "torch" in backends and max(
            SHAPE["num_q_heads"] * q * s * 4 for s, q in pairs) <= TORCH_MAX_SCORE_BYTES:
        runners["torch"] = ("torch", {}, lambda: prefill_attention_torch(*args))
    if "flashinfer" in backends and KVFormat.parse(kv_format).name == "fp8":
        runners.update(flashinfer_fp8_runner(inp))
    rows = timed_rows(name, runners, idx, ref, pairs, peak, kv_format)
    del inp, runners
    torch.cuda.empty_cache()
    return rows


def quant_table(result: dict) -> list[dict]:
    """A committed run's prefill over quantised caches, a row per case: our kernel's ms over
    bf16 and each format (and each format's time / bf16's), the torch backend over FP8 (what
    the engine ran before the kernel read quantised caches; None where not timed) and
    FlashInfer's FP8 prefill."""
    ms = {(r["case"], r["label"]): r["ms"] for r in result["results"] if "tflops" in r}
    table = []
    for case in dict.fromkeys(r["case"] for r in result["results"] if r.get("kv_format")):
        bf16 = ms[(case, "triton")]
        row = {"case": case, "bf16 ms": bf16}
        for fmt in dict.fromkeys(r["kv_format"] for r in result["results"]
                                 if r["case"] == case and r.get("kv_format")):
            row[f"{fmt} ms"] = ms[(case, f"triton {fmt}")]
            row[f"{fmt} / bf16"] = ms[(case, f"triton {fmt}")] / bf16
        row["torch fp8 ms"] = ms.get((case, "torch fp8"))
        row["FlashInfer fp8 ms"] = ms.get((case, "flashinfer fp8"))
        table.append(row)
    return table


def write_path_rows(num_tokens: int = 16384) -> list[dict]:
    """``write_kv`` of one prefill's new K/V (16,384 tokens) into shuffled slots: GB/s of the
    torch scatter vs the Triton store kernel (bytes read + written)."""
    from paged_ref.kernels.triton.store import write_kv_triton
    from paged_ref.kv_write import write_kv_torch

    hkv, d = SHAPE["num_kv_heads"], SHAPE["head_dim"]
    num_slots = 4 * num_tokens
    k_cache = torch.randn(num_slots // 16, 16, hkv, d, device=DEVICE, dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    k = torch.randn(num_tokens, hkv, d, device=DEVICE, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    slots = torch.randperm(num_slots, device=DEVICE)[:num_tokens].to(torch.int32)
    nbytes = 2 * 2 * k.numel() * k.element_size()
    rows = []
    for backend, fn in (("write_torch", write_kv_torch), ("write_triton", write_kv_triton)):
        fn(k, v, k_cache, v_cache, slots)
        ok = torch.equal(k_cache.view(-1, hkv, d)[slots.long()], k)
        ms = time_ms(lambda f=fn: f(k, v, k_cache, v_cache, slots))
        rows.append({"case": f"write_{num_tokens}_tokens", "backend": backend, "label": backend,
                     "ms": ms, "gbps": gbps(nbytes, ms), "bytes": nbytes,
                     "rel_err": 0.0 if ok else 1.0, "kind": "write"})
        print(f"write {num_tokens} tokens {backend:14s} {ms:.4f} ms "
              f"{rows[-1]['gbps']:.0f} GB/s ok={ok}", flush=True)
    return rows


def decode_rows(batch: int = 64, seq_len: int = 4096) -> list[dict]:
    """Decode (one query per sequence) through the prefill kernel vs the decode kernels, GB/s
    of K/V + q + out: is decode just a case of the prefill kernel?"""
    from paged_bench.decode import bytes_moved
    from paged_course.checks import relative_error
    from paged_course.testing import make_paged_inputs
    from paged_ref.kernels.triton.decode import paged_attention_triton
    from paged_ref.kernels.triton.prefill import paged_prefill_triton
    from paged_ref.kernels.triton.split import paged_attention_split, plan_for_inputs
    from paged_ref.reference import paged_attention_torch
    from paged_ref.validation import Lengths

    inp = make_paged_inputs([seq_len] * batch, device=DEVICE, **SHAPE)
    ref = paged_attention_torch(inp.q.double(), inp.k_cache.double(), inp.v_cache.double(),
                                inp.block_tables, inp.seq_lens, max_len=seq_len)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    plan = plan_for_inputs(inp.q, inp.k_cache, Lengths(seq_len, seq_len * batch))
    runners = {
        "triton_prefill": lambda: paged_prefill_triton(*inp.args(), starts,
                                                       query_lens=[1] * batch),
        "triton": lambda: paged_attention_triton(*inp.args()),
        "triton_split": lambda: paged_attention_split(*inp.args(), plan=plan),
    }
    nbytes = bytes_moved(inp)
    rows = []
    for label, fn in runners.items():
        err = relative_error(fn(), ref)
        ms = time_ms(fn)
        rows.append({"case": f"decode_B{batch}_L{seq_len}", "backend": label, "label": label,
                     "ms": ms, "gbps": gbps(nbytes, ms), "bytes": nbytes,
                     "rel_err": err, "kind": "decode"})
        print(f"decode B{batch} L{seq_len} {label:16s} {ms:.4f} ms {rows[-1]['gbps']:.0f} GB/s "
              f"err {err:.1e}", flush=True)
    return rows


#: Tile shapes timed with --sweep-configs: (block_m, block_n, num_warps, num_stages).
SWEEP = [(256, 64, 8, 2), (256, 64, 8, 3), (256, 128, 8, 2), (256, 32, 8, 2), (256, 64, 16, 2),
         (256, 128, 16, 2), (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 2),
         (128, 32, 4, 2)]


def config_label(config) -> str:
    """The sweep label of a tile shape, e.g. ``triton[m256,n64,w8,s3]``."""
    return f"triton[m{config.block_m},n{config.block_n},w{config.num_warps},s{config.num_stages}]"


def our_row(result: dict, case: str) -> dict | None:
    """The row of our kernel as ``paged_prefill`` runs it with today's default tile shape.

    Normally the row labelled ``triton``. When a run was made with an older default, the sweep
    row timed with today's default shape is the same launch, so it is used instead -- except in
    a mixed batch, where the default path is two launches (the row labelled ``triton``)."""
    from paged_ref.kernels.triton.prefill import SHORT_CONFIG, default_config

    rows = {r.get("label"): r for r in result["results"] if r["case"] == case}
    q_lens = [q for _, q in result.get("cases", {}).get(case, [])]
    short = max(1, SHORT_CONFIG.block_m // (SHAPE["num_q_heads"] // SHAPE["num_kv_heads"]))
    mixed = any(q <= short for q in q_lens) and any(q > short for q in q_lens)
    label = config_label(default_config(SHAPE["head_dim"], SHAPE["dtype"], interpret=False))
    return rows.get("triton") if mixed or label not in rows else rows[label]


def plot(result: dict, path: Path) -> None:
    """Grouped bars: TFLOP/s per case, one bar per backend (its fastest label, sweep rows
    aside), and the dense matmul rate as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    peers = [r for r in result["results"] if "tflops" in r and r.get("best")
             and r["backend"] != "triton"]
    cases = dict.fromkeys(r["case"] for r in peers)
    rows = [our_row(result, c) for c in cases if our_row(result, c)] + peers
    cases = list(dict.fromkeys(r["case"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    width = 0.8 / max(len(backends), 1)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, backend in enumerate(backends):
        pts = [(j, r["tflops"]) for j, case in enumerate(cases) for r in rows
               if r["case"] == case and r["backend"] == backend]
        ax.bar([j + (i - (len(backends) - 1) / 2) * width for j, _ in pts],
               [t for _, t in pts], width, label=backend)
    ax.axhline(result["matmul_tflops"], color="k", lw=0.8, ls="--", label="dense bf16 matmul")
    ax.set_xticks(range(len(cases)), [c.replace("_", "\n", 1) for c in cases], fontsize=8)
    ax.set_ylabel("TFLOP/s (causal FLOPs counted exactly)")
    ax.set_title(f"Paged prefill, bf16, 32 q / 8 kv heads, d=128, block 16 — {result['gpu']}, "
                 f"{result['date']}", fontsize=9)
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    p = suite_parser("prefill", __doc__, out="prefill.json", cases=CASES, backends=OURS + PEERS)
    p.add_argument("--sweep-configs", action="store_true",
                   help="also time the Triton kernel over a grid of tile shapes")
    p.add_argument("--no-extras", action="store_true",
                   help="skip the write-path and decode comparisons")
    p.add_argument("--kv-formats", default="",
                   help="also run each case over these quantised caches (comma-separated, e.g. "
                        "fp8,fp8_token_head,int4)")
    args = p.parse_args(argv)
    args.kv_formats = [f for f in args.kv_formats.split(",") if f]
    for fmt in args.kv_formats:
        KVFormat.parse(fmt)  # an unknown name is an error before any GPU work
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = args.cases
    if not torch.cuda.is_available():
        print("No CUDA GPU here, so no TFLOP/s: timings on a CPU or in Triton's interpreter say "
              "nothing about tensor cores.\nCommitted GPU results are in results/. The cases, "
              "their FLOPs and bytes:")
        for name in cases:
            pairs = CASES[name]
            flops, nbytes = case_flops(pairs), case_bytes(pairs)
            print(f"  {name:28s} {flops / 1e9:9.1f} GFLOP {nbytes / 1e6:8.1f} MB "
                  f"{flops / nbytes:6.0f} FLOP/byte")
        return 2
    from paged_ref.kernels.triton.prefill import PrefillConfig

    configs = [PrefillConfig(*c) for c in SWEEP] if args.sweep_configs else []
    env = environment()
    peak = matmul_tflops(device=DEVICE)
    print(f"{env['gpu']}: dense bf16 matmul {peak:.0f} TFLOP/s (torch {env['torch']}, "
          f"triton {env['triton']}, flashinfer {env['flashinfer']})", flush=True)
    result = {**env, "matmul_tflops": peak, "shape": {**SHAPE, "dtype": "bfloat16"},
              "cases": {n: CASES[n] for n in cases}, "results": []}
    for name in cases:
        result["results"] += run_case(name, CASES[name], args.backends, configs, peak)
        write_result(result, args.out)  # partial results survive a time-out
        for fmt in args.kv_formats:
            result["results"] += quant_rows(name, CASES[name], fmt, args.backends, peak)
            write_result(result, args.out)
    if not args.no_extras:
        result["results"] += write_path_rows() + decode_rows()
    out = write_result(result, args.out)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
