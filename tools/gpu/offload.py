"""Copy a cached prefix back from host memory, or recompute it? Measured on one GPU.

For a Llama-3-8B-shaped model (32 layers, 32 query / 8 KV heads, head_dim 128, hidden 4096,
MLP 14336, bf16, blocks of 16 tokens: 128 KiB of K/V per token, 2 MiB per block) and prefix
lengths 512 .. 32768 tokens, this script measures

* ``copy_back_ms``: ``PagedKVCache.swap_in`` of the prefix's blocks from pinned host memory
  (the path the prefix cache's host tier uses: one PCIe copy per block + one scatter);
* ``bulk_h2d_ms``: one contiguous pinned host -> device copy of the same bytes (the ceiling);
* ``recompute_ms``: the prefix's prefill FLOPs (every matmul of the layer stack + causal
  attention) divided by the dense bf16 matmul rate measured here (8192^3, so a *lower bound*
  on real recompute time: no real prefill runs at the matmul peak);

and writes ``$OUT/offload.json`` (GPU, versions, date, the model shape, the measured rates and
one row per prefix length). Run on a GPU machine: ``python tools/gpu/offload.py``.
``--smoke`` runs tiny sizes on any device to check the script (not a measurement).
"""

from __future__ import annotations

import argparse
import os

import torch

import paged_ref
from paged_course.offload import LLAMA_8B, PREFIXES, prefill_flops
from paged_course.results import environment, write_result
from paged_course.timing import matmul_tflops, median_ms
from paged_ref import PagedKVCache


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device")
    parser.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."),
                                                      "offload.json"))
    args = parser.parse_args(argv)
    gpu = torch.cuda.is_available()
    if not gpu and not args.smoke:
        print("offload.py measures PCIe copies and matmul rates: it needs a CUDA GPU "
              "(use --smoke to check the script on a CPU)")
        return 1
    device = "cuda" if gpu else "cpu"
    shape = dict(LLAMA_8B)
    prefixes, mm = PREFIXES, 8192
    if args.smoke:
        shape.update(num_layers=2, num_kv_heads=2, head_dim=16)
        prefixes, mm = [64, 128], 256
    bs = shape["block_size"]
    max_blocks = max(prefixes) // bs
    cache = PagedKVCache(shape["num_layers"], max_blocks, bs, shape["num_kv_heads"],
                         shape["head_dim"], dtype=torch.bfloat16, device=device,
                         num_host_blocks=max_blocks)
    cache.host_kv.normal_()
    tflops = matmul_tflops(mm, device)
    bulk_src = cache.host_kv.view(-1)
    bulk_dst = torch.empty_like(bulk_src, device=device)
    bulk_gbps = bulk_src.nbytes / median_ms(
        lambda: bulk_dst.copy_(bulk_src, non_blocking=True)) / 1e6
    print(f"dense bf16 matmul {tflops:.0f} TFLOP/s; pinned host->device {bulk_gbps:.1f} GB/s")
    rows = []
    block_bytes = cache.host_kv[0].nbytes
    for n in prefixes:
        blocks = n // bs
        pairs = [(i, blocks - 1 - i) for i in range(blocks)]  # host slot -> a device block
        copy_ms = median_ms(lambda pairs=pairs: cache.swap_in(pairs))
        src, dst = bulk_src[: blocks * block_bytes // 2], bulk_dst[: blocks * block_bytes // 2]
        bulk_ms = median_ms(lambda s=src, d=dst: d.copy_(s, non_blocking=True))
        recompute_ms = prefill_flops(n, shape) / (tflops * 1e12) * 1e3
        rows.append(dict(prefix_tokens=n, blocks=blocks, bytes=blocks * block_bytes,
                         copy_back_ms=copy_ms, bulk_h2d_ms=bulk_ms,
                         copy_back_gbps=blocks * block_bytes / copy_ms / 1e6,
                         prefill_tflop=prefill_flops(n, shape) / 1e12,
                         recompute_ms=recompute_ms, recompute_over_copy=recompute_ms / copy_ms))
        print(f"prefix {n:6d}: copy back {copy_ms:8.2f} ms (bulk {bulk_ms:7.2f}), "
              f"recompute >= {recompute_ms:8.2f} ms -> x{recompute_ms / copy_ms:.1f}")
    result = dict(
        environment(), paged_ref=paged_ref.__version__,
        model=shape, kv_bytes_per_block=block_bytes, matmul_tflops=tflops,
        matmul_size=mm, pinned_h2d_gbps=bulk_gbps, results=rows)
    if args.smoke:  # (on a GPU too: tiny sizes measure nothing the lesson may quote)
        result["gpu"] = f"{result['gpu'] if gpu else 'cpu'} (smoke test, not a measurement)"
    print(f"wrote {write_result(result, args.out)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
