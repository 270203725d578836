"""``python -m paged_bench``: decode attention against memory bandwidth, on the GPU it runs on.

1. Measures the device-to-device copy bandwidth (bytes read + bytes written over time): the
   practical ceiling for a kernel that must read every cached K/V byte once.
2. Runs each backend (and the peers that are installed: PyTorch SDPA on a contiguous cache,
   FlashInfer's paged decode) on the standard cases of docs/contract.md, checks every output
   against a float64 reference, times it with ``triton.testing.do_bench`` (median, L2 flushed
   before each run; two passes after a GPU warm-up, the better median kept), and prints ms,
   GB/s, % of copy bandwidth and relative error.
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

import itertools
import sys
from functools import partial
from pathlib import Path

import torch

from paged_bench.common import check_then_time, flashinfer_page_table, suite_parser
from paged_course.results import environment, write_result
from paged_course.testing import PagedInputs, make_paged_inputs, ragged_lengths
from paged_course.timing import (
    capture_graph,
    copy_bandwidth_gbps,
    cpu_us_per_call,
    gbps,
    graph_ms,
    matmul_tflops,
)
from paged_ref.cache_math import kv_bytes_per_token, split_chunks
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


# --------------------------------------------------------------------------- backends



def our_runners(inp: PagedInputs, backends, configs, chunk_counts) -> dict:
    """label -> (backend, extra info, zero-argument callable returning the output).

    Kernel rows (``triton``, ``triton_split``) call the kernel wrappers directly with a plan
    and scratch made beforehand. The public call: ``auto`` (no plan: checks, one read-back,
    dispatch and scratch on every call), ``auto_planned`` (``plan=`` from ``plan_decode``,
    ``out=`` given) and ``auto_graph`` (that planned call captured once, replayed).
    """
    from paged_ref.attention import paged_attention
    from paged_ref.kernels.triton.decode import KernelConfig, paged_attention_triton
    from paged_ref.kernels.triton.split import (
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
        suffix = f"[{cfg.label}]" if configs else ""
        if "triton" in backends:
            runners["triton" + suffix] = ("triton", info, lambda c=cfg: paged_attention_triton(
                *args, config=c, out=out))
        if "triton_split" in backends:
            runners["triton_split" + suffix] = (
                "triton_split", {**info, "num_chunks": plan.num_chunks,
                                 "chunk_size": plan.chunk_size, "fused_merge": plan.fused_merge},
                lambda c=cfg: paged_attention_split(*args, plan=plan, config=c, out=out,
                                                    scratch=scratch))
    for n, cfg in itertools.product(chunk_counts, configs or [KernelConfig()]):
        sweep_plan = SplitPlan(*split_chunks(max_len, n, cfg.tile))
        suffix = f",{cfg.label}" if configs else ""
        runners[f"triton_split[chunks={sweep_plan.num_chunks}{suffix}]"] = (
            "triton_split", {"num_chunks": sweep_plan.num_chunks,
                             "chunk_size": sweep_plan.chunk_size, "sweep": "chunks",
                             **({"config": vars(cfg).copy()} if configs else {})},
            lambda p=sweep_plan, c=cfg: paged_attention_split(*args, plan=p, config=c, out=out))
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
    _, num_q_heads, head_dim = inp.q.shape
    _, block_size, num_kv_heads, _ = inp.k_cache.shape
    indptr, indices, last = flashinfer_page_table(inp.block_tables, inp.seq_lens, block_size)
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


def run_case(name, lens, backends, configs, chunk_counts, copy_bw, seed=0):
    from paged_course.checks import relative_error

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
    rows = []
    for m in check_then_time(name, runners, partial(relative_error, expected=ref), passes=2):
        rate = gbps(nbytes, m.ms)
        extra = {"ms_passes": m.ms_passes}
        if not m.info.get("sweep") and not m.info.get("graph"):
            extra |= {"ms_graph": graph_ms(m.fn), "cpu_us": cpu_us_per_call(m.fn)}
        rows.append(m.row(name, gbps=rate, pct_copy_bw=100 * rate / copy_bw, bytes=nbytes,
                          **extra))
    del inp, ref, runners
    torch.cuda.empty_cache()
    return rows


def host_breakdown(name: str, lens: list[int]) -> dict:
    """Host microseconds of each step around the kernel in one public call on this case
    (:func:`paged_course.cost.call_steps_us`), and of FlashInfer's ``run``."""
    from paged_course.cost import call_steps_us, host_us

    inp = make_paged_inputs(lens, device="cuda", seed=0, **SHAPE)
    result = {"case": name, **call_steps_us(inp, calls=200)}
    fi = flashinfer_runners(inp)
    if fi:
        result["flashinfer_run"] = host_us(fi["flashinfer[tc=False]"][2], calls=200)
    return result


def page_size_sweep(name: str, block_sizes: list[int], copy_bw: float) -> list[dict]:
    """``auto_planned`` and FlashInfer on case ``name`` at each block size (page size)."""
    from paged_course.checks import relative_error
    from paged_ref.attention import paged_attention
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
        runners = {"auto_planned": ("auto_planned", {}, lambda p=plan, i=inp, o=out:
                                    paged_attention(*i.args(), plan=p, out=o))}
        fi = flashinfer_runners(inp)
        if fi:
            runners["flashinfer"] = ("flashinfer", {}, fi["flashinfer[tc=False]"][2])
        nbytes = bytes_moved(inp)
        for m in check_then_time(name, runners, partial(relative_error, expected=ref)):
            rate = gbps(nbytes, m.ms)
            rows.append(m.row(name, block_size=block_size, gbps=rate,
                              pct_copy_bw=100 * rate / copy_bw))
            print(f"page size {block_size:4d} {m.backend:14s} {m.ms:.4f} ms "
                  f"{100 * rate / copy_bw:5.1f} % copy bw, rel err {m.error:.1e}")
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
    from paged_course.results import draw_pct_copy_bw

    backends = list(dict.fromkeys(r["backend"] for r in result["results"] if r.get("best")))
    title = (f"Paged decode, bf16, 32 q / 8 kv heads, d=128, block 16 — {result['gpu']}, "
             f"copy {result['copy_bw_gbps']:.0f} GB/s, {result['date']}")
    draw_pct_copy_bw(result, backends, title=title).savefig(path, dpi=120)


def parse_args(argv):
    p = suite_parser("decode", __doc__, out="decode.json", cases=CASES, backends=OURS + PEERS)
    p.add_argument("--sweep-configs", action="store_true",
                   help="time the Triton kernels over a grid of tile / warps / stages")
    p.add_argument("--sweep-chunks", default="",
                   help="comma-separated chunk counts to time triton_split with (lesson 05)")
    p.add_argument("--page-sweep", default="", choices=CASES, metavar="CASE",
                   help="also time auto_planned and FlashInfer on this case at each of "
                        "--page-sizes block sizes; writes page_size.json beside --out")
    p.add_argument("--page-sizes", default="1,2,4,8,16,32,64,128,256")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases, backends = args.cases, args.backends
    if not torch.cuda.is_available():
        print("No CUDA GPU here, so no bandwidth numbers: timings on a CPU or in Triton's "
              "interpreter say nothing about how a kernel uses GPU memory bandwidth.\n"
              "Committed GPU results are in results/. The cases and the bytes each moves:")
        per_token = kv_bytes_per_token(num_layers=1, num_kv_heads=SHAPE["num_kv_heads"],
                                       head_dim=SHAPE["head_dim"], dtype=SHAPE["dtype"])
        for name in cases:
            lens = CASES[name]
            print(f"  {name:12s} {len(lens):4d} sequences, {sum(lens):8d} tokens, "
                  f"K+V {sum(lens) * per_token / 1e6:9.1f} MB")
        return 2
    from tqdm import tqdm

    from paged_ref.kernels.triton.decode import KernelConfig

    configs = []
    if args.sweep_configs:
        configs = [KernelConfig(t, w, s) for t, w, s in
                   itertools.product((32, 64, 128), (2, 4, 8), (2, 3, 4))]
    chunk_counts = [int(n) for n in args.sweep_chunks.split(",") if n]
    env = environment()
    copy_bw = copy_bandwidth_gbps()
    print(f"{env['gpu']}: copy bandwidth {copy_bw:.0f} GB/s "
          f"(torch {env['torch']}, triton {env['triton']}, flashinfer {env['flashinfer']})")
    result = {**env, "copy_bw_gbps": copy_bw, "shape": {**SHAPE, "dtype": "bfloat16"},
              "results": []}
    for name in tqdm(cases, desc="cases", file=sys.stderr):
        result["results"] += run_case(name, CASES[name], backends, configs, chunk_counts,
                                      copy_bw)
        write_result(result, args.out)  # partial results survive a time-out
    rows = best_per_backend(result["results"])
    print_table(rows)
    result["matmul_bf16_tflops"] = matmul_tflops()
    print(f"dense bf16 matmul: {result['matmul_bf16_tflops']:.0f} TFLOP/s")
    result["host_us"] = [host_breakdown(c, CASES[c]) for c in ("B4_L2048", "B64_L4096")
                         if c in cases]
    for r in result["host_us"]:
        print("host us per step:", {k: round(v, 1) if isinstance(v, float) else v
                                    for k, v in r.items()})
    out = write_result(result, args.out)
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    if args.page_sweep:
        sizes = [int(b) for b in args.page_sizes.split(",") if b]
        sweep = {**env, "copy_bw_gbps": copy_bw, "shape": {**SHAPE, "dtype": "bfloat16"},
                 "results": page_size_sweep(args.page_sweep, sizes, copy_bw)}
        print(f"wrote {write_result(sweep, out.with_name('page_size.json'))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
