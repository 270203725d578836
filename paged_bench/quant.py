"""``python -m paged_bench quant``: decode over FP8 and INT4 caches vs bf16.

The standard decode cases (32 query heads, 8 KV heads, head_dim 128, block 16, q in bf16) with
the cache stored as bf16, ``fp8`` (e4m3, one scale per layer, as vLLM), ``fp8_token_head``,
``int4`` (two (scale, zero) pairs per token-head, one per half) and ``int4_g128`` (one pair);
next to FlashInfer's paged decode on bf16 and on an FP8 (e4m3) cache with the same codes and
scales. Bytes are what the kernel must read: codes plus per-token scales (plus q, out and
tables), so % of copy bandwidth is comparable across formats.

Per row: ``rel_err`` against the float64 answer for the *de-quantised* cache (is the kernel
right?) and ``rel_err_vs_bf16`` against the float64 answer for the bf16 cache (what the format
costs). Timing as in :mod:`paged_bench.decode` (median of do_bench, L2 flushed, the
better of two passes after a warm-up). do_bench flushes by zeroing 256 MB, which leaves the L2
full of dirty lines that a decode kernel (it only reads) pays for writing back: each row also
has ``ms_clean_l2`` (and its ``pct_copy_bw_clean_l2``), the same call after a flush that leaves
the L2 clean (:func:`~paged_course.timing.clean_l2_ms`), and ``copy_ms`` /
``copy_ms_clean_l2``, a plain copy of the row's bytes (half read, half written) timed both
ways: the floor any kernel of that many bytes meets. Refuses on a machine without a CUDA GPU.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from paged_bench.common import (
    check_then_time,
    flashinfer_page_table,
    name_list,
    suite_parser,
)
from paged_bench.decode import CASES, SHAPE, bytes_moved
from paged_course.checks import relative_error
from paged_course.results import environment, write_result
from paged_course.testing import PagedInputs, make_paged_inputs
from paged_course.timing import clean_l2_ms, copy_bandwidth_gbps, gbps, time_ms
from paged_ref.quant import KVFormat, QuantizedKV, dequantize

FORMATS = ("bf16", "fp8", "fp8_token_head", "int4", "int4_g128")
#: Cases with enough work to be bandwidth-bound (B4_L2048 is launch-bound).
LARGE_CASES = ("B64_L4096", "B8_L32768", "B1_L131072", "B256_L1024", "B32_ragged")


def float64_reference(inp: PagedInputs) -> torch.Tensor:
    """float64 decode attention of ``inp`` (a quantised cache is de-quantised first)."""
    from paged_ref.reference import paged_attention_torch

    k, v = inp.k_cache, inp.v_cache
    if isinstance(k, QuantizedKV):
        k, v = dequantize(k, torch.float64), dequantize(v, torch.float64)
    return paged_attention_torch(inp.q.double(), k.double(), v.double(), inp.block_tables,
                                 inp.seq_lens, max_len=int(inp.seq_lens.max()))


def same_bytes_copy(nbytes: int) -> dict:
    """A plain device-to-device copy that moves ``nbytes`` (half read, half written), timed as
    the rows are: ``copy_ms`` (do_bench) and ``copy_ms_clean_l2``."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return dict(copy_ms=time_ms(lambda: dst.copy_(src)),
                copy_ms_clean_l2=clean_l2_ms(lambda: dst.copy_(src)))


def our_runners(inp: PagedInputs, configs=()) -> dict:
    """label -> (backend, info, callable): the kernel ``paged_attention`` runs for these inputs
    (the split kernel with the plan it would make, made once outside the timing; a one-chunk
    plan is the one-pass kernel) and, for FP8 and INT4 caches on a GPU that can build them,
    the CUDA kernels (:func:`cuda_runners`); or with ``configs`` the one-pass Triton kernel at
    each config."""
    from paged_ref.kernels.triton.decode import paged_attention_triton
    from paged_ref.kernels.triton.split import SplitScratch, paged_attention_split, plan_for_inputs
    from paged_ref.validation import Lengths

    out = torch.empty_like(inp.q)
    args = inp.args()
    if configs:
        return {f"triton[{c.label}]": (
            "triton", {"config": vars(c).copy(), "sweep": "configs"},
            lambda c=c: paged_attention_triton(*args, config=c, out=out)) for c in configs}
    lengths = Lengths(int(inp.seq_lens.max()), int(inp.seq_lens.sum()))
    plan = plan_for_inputs(inp.q, inp.k_cache, lengths)
    batch, num_q_heads, head_dim = inp.q.shape
    scratch = SplitScratch.allocate(batch, num_q_heads, inp.k_cache.shape[2], head_dim, plan,
                                    inp.q.device)
    backend = "triton_split" if plan.num_chunks > 1 else "triton"
    runners = {backend: (backend, {"num_chunks": plan.num_chunks},
                         lambda: paged_attention_split(*args, plan=plan, out=out,
                                                       scratch=scratch))}
    return runners | cuda_runners(inp, lengths, out)


def cuda_runners(inp: PagedInputs, lengths, out: torch.Tensor) -> dict:
    """The hand-written CUDA kernels (:mod:`paged_ref.kernels.cuda`) on an FP8 cache or an
    ``int4`` one (backend ``cuda_fp8`` / ``cuda_int4``), with their default launch shape,
    where this machine can build and run them: planned once outside the timing, as the Triton
    runner's split is (the timed call is ``plan.run``)."""
    from paged_ref.kernels.cuda import cuda_kernels_available, plan_cuda

    fmt = getattr(inp.k_cache, "format", None)
    if fmt is None or fmt.name not in ("fp8", "fp8_token_head", "int4") or (
            not cuda_kernels_available(inp.q.device)):
        return {}
    args = inp.args()
    plan = plan_cuda(*args, max_len=lengths.max_len, total_tokens=lengths.total_tokens)
    info = {"stages": plan.stages, "chunk_len": plan.chunk_len,
            "heads_per_cta": plan.heads_per_cta,
            "warps_per_head": plan.threads // 32 // plan.heads_per_cta}
    backend = f"cuda_{fmt.kind}"
    return {backend: (backend, info, lambda: plan.run(*args, out=out))}


def flashinfer_runners(inp: PagedInputs) -> dict:
    """FlashInfer's paged decode (NHD), tensor cores on and off, on this cache: bf16 values, or
    fp8 per-tensor codes with their scales (``k_scale`` / ``v_scale`` of ``run``)."""
    try:
        import flashinfer
    except ImportError:
        return {}
    k, v = inp.k_cache, inp.v_cache
    scales = {}
    if isinstance(k, QuantizedKV):
        if k.format != KVFormat.fp8("tensor"):
            return {}  # FlashInfer reads per-tensor-scaled fp8, not these formats
        scales = {"k_scale": float(k.scale), "v_scale": float(v.scale)}
        k, v = k.data, v.data
    _, num_q_heads, head_dim = inp.q.shape
    _, block_size, num_kv_heads, _ = k.shape
    indptr, indices, last = flashinfer_page_table(inp.block_tables, inp.seq_lens, block_size)
    # Tensor cores on (FlashInfer's faster decode on the H200, bench.json); off only if that
    # fails for this cache type. (Each kernel family JIT-compiles on first use.)
    for tc in (True, False):
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=tc)
        try:
            wrapper.plan(indptr, indices, last, num_q_heads, num_kv_heads, head_dim, block_size,
                         q_data_type=inp.q.dtype, kv_data_type=k.dtype)
            wrapper.run(inp.q, (k, v), **scales)
        except Exception as exc:
            print(f"flashinfer tc={tc} on {k.dtype}: {type(exc).__name__}: {str(exc)[:160]}")
            continue
        return {f"flashinfer[tc={tc}]": (
            "flashinfer", {"use_tensor_cores": tc, "version": flashinfer.__version__},
            lambda w=wrapper: w.run(inp.q, (k, v), **scales))}
    return {}


def run_case(name: str, lens: list[int], formats, who: str, copy_bw: float, configs=()):
    """Rows for one case: ``who`` is ``"ours"`` (every format), ``"sweep"`` (ours at each of
    ``configs``) or ``"flashinfer"`` (the formats FlashInfer reads: bf16, fp8)."""
    plain = make_paged_inputs(lens, device="cuda", seed=0, **SHAPE)
    ref_bf16 = float64_reference(plain)
    rows = []
    for fmt in formats:
        if who == "flashinfer" and fmt not in ("bf16", "fp8"):
            continue
        inp = plain if fmt == "bf16" else plain.quantized(fmt)
        ref = ref_bf16 if fmt == "bf16" else float64_reference(inp)
        runners = (flashinfer_runners(inp) if who == "flashinfer"
                   else our_runners(inp, configs if who == "sweep" else ()))
        nbytes = bytes_moved(inp)

        def errors(out, ref=ref):  # vs this format's own answer, and vs the bf16 cache's
            return relative_error(out, ref), relative_error(out, ref_bf16)

        measured_rows = check_then_time(f"{name} {fmt}", runners, errors, passes=2)
        floor = same_bytes_copy(nbytes) if measured_rows else {}
        for m in measured_rows:
            err, err_bf16 = m.error
            rate = gbps(nbytes, m.ms)
            clean = min(clean_l2_ms(m.fn) for _ in range(2))  # (the better of two, as m.ms)
            rows.append(m.row(name, kv_format=fmt, label=f"{m.label}[{fmt}]", gbps=rate,
                              pct_copy_bw=100 * rate / copy_bw, rel_err=err,
                              rel_err_vs_bf16=err_bf16, bytes=nbytes, ms_passes=m.ms_passes,
                              ms_clean_l2=clean,
                              pct_copy_bw_clean_l2=100 * gbps(nbytes, clean) / copy_bw,
                              **floor))
        del inp, ref, runners
        torch.cuda.empty_cache()
    return rows


def family(row: dict) -> str:
    """Whose kernel a row timed: ``"ours"`` (Triton), ``"ours-CUDA"`` or ``"FlashInfer"``."""
    from paged_course.quant_deep import family as kernel_family

    return {"Triton": "ours", "CUDA": "ours-CUDA", "FlashInfer": "FlashInfer"}[
        kernel_family(row)]


def read_ceiling(result: dict, case: str, kv_format: str = "int4") -> dict:
    """From a read-ceiling measurement (the ``int4_read_ceiling`` / ``fp8_read_ceiling`` parts
    of ``results/h200/short_calls_study.json``: kernels that only read a case's cache through
    its table, with ``rows`` and ``copy_bw_gbps``; docs/lab_notes.md), for one case and cache
    format, the fastest row (by ``ms``, over the turns) of the ``kernel``, of the best bare paged
    ``reader`` (the rings that read every byte the kernel does: not the codes-only one) and of
    the ``flat`` read; and ``bar_us``, the time that is 85 % of copy bandwidth for the kernel's
    bytes."""
    fastest = {}
    for r in result["rows"]:
        if r["case"] == case and r.get("kv_format", "int4") == kv_format:
            if r["probe"] not in fastest or r["ms"] < fastest[r["probe"]]["ms"]:
                fastest[r["probe"]] = r
    readers = [r for p, r in fastest.items() if p.startswith("bulk") and not p.endswith("_codes")]
    kernel = fastest["kernel"]
    return dict(kernel=kernel, reader=min(readers, key=lambda r: r["ms"]), flat=fastest["flat"],
                bar_us=kernel["bytes"] / (0.85 * result["copy_bw_gbps"] * 1e3))


def mark_best(rows: list[dict]) -> list[dict]:
    """``best``: the fastest label of each (case, format, family)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        if r.get("sweep"):
            continue
        key = (r["case"], r["kv_format"], family(r))
        if key not in best or r["ms"] < best[key]["ms"]:
            best[key] = r
    for r in rows:
        r["best"] = best.get((r["case"], r["kv_format"], family(r))) is r
    return rows


def print_table(rows: list[dict]) -> None:
    from tabulate import tabulate

    print(tabulate([[r["case"], r["label"], f"{r['ms']:.4f}", f"{r['bytes'] / 1e6:.0f}",
                     f"{r['gbps']:.0f}", f"{r['pct_copy_bw']:.1f}",
                     f"{r['pct_copy_bw_clean_l2']:.1f}", f"{r['rel_err']:.1e}",
                     f"{r['rel_err_vs_bf16']:.1e}"] for r in rows],
                   headers=["case", "backend[format]", "ms", "MB read", "GB/s", "% copy bw",
                            "% (clean L2)", "err (own)", "err vs bf16"]))


def plot(result: dict, path: Path) -> None:
    """Two panels: ms per case (log scale) and % of copy bandwidth, one bar per
    (family, format), best label of each."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["results"] if r["best"]]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    series = list(dict.fromkeys(f"{family(r)} {r['kv_format']}" for r in rows))
    width = 0.8 / len(series)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.2))
    for i, s in enumerate(series):
        who, fmt = s.split(" ")
        for ax, key in zip(axes, ("ms", "pct_copy_bw"), strict=True):
            xs, ys = [], []
            for j, case in enumerate(cases):
                match = [r for r in rows if r["case"] == case and r["kv_format"] == fmt
                         and family(r) == who]
                if match:
                    xs.append(j + (i - (len(series) - 1) / 2) * width)
                    ys.append(match[0][key])
            ax.bar(xs, ys, width, label=s,
                   hatch={"FlashInfer": "//", "ours-CUDA": ".."}.get(who))
    axes[0].set_yscale("log")
    axes[0].set_ylabel("ms per decode step (lower is better)")
    axes[1].axhline(100, color="k", lw=0.8, ls="--")
    axes[1].set_ylabel("% of copy bandwidth (quantised bytes counted)")
    for ax in axes:
        ax.set_xticks(range(len(cases)), cases, fontsize=7)
    axes[1].legend(fontsize=7, ncol=2)
    fig.suptitle(f"Quantised KV decode, 32 q / 8 kv heads, d=128, block 16 — {result['gpu']}, "
                 f"copy {result['copy_bw_gbps']:.0f} GB/s, {result['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("quant", __doc__, out="quant.json", cases=CASES)
    p.add_argument("--formats", type=name_list(FORMATS, "format"), default=",".join(FORMATS),
                   help="from: " + ", ".join(FORMATS))
    p.add_argument("--flashinfer-formats", type=name_list(("bf16", "fp8"), "format"),
                   default="fp8", help="formats to time FlashInfer on (bf16 and/or fp8; '' for "
                                       "none)")
    p.add_argument("--flashinfer-cases", type=name_list(CASES, "case"), default=",".join(CASES),
                   help="cases to time FlashInfer on, after all of ours ('' for none)")
    p.add_argument("--sweep-configs", default="", choices=CASES, metavar="CASE",
                   help="case to time the one-pass kernel on over a few tile/warps/stages, last")
    args = p.parse_args(argv)
    formats = args.formats
    if not torch.cuda.is_available():
        print("No CUDA GPU here: no timings (see results/h200/quant.json). Bytes per "
              "token-head (head_dim 128), codes + scales:")
        for f in formats:
            per = 256 if f == "bf16" else KVFormat.parse(f).bytes_per_token_head(128)
            print(f"  {f:15s} {per:6.1f} B  ({256 / per:.2f}x fewer than bf16)")
        return 2
    from tqdm import tqdm

    env = environment()
    copy_bw = copy_bandwidth_gbps()
    print(f"{env['gpu']}: copy bandwidth {copy_bw:.0f} GB/s (torch {env['torch']}, "
          f"triton {env['triton']}, flashinfer {env['flashinfer']})")
    rows = []
    # Ours first, then FlashInfer (its first use of a kernel family JIT-compiles for a minute);
    # the JSON is rewritten after every case, so a run cut short keeps what it measured.
    from paged_ref.kernels.triton.decode import KernelConfig

    configs = [KernelConfig(64, 2, 3), KernelConfig(64, 4, 3), KernelConfig(128, 4, 3),
               KernelConfig(64, 8, 3), KernelConfig(32, 2, 3),
               KernelConfig(64, 2, 1, prefetch=True)]
    work = [(c, "ours", formats) for c in args.cases] + [
        (c, "flashinfer", args.flashinfer_formats) for c in args.flashinfer_cases]
    if args.sweep_configs:
        work.append((args.sweep_configs, "sweep", formats))
    for name, who, fmts in tqdm(work, desc="cases", file=sys.stderr):
        rows += run_case(name, CASES[name], fmts, who, copy_bw, configs)
        result = {**env, "copy_bw_gbps": copy_bw, "shape": {**SHAPE, "dtype": "bfloat16"},
                  "large_cases": list(LARGE_CASES), "results": mark_best(rows)}
        write_result(result, args.out)
    print_table(rows)
    plot(result, args.out.with_suffix(".png"))
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
