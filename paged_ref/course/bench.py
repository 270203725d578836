"""``python -m paged_ref.bench``: decode attention against memory bandwidth, on the GPU it runs on.

1. Measures the device-to-device copy bandwidth (bytes read + bytes written over time): the
   practical ceiling for a kernel that must read every cached K/V byte once.
2. Runs each backend (and the peers that are installed: PyTorch SDPA on a contiguous cache,
   FlashInfer's paged decode) on the standard cases of DESIGN.md, checks every output against a
   float64 reference, times it with ``triton.testing.do_bench`` (median, L2 flushed before each
   run; two passes after a GPU warm-up, the better median kept), and prints ms, GB/s, % of
   copy bandwidth and relative error.
3. Writes JSON stamped with GPU, versions and date, and a bar plot of % of copy bandwidth.

What is timed (``ms``): the kernel launches of each backend on inputs checked once beforehand,
like a serving engine that validates a batch once and plans the split once per step (FlashInfer's
``plan()`` is outside its timing too). ``auto`` is timed through the public
``paged_attention(backend="auto")``, checks included. Two more columns help read small cases:
``ms_graph``, the same call replayed from a CUDA graph (no Python launch cost, L2 not flushed),
and ``cpu_us``, the host time of one call (when it exceeds the GPU time, launches bound it).

On a machine without a CUDA GPU it refuses: interpreter or CPU timings say nothing about memory
bandwidth. It still lists the cases and the bytes each must move.
"""

from __future__ import annotations

import argparse
import datetime as dt
import itertools
import json
import platform
import sys
from pathlib import Path

import torch

from paged_ref.cache_math import cdiv, kv_bytes_per_token, split_chunks, tokens_in_block
from paged_ref.course.testing import PagedInputs, make_paged_inputs, ragged_lengths
from paged_ref.course.timing import (
    copy_bandwidth_gbps,
    cpu_us_per_call,
    gbps,
    graph_ms,
    time_ms,
    warm_up_gpu,
)
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
OURS = ("torch", "triton", "triton_split", "auto")
PEERS = ("sdpa_contiguous", "flashinfer")


def bytes_moved(inp: PagedInputs) -> int:
    """K and V of every cached token, plus q, the output, the block tables and the lengths."""
    q_and_out = 2 * inp.q.numel() * inp.q.element_size()
    tables = inp.block_tables.numel() * 4 + inp.seq_lens.numel() * 4
    return inp.kv_bytes + q_and_out + tables


# --------------------------------------------------------------------------- backends


def our_runners(inp: PagedInputs, backends, configs, chunk_counts) -> dict:
    """label -> (backend, extra info, zero-argument callable returning the output)."""
    from paged_ref.attention import choose_backend, paged_attention
    from paged_ref.kernels.triton_decode import KernelConfig, paged_attention_triton
    from paged_ref.kernels.triton_split import SplitPlan, paged_attention_split, plan_for_inputs
    from paged_ref.validation import Lengths

    args = inp.args()
    max_len = int(inp.seq_lens.max())
    out = torch.empty_like(inp.q)
    lengths = Lengths(max_len, int(inp.seq_lens.sum()))
    plan = plan_for_inputs(inp.q, inp.k_cache, lengths)
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
                                 "chunk_size": plan.chunk_size},
                lambda c=cfg: paged_attention_split(*args, plan=plan, config=c, out=out))
    for n, cfg in itertools.product(chunk_counts, configs or [KernelConfig()]):
        sweep_plan = SplitPlan(*split_chunks(max_len, n, cfg.tile))
        suffix = f",t{cfg.tile},w{cfg.num_warps},s{cfg.num_stages}" if configs else ""
        runners[f"triton_split[chunks={sweep_plan.num_chunks}{suffix}]"] = (
            "triton_split", {"num_chunks": sweep_plan.num_chunks,
                             "chunk_size": sweep_plan.chunk_size, "sweep": "chunks",
                             **({"config": vars(cfg).copy()} if configs else {})},
            lambda p=sweep_plan, c=cfg: paged_attention_split(*args, plan=p, config=c, out=out))
    if "auto" in backends:
        picked = choose_backend(inp.q, inp.k_cache, lengths)
        runners["auto"] = ("auto", {"picked": picked, "includes_checks": True},
                           lambda: paged_attention(*args, backend="auto"))
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
    lens = inp.seq_lens.tolist()
    pages = cdiv(inp.seq_lens.long(), block_size)
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = torch.cumsum(pages, 0)
    cols = torch.arange(inp.block_tables.shape[1], device="cuda")
    indices = inp.block_tables[cols[None, :] < pages[:, None]].to(torch.int32).contiguous()
    last = torch.tensor([tokens_in_block(n, cdiv(n, block_size) - 1, block_size) for n in lens],
                        dtype=torch.int32, device="cuda")  # tokens in each last page
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
        rate = gbps(nbytes, ms)
        extra = {"ms_passes": [p[label] for p in passes]}
        if not info.get("sweep"):
            extra |= {"ms_graph": graph_ms(fn), "cpu_us": cpu_us_per_call(fn)}
        rows.append({"case": name, "backend": backend, "label": label, "ms": ms, "gbps": rate,
                     "pct_copy_bw": 100 * rate / copy_bw, "rel_err": err, "bytes": nbytes,
                     **extra, **info})
    del inp, ref, runners
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
    from paged_ref.course.results import draw_pct_copy_bw

    backends = list(dict.fromkeys(r["backend"] for r in result["results"] if r.get("best")))
    title = (f"Paged decode, bf16, 32 q / 8 kv heads, d=128, block 16 — {result['gpu']}, "
             f"copy {result['copy_bw_gbps']:.0f} GB/s, {result['date']}")
    draw_pct_copy_bw(result, backends, title=title).savefig(path, dpi=120)


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
    p.add_argument("--out", default="bench.json", help="JSON path (the plot goes beside it)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    backends = [b for b in args.backends.split(",") if b]
    unknown = [c for c in cases if c not in CASES] + [b for b in backends if b not in OURS + PEERS]
    if unknown:
        print(f"unknown case or backend: {unknown}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("No CUDA GPU here, so no bandwidth numbers: timings on a CPU or in Triton's "
              "interpreter say nothing about how a kernel uses GPU memory bandwidth.\n"
              "Committed GPU results are in benchmarks/. The cases and the bytes each moves:")
        per_token = kv_bytes_per_token(num_layers=1, num_kv_heads=SHAPE["num_kv_heads"],
                                       head_dim=SHAPE["head_dim"], dtype=SHAPE["dtype"])
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
    out = Path(args.out)
    out.write_text(json.dumps(result, indent=1))
    plot(result, out.with_suffix(".png"))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
