"""``python -m paged_ref.bench``: decode attention against memory bandwidth, on the GPU it runs on.

1. Measures the device-to-device copy bandwidth (bytes read + bytes written over time): the
   practical ceiling for a kernel that must read every cached K/V byte once.
2. Runs each backend (and the peers that are installed: PyTorch SDPA on a contiguous cache,
   FlashInfer's paged decode) on the standard cases of DESIGN.md, checks every output against a
   float64 reference, times it with ``triton.testing.do_bench`` (median, L2 flushed before each
   run; two passes after a GPU warm-up, the better median kept), and prints ms, GB/s, % of
   copy bandwidth and relative error.
3. Writes JSON stamped with GPU, versions and date, and a bar plot of % of copy bandwidth.

What is timed (``ms``): ``triton`` and ``triton_split`` are the kernel wrappers called directly
with a split plan, scratch and output made beforehand (FlashInfer's ``plan()`` is outside its
timing too). The public call is timed three ways: ``auto`` (no plan: shape checks, one
read-back of lengths and tables, the value checks, dispatch and scratch on every call),
``auto_planned`` (``paged_attention(..., plan=plan_decode(...), out=out)``: shape checks and the
launch) and ``auto_graph`` (that planned call captured once in a CUDA graph and replayed).
Two more columns help read small cases: ``ms_graph``, the same call replayed from a CUDA
graph by ``do_bench_cudagraph`` (no Python launch cost, L2 not flushed), and ``cpu_us``, the
host time of one call (when it exceeds the GPU time, launches bound it). The JSON also holds
the dense bf16 matmul rate (``matmul_bf16_tflops``, the roofline's compute ceiling), the host
microseconds of each step around the kernel (``host_us``), and with ``--page-sweep CASE`` a
``page_size.json`` of that case at block sizes 1..256.

On a machine without a CUDA GPU it refuses: interpreter or CPU timings say nothing about memory
bandwidth. It still lists the cases and the bytes each must move.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import math
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from paged_ref.course.testing import PagedInputs, make_paged_inputs, ragged_lengths
from paged_ref.reference import paged_attention_torch

#: name -> sequence lengths. All: 32 query heads, 8 KV heads, head_dim 128, bf16, block 16.
CASES: dict[str, list[int]] = {
    "B64_L4096": [4096] * 64,
    "B8_L32768": [32768] * 8,
    "B1_L131072": [131072],
    "B256_L1024": [1024] * 256,
    "B32_ragged": ragged_lengths(32, 64, 16384, seed=0),
    "B4_L2048": [2048] * 4,
}
SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
OURS = ("torch", "triton", "triton_split", "auto", "auto_planned", "auto_graph")
PEERS = ("sdpa_contiguous", "flashinfer")


def bytes_moved(inp: PagedInputs) -> int:
    """K and V of every cached token, plus q, the output, the block tables and the lengths."""
    q_and_out = 2 * inp.q.numel() * inp.q.element_size()
    tables = inp.block_tables.numel() * 4 + inp.seq_lens.numel() * 4
    return inp.kv_bytes + q_and_out + tables


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` (triton's do_bench: warm-up, L2 flush, CUDA events)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def graph_ms(fn: Callable[[], object]) -> float | None:
    """Median milliseconds per call replaying a CUDA graph of ``fn`` (no launch overhead; the
    L2 is not flushed). ``None`` when ``fn`` cannot be captured (it reads values back)."""
    import triton.testing

    try:
        return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))
    except Exception:
        torch.cuda.synchronize()
        return None


def cpu_us_per_call(fn: Callable[[], object], calls: int = 200) -> float:
    """Host microseconds per call of ``fn`` (the Python launch path), GPU work not awaited."""
    import time

    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def warm_up_gpu(seconds: float = 0.3) -> None:
    """Keep the GPU busy for a moment (large copies) so its clocks are up before timing."""
    import time

    src = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            dst.copy_(src)
        torch.cuda.synchronize()


def copy_bandwidth_gbps(num_bytes: int = 2 << 30) -> float:
    """Device-to-device copy of ``num_bytes``: (read + written) bytes / median time, in GB/s."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    warm_up_gpu()
    ms = time_ms(lambda: dst.copy_(src))
    return 2 * num_bytes / (ms * 1e-3) / 1e9


# --------------------------------------------------------------------------- backends


def capture_graph(fn: Callable[[], object]):
    """A CUDA graph of one call of ``fn`` (warmed up on a side stream first); returns
    ``graph.replay``. Raises if ``fn`` cannot be captured (it reads a value back)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def our_runners(inp: PagedInputs, backends, configs, chunk_counts) -> dict:
    """label -> (backend, extra info, zero-argument callable returning the output).

    Kernel rows (``triton``, ``triton_split``) call the kernel wrappers directly with a plan
    and scratch made beforehand. The public call: ``auto`` (no plan: checks, one read-back,
    dispatch and scratch on every call), ``auto_planned`` (``plan=`` from ``plan_decode``,
    ``out=`` given) and ``auto_graph`` (that planned call captured once, replayed).
    """
    from paged_ref.attention import paged_attention
    from paged_ref.kernels.triton_decode import KernelConfig, paged_attention_triton
    from paged_ref.kernels.triton_split import (
        SplitPlan,
        SplitScratch,
        paged_attention_split,
        plan_for_inputs,
    )
    from paged_ref.plan import plan_decode
    from paged_ref.validation import Lengths

    args = inp.args()
    lens = inp.seq_lens.tolist()
    max_len = max(lens)
    out = torch.empty_like(inp.q)
    batch, num_q_heads, head_dim = inp.q.shape
    num_kv_heads = inp.k_cache.shape[2]
    plan = plan_for_inputs(inp.q, inp.k_cache, Lengths(max_len, sum(lens)))
    scratch = SplitScratch.allocate(batch, num_q_heads, num_kv_heads, head_dim, plan, "cuda")
    runners = {}
    if "torch" in backends:
        runners["torch"] = ("torch", {}, lambda: paged_attention_torch(*args, max_len=max_len))
    for cfg in configs or [KernelConfig()]:
        info = {"config": vars(cfg).copy()} if configs else {}
        suffix = f"[t{cfg.tile},w{cfg.num_warps},s{cfg.num_stages}]" if configs else ""
        if "triton" in backends:
            runners["triton" + suffix] = ("triton", info, lambda c=cfg: paged_attention_triton(
                *args, config=c, out=out))
        if "triton_split" in backends:
            runners["triton_split" + suffix] = (
                "triton_split", {**info, "num_chunks": plan.num_chunks,
                                 "chunk_size": plan.chunk_size, "fused_merge": plan.fused_merge},
                lambda c=cfg: paged_attention_split(*args, plan=plan, config=c, out=out,
                                                    scratch=scratch))
    for n in chunk_counts:
        chunk = math.ceil(max_len / n / 64) * 64
        sweep_plan = SplitPlan(chunk_size=chunk, num_chunks=math.ceil(max_len / chunk))
        runners[f"triton_split[chunks={sweep_plan.num_chunks}]"] = (
            "triton_split", {"num_chunks": sweep_plan.num_chunks, "chunk_size": chunk,
                             "sweep": "chunks"},
            lambda p=sweep_plan: paged_attention_split(*args, plan=p, out=out))
    decode_plan = plan_decode(lens, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads,
                              head_dim=head_dim, block_size=inp.k_cache.shape[1],
                              dtype=inp.q.dtype, device=inp.q.device)
    picked = {"picked": decode_plan.backend}
    if decode_plan.split is not None:
        picked |= {"num_chunks": decode_plan.split.num_chunks,
                   "fused_merge": decode_plan.split.fused_merge}
    if "auto" in backends:
        runners["auto"] = ("auto", {**picked, "includes_checks": True},
                           lambda: paged_attention(*args))
    planned_out = torch.empty_like(inp.q)

    def planned():
        return paged_attention(*args, plan=decode_plan, out=planned_out)

    if "auto_planned" in backends:
        runners["auto_planned"] = ("auto_planned", picked, planned)
    if "auto_graph" in backends:
        try:
            replay = capture_graph(planned)
        except Exception as exc:  # reported, not fatal: the other rows still run
            print(f"auto_graph: capture failed ({type(exc).__name__}: {str(exc)[:200]})")
            torch.cuda.synchronize()
            return runners

        def graph_call():
            replay()
            return planned_out

        runners["auto_graph"] = ("auto_graph", {**picked, "graph": True}, graph_call)
    return runners


def sdpa_runner(inp: PagedInputs):
    """PyTorch SDPA on a contiguous [B, Hkv, max_len, D] cache (padded, masked when ragged)."""
    from paged_ref.reference import gather_kv

    max_len = int(inp.seq_lens.max())
    k, v, valid = gather_kv(inp.k_cache, inp.v_cache, inp.block_tables, inp.seq_lens, max_len)
    k = k.transpose(1, 2).contiguous()  # [B, Hkv, L, D]: what an engine without paging keeps
    v = v.transpose(1, 2).contiguous()
    q = inp.q[:, :, None, :]  # [B, Hq, 1, D]
    mask = None if bool(valid.all()) else valid[:, None, None, :]
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def run():
        return sdpa(q, k, v, attn_mask=mask, enable_gqa=True)[:, :, 0, :]

    return {"sdpa_contiguous": ("sdpa_contiguous", {"padded": mask is not None}, run)}


def flashinfer_runners(inp: PagedInputs) -> dict:
    """FlashInfer's BatchDecodeWithPagedKVCacheWrapper (NHD layout), tensor cores on and off."""
    try:
        import flashinfer
    except ImportError:
        return {}
    batch, num_q_heads, head_dim = inp.q.shape
    _, block_size, num_kv_heads, _ = inp.k_cache.shape
    lens = inp.seq_lens.long()
    pages = (lens + block_size - 1) // block_size
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = torch.cumsum(pages, 0)
    cols = torch.arange(inp.block_tables.shape[1], device="cuda")
    indices = inp.block_tables[cols[None, :] < pages[:, None]].to(torch.int32).contiguous()
    last = (lens - (pages - 1) * block_size).to(torch.int32)
    runners = {}
    for tc in (False, True):
        workspace = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_tensor_cores=tc)
        wrapper.plan(indptr, indices, last, num_q_heads, num_kv_heads, head_dim, block_size,
                     q_data_type=inp.q.dtype, kv_data_type=inp.k_cache.dtype)
        runners[f"flashinfer[tc={tc}]"] = (
            "flashinfer", {"use_tensor_cores": tc, "version": flashinfer.__version__},
            lambda w=wrapper: w.run(inp.q, (inp.k_cache, inp.v_cache)))
    return runners


# --------------------------------------------------------------------------- driver


def environment() -> dict:
    import triton

    fi = None
    try:
        import flashinfer

        fi = flashinfer.__version__
    except ImportError:
        pass
    return {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "flashinfer": fi,
        "python": platform.python_version(),
        "date": dt.date.today().isoformat(),
    }


def run_case(name, lens, backends, configs, chunk_counts, copy_bw, seed=0):
    from paged_ref.course.checks import relative_error

    inp = make_paged_inputs(lens, device="cuda", seed=seed, **SHAPE)
    ref = paged_attention_torch(
        inp.q.double(), inp.k_cache.double(), inp.v_cache.double(), inp.block_tables,
        inp.seq_lens, max_len=max(lens))
    runners = our_runners(inp, [b for b in backends if b in OURS], configs, chunk_counts)
    if "sdpa_contiguous" in backends:
        runners.update(sdpa_runner(inp))
    if "flashinfer" in backends:
        runners.update(flashinfer_runners(inp))
    nbytes = bytes_moved(inp)
    checked = {}  # label -> relative error; compile and check everything before any timing
    for label, (_, _, fn) in runners.items():
        try:
            out = fn()
            torch.cuda.synchronize()
        except Exception as exc:  # e.g. a swept config that needs more shared memory than exists
            print(f"{name} {label}: skipped ({type(exc).__name__}: {str(exc)[:120]})")
            continue
        checked[label] = relative_error(out, ref)
    # Two timing passes after a warm-up: an idle GPU starts at low clocks, and small cases
    # never load it enough to ramp them up. Each row keeps the better median of the two.
    warm_up_gpu()
    passes = [{label: time_ms(runners[label][2]) for label in checked} for _ in range(2)]
    rows = []
    for label, err in checked.items():
        backend, info, fn = runners[label]
        ms = min(p[label] for p in passes)
        gbps = nbytes / (ms * 1e-3) / 1e9
        extra = {"ms_passes": [p[label] for p in passes]}
        if not info.get("sweep") and not info.get("graph"):
            extra |= {"ms_graph": graph_ms(fn), "cpu_us": cpu_us_per_call(fn)}
        rows.append({"case": name, "backend": backend, "label": label, "ms": ms, "gbps": gbps,
                     "pct_copy_bw": 100 * gbps / copy_bw, "rel_err": err, "bytes": nbytes,
                     **extra, **info})
    del inp, ref, runners
    torch.cuda.empty_cache()
    return rows


def matmul_tflops(n: int = 8192) -> float:
    """Dense bf16 matmul rate, TFLOP/s (``2 n^3`` FLOPs over the median time): the compute
    ceiling of the roofline."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    warm_up_gpu()
    ms = time_ms(lambda: a @ b)
    return 2 * n**3 / (ms * 1e-3) / 1e12


def host_breakdown(name: str, lens: list[int]) -> dict:
    """Host microseconds of each step around the kernel in one public call on this case
    (:func:`paged_ref.course.cost.call_steps_us`), and of FlashInfer's ``run``."""
    from paged_ref.course.cost import call_steps_us, host_us

    inp = make_paged_inputs(lens, device="cuda", seed=0, **SHAPE)
    result = {"case": name, **call_steps_us(inp, calls=200)}
    fi = flashinfer_runners(inp)
    if fi:
        result["flashinfer_run"] = host_us(fi["flashinfer[tc=False]"][2], calls=200)
    return result


def page_size_sweep(name: str, block_sizes: list[int], copy_bw: float) -> list[dict]:
    """``auto_planned`` and FlashInfer on case ``name`` at each block size (page size)."""
    from paged_ref.attention import paged_attention
    from paged_ref.course.checks import relative_error
    from paged_ref.plan import plan_decode

    rows = []
    lens = CASES[name]
    for block_size in block_sizes:
        shape = {**SHAPE, "block_size": block_size}
        inp = make_paged_inputs(lens, device="cuda", seed=0, **shape)
        ref = paged_attention_torch(
            inp.q.double(), inp.k_cache.double(), inp.v_cache.double(), inp.block_tables,
            inp.seq_lens, max_len=max(lens))
        plan = plan_decode(lens, num_q_heads=SHAPE["num_q_heads"],
                           num_kv_heads=SHAPE["num_kv_heads"], head_dim=SHAPE["head_dim"],
                           block_size=block_size, dtype=inp.q.dtype, device="cuda")
        out = torch.empty_like(inp.q)
        runners = {"auto_planned": lambda p=plan, i=inp, o=out: paged_attention(
            *i.args(), plan=p, out=o)}
        fi = flashinfer_runners(inp)
        if fi:
            runners["flashinfer"] = fi["flashinfer[tc=False]"][2]
        nbytes = bytes_moved(inp)
        for backend, fn in runners.items():
            err = relative_error(fn(), ref)
            ms = min(time_ms(fn) for _ in range(2))
            gbps = nbytes / (ms * 1e-3) / 1e9
            rows.append({"case": name, "block_size": block_size, "backend": backend, "ms": ms,
                         "gbps": gbps, "pct_copy_bw": 100 * gbps / copy_bw, "rel_err": err})
            print(f"page size {block_size:4d} {backend:14s} {ms:.4f} ms "
                  f"{100 * gbps / copy_bw:5.1f} % copy bw, rel err {err:.1e}")
        del inp, ref, runners, fi
        torch.cuda.empty_cache()
    return rows


def best_per_backend(rows: list[dict]) -> list[dict]:
    """Rows marked ``best``: the fastest label of each (case, backend) (e.g. FlashInfer with
    tensor cores on or off, or the best kernel config of a sweep)."""
    best: dict[tuple, dict] = {}
    for row in rows:
        key = (row["case"], row["backend"])
        if row.get("sweep"):
            continue
        if key not in best or row["ms"] < best[key]["ms"]:
            best[key] = row
    for row in rows:
        row["best"] = best.get((row["case"], row["backend"])) is row
    return rows


def print_table(rows: list[dict]) -> None:
    from tabulate import tabulate

    def opt(value, fmt):
        return "-" if value is None else format(value, fmt)

    table = [[r["case"], r["label"], f"{r['ms']:.4f}", f"{r['gbps']:.0f}",
              f"{r['pct_copy_bw']:.1f}", f"{r['rel_err']:.1e}", opt(r.get("ms_graph"), ".4f"),
              opt(r.get("cpu_us"), ".0f")] for r in rows]
    print(tabulate(table, headers=["case", "backend", "ms", "GB/s", "% copy bw", "rel err",
                                   "ms (graph)", "host us/call"]))


def plot(result: dict, path: Path) -> None:
    """Grouped bars: % of copy bandwidth per case, one bar per backend (best label of each)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in result["results"] if r.get("best")]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    width = 0.8 / max(len(backends), 1)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    for i, backend in enumerate(backends):
        xs, ys = [], []
        for j, case in enumerate(cases):
            match = [r for r in rows if r["case"] == case and r["backend"] == backend]
            if match:
                xs.append(j + (i - (len(backends) - 1) / 2) * width)
                ys.append(match[0]["pct_copy_bw"])
        ax.bar(xs, ys, width, label=backend)
    ax.axhline(100, color="k", lw=0.8, ls="--")
    ax.set_xticks(range(len(cases)), cases)
    ax.set_ylabel("% of measured copy bandwidth")
    ax.set_title(f"Paged decode, bf16, 32 q / 8 kv heads, d=128, block 16 — {result['gpu']}, "
                 f"copy {result['copy_bw_gbps']:.0f} GB/s, {result['date']}", fontsize=9)
    ax.legend(fontsize=8, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m paged_ref.bench",
                                description=__doc__.split("\n")[0])
    p.add_argument("--cases", default=",".join(CASES),
                   help="comma-separated, from: " + ", ".join(CASES))
    p.add_argument("--backends", default=",".join(OURS + PEERS),
                   help="comma-separated, from: " + ", ".join(OURS + PEERS))
    p.add_argument("--sweep-configs", action="store_true",
                   help="time the Triton kernels over a grid of tile / warps / stages")
    p.add_argument("--sweep-chunks", default="",
                   help="comma-separated chunk counts to time triton_split with (lesson 05)")
    p.add_argument("--page-sweep", default="",
                   help="also time auto_planned and FlashInfer on this case at each of "
                        "--page-sizes block sizes; writes page_size.json beside --out")
    p.add_argument("--page-sizes", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--out", default="bench.json", help="JSON path (the plot goes beside it)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    backends = [b for b in args.backends.split(",") if b]
    unknown = [c for c in cases if c not in CASES] + [b for b in backends if b not in OURS + PEERS]
    if args.page_sweep and args.page_sweep not in CASES:
        unknown.append(args.page_sweep)
    if unknown:
        print(f"unknown case or backend: {unknown}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("No CUDA GPU here, so no bandwidth numbers: timings on a CPU or in Triton's "
              "interpreter say nothing about how a kernel uses GPU memory bandwidth.\n"
              "Committed GPU results are in benchmarks/. The cases and the bytes each moves:")
        per_token = 2 * SHAPE["num_kv_heads"] * SHAPE["head_dim"] * 2
        for name in cases:
            lens = CASES[name]
            print(f"  {name:12s} {len(lens):4d} sequences, {sum(lens):8d} tokens, "
                  f"K+V {sum(lens) * per_token / 1e6:9.1f} MB")
        return 2
    from tqdm import tqdm

    from paged_ref.kernels.triton_decode import KernelConfig

    configs = []
    if args.sweep_configs:
        configs = [KernelConfig(t, w, s) for t, w, s in
                   itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))]
    chunk_counts = [int(n) for n in args.sweep_chunks.split(",") if n]
    env = environment()
    copy_bw = copy_bandwidth_gbps()
    print(f"{env['gpu']}: copy bandwidth {copy_bw:.0f} GB/s "
          f"(torch {env['torch']}, triton {env['triton']}, flashinfer {env['flashinfer']})")
    rows = []
    for name in tqdm(cases, desc="cases", file=sys.stderr):
        rows += run_case(name, CASES[name], backends, configs, chunk_counts, copy_bw)
    rows = best_per_backend(rows)
    result = {**env, "copy_bw_gbps": copy_bw, "shape": {**SHAPE, "dtype": "bfloat16"},
              "results": rows}
    print_table(rows)
    result["matmul_bf16_tflops"] = matmul_tflops()
    print(f"dense bf16 matmul: {result['matmul_bf16_tflops']:.0f} TFLOP/s")
    result["host_us"] = [host_breakdown(c, CASES[c]) for c in ("B4_L2048", "B64_L4096")
                         if c in cases]
    for r in result["host_us"]:
        print("host us per step:", {k: round(v, 1) if isinstance(v, float) else v
                                    for k, v in r.items()})
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    if args.page_sweep:
        sizes = [int(b) for b in args.page_sizes.split(",") if b]
        sweep = {**env, "copy_bw_gbps": copy_bw, "shape": {**SHAPE, "dtype": "bfloat16"},
                 "results": page_size_sweep(args.page_sweep, sizes, copy_bw)}
        page_json = out.with_name("page_size.json")
        page_json.write_text(json.dumps(sweep, indent=1))
        print(f"wrote {page_json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
