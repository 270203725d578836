"""``python -m paged_bench transfer``: moving KV blocks between two GPUs (lesson 11).

On a machine with two CUDA GPUs it measures, in one run:

1. the GPU-to-GPU copy bandwidth (``dst.copy_(src)`` from ``cuda:0`` to ``cuda:1``, 2 GiB,
   bytes over time) and NCCL's send/recv bandwidth for one large contiguous buffer: the
   ceilings for any KV transfer;
2. for an 8B-like shape (32 layers, 8 KV heads, head_dim 128, bf16, block 16) and prompts of
   512 ... 32k tokens whose blocks are scattered in rank 0's pool: the transfer time of
   :func:`paged_ref.transfer.send_sequence` in each mode (``packed``: one gather + one send;
   ``per_layer``: a gather + send per layer; ``per_block``: one send per layer, K/V and block,
   no copy -- only up to 2k tokens, it is slow), timed on the receiver from the header to the
   last block landed; checked: rank 1's blocks equal rank 0's;
3. recomputing the prompt on rank 1 instead: a prefill forward of a random-weight Llama-3-8B-like
   model (transformers, bf16, SDPA) over the same prompt.

It writes JSON (``--out``, default ``transfer.json``) stamped with GPU, versions and date. On a
machine with fewer than two GPUs it says so and exits with status 2.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from paged_bench.common import suite_parser
from paged_course.results import environment, write_result

#: The 8B-like model's KV shape.
SHAPE = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16)
PROMPTS = (512, 2048, 8192, 32768)
PER_BLOCK_MAX = 2048  # per-block mode sends layers*2*blocks messages: only short prompts


def p2p_copy_gbps(num_bytes: int = 2 << 30, reps: int = 10) -> float:
    """GB/s of ``cuda:1 <- cuda:0`` copies (median of ``reps``), bytes copied over time."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:0").random_()
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cuda:1")
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize(0)
        torch.cuda.synchronize(1)
        t0 = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize(1)
        torch.cuda.synchronize(0)
        times.append(time.perf_counter() - t0)
    assert torch.equal(dst[:4096].cpu(), src[:4096].cpu())
    return num_bytes / statistics.median(times[2:]) / 1e9


def make_pool(prompt: int, device, seed: int, shape: dict = SHAPE):
    """A pool of ``shape`` (default: the 8B-like SHAPE) with room for the prompt twice over,
    random K/V; sequence ``"req"`` holds the prompt, its blocks scattered over the pool."""
    from paged_ref import KVCacheManager, PagedKVCache
    from paged_ref.cache_math import blocks_needed

    bs = shape["block_size"]
    num_blocks = 2 * blocks_needed(prompt, bs) + 8
    cache = PagedKVCache(shape["num_layers"], num_blocks, bs, shape["num_kv_heads"],
                         shape["head_dim"], dtype=shape["dtype"], device=device)
    manager = KVCacheManager(num_blocks, bs)
    gen = torch.Generator(device=device).manual_seed(seed)
    for t in cache.k_caches + cache.v_caches:
        t.normal_(generator=gen)
    # Interleave two requests so that each one's blocks are scattered over the pool.
    manager.add_sequence("filler", 0)
    manager.add_sequence("req", 0)
    for _ in range(prompt):
        manager.append_slot("filler")
        manager.append_slot("req")
    return cache, manager


def sync_device(device: torch.device) -> None:
    """Wait for the GPU's queued work (nothing on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rank_main(rank: int, world_size: int, *, prompts, reps: int,
               big_bytes: int = 4 << 30, chunk_mib=()) -> dict:
    """Rank 0 sends each prompt's blocks in each mode; rank 1 receives and checks them.
    ``chunk_mib``: packed mode again at each of these message sizes (MiB), for prompts of
    8k tokens and more (rows ``transfer_packed[chunk=N MiB]``).
    (Runs on CPUs with gloo too, for a smoke test: ``rank_device`` picks the device.)"""
    from paged_course.two_ranks import rank_device
    from paged_ref import transfer

    device = rank_device(rank)
    rows = []
    # The transport's ceiling: one large contiguous buffer.
    big = torch.empty(big_bytes, dtype=torch.uint8, device=device)
    nccl = []
    for _ in range(reps + 1):
        dist.barrier()
        sync_device(device)
        t0 = time.perf_counter()
        (dist.send if rank == 0 else dist.recv)(big, 1 - rank)
        sync_device(device)
        nccl.append(time.perf_counter() - t0)
    del big
    nccl_gbps = big_bytes / statistics.median(nccl[1:]) / 1e9
    for prompt in prompts:
        sweep = [("packed", mib << 20) for mib in chunk_mib if prompt >= 8192]
        for mode, chunk_bytes in [(m, None) for m in transfer.MODES] + sweep:
            if mode == "per_block" and prompt > PER_BLOCK_MAX:
                continue
            label = f"transfer_{mode}" + (
                f"[chunk={chunk_bytes >> 20} MiB]" if chunk_bytes else "")
            times = []
            for _ in range(reps + 1):
                cache, manager = make_pool(prompt, device, seed=prompt)
                dist.barrier()
                if rank == 0:
                    transfer.send_sequence(cache, manager, "req", dst=1, mode=mode,
                                           chunk_bytes=chunk_bytes)
                    ok = True
                else:
                    dst_cache, dst_manager = make_pool(prompt, device, seed=prompt + 1)
                    dst_manager.free_sequence("req")
                    moved = transfer.recv_sequence(dst_cache, dst_manager, "req2", src=0)
                    times.append(moved.seconds)
                    # The data equals the sender's: regenerate the sender's pool here.
                    ref_table = manager.block_table("req")
                    got_table = dst_manager.block_table("req2")
                    ok = all(torch.equal(cache.k_caches[layer][ref_table],
                                         dst_cache.k_caches[layer][got_table])
                             and torch.equal(cache.v_caches[layer][ref_table],
                                             dst_cache.v_caches[layer][got_table])
                             for layer in range(cache.num_layers))
                    payload = moved.payload_bytes
                    del dst_cache
                del cache  # (the caching allocator keeps the memory for the next rep)
                if not ok:
                    raise AssertionError(f"{mode} transfer of {prompt} tokens: data differ")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            if rank == 1:
                ms = statistics.median(times[1:]) * 1e3
                rows.append({"case": f"P{prompt}", "backend": label, "ms": ms,
                             "gbps": payload / ms / 1e6, "payload_bytes": payload,
                             "prompt_tokens": prompt,
                             "chunk_bytes": chunk_bytes})
    return {"rows": rows, "nccl_gbps": nccl_gbps}


def recompute_ms(prompts, reps: int = 3) -> dict[int, float]:
    """Prefill time of a random-weight Llama-3-8B-like model (bf16, SDPA) on cuda:1."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                         max_position_embeddings=40000, attn_implementation="sdpa")
    with torch.device("cuda:1"):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    out = {}
    for prompt in prompts:
        ids = torch.randint(0, config.vocab_size, (1, prompt), device="cuda:1")
        times = []
        for _ in range(reps + 1):
            torch.cuda.synchronize(1)
            t0 = time.perf_counter()
            with torch.no_grad():
                model(input_ids=ids, use_cache=False, logits_to_keep=1)
            torch.cuda.synchronize(1)
            times.append(time.perf_counter() - t0)
        out[prompt] = statistics.median(times[1:]) * 1e3
    del model
    torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("transfer", __doc__, out="transfer.json", out_help="JSON path")
    p.add_argument("--prompts", default=",".join(map(str, PROMPTS)))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--no-recompute", action="store_true")
    p.add_argument("--sweep-chunk-mib", default="",
                   help="comma-separated packed message sizes (MiB) to time too, prompts >= 8k")
    args = p.parse_args(argv)
    if torch.cuda.device_count() < 2:
        print("This suite needs two CUDA GPUs (it moves KV blocks between them); lesson 11 "
              "shows the committed results from results/h200x2/.")
        return 2
    from paged_course.two_ranks import run_two_ranks

    prompts = [int(x) for x in args.prompts.split(",") if x]
    env = environment()
    p2p = p2p_copy_gbps()
    print(f"{env['gpu']} x2: cuda:0 -> cuda:1 copy {p2p:.0f} GB/s")
    chunk_mib = [int(x) for x in args.sweep_chunk_mib.split(",") if x]
    res = run_two_ranks(_rank_main, backend="nccl", prompts=prompts, reps=args.reps,
                        chunk_mib=chunk_mib)[1]
    rows = res["rows"]
    recompute = {} if args.no_recompute else recompute_ms(prompts)
    for prompt, ms in recompute.items():
        rows.append({"case": f"P{prompt}", "backend": "recompute_prefill_8b", "ms": ms,
                     "prompt_tokens": prompt})
    for r in rows:
        if "gbps" in r:
            r["pct_p2p_copy_bw"] = 100 * r["gbps"] / p2p
            r["pct_nccl_bw"] = 100 * r["gbps"] / res["nccl_gbps"]
    result = {**env, "num_gpus": 2, "p2p_copy_gbps": p2p, "nccl_sendrecv_gbps": res["nccl_gbps"],
              "shape": {**SHAPE, "dtype": "bfloat16"}, "results": rows}
    for r in rows:
        extra = (f"{r['gbps']:7.1f} GB/s {r['pct_p2p_copy_bw']:5.1f} % of copy"
                 if "gbps" in r else "")
        print(f"{r['case']:8s} {r['backend']:22s} {r['ms']:9.3f} ms {extra}")
    write_result(result, args.out)
    print(f"NCCL send/recv {res['nccl_gbps']:.0f} GB/s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
