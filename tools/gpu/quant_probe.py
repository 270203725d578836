"""Why is decode over an FP8 / INT4 cache not 2x / 4x faster than over bf16? Probes on one GPU.

Decode reads every cached byte once, so a quantised cache should take its bytes over the
bandwidth. On the H200 (benchmarks/h200/quant.json) our FP8 kernel and FlashInfer's both took
0.227 ms on B64_L4096 (55 % of copy bandwidth counting FP8 bytes), and on B256_L1024 FP8 took
the same time as bf16. This script separates the candidate limits, on the B64_L4096 shape
(32 query / 8 KV heads, head_dim 128, blocks of 16, shuffled block tables):

* ``read``: a kernel that only *reads* the cache with the attention kernel's addressing (one
  program per (sequence, KV head), a tile of rows of ``row_bytes`` each through the block
  table) and XORs the words: the bandwidth of the access pattern itself, no compute. Rows of
  256 B (bf16), 128 B (fp8), 64 B (int4); also all KV heads of a token in one row (contiguous
  1 KiB for fp8) and identity (sorted) block tables.
* ``attn``: the real kernels at several launch configs and split chunk counts, fp8 and int4,
  and bf16 at B64_L2048 (the same bytes as fp8 at L4096).

Writes ``$OUT/quant_probe.json``. Run on a GPU machine: ``python tools/gpu/quant_probe.py``.
"""

from __future__ import annotations

import dataclasses
import os
import sys

import torch
import triton
import triton.language as tl

from paged_course.results import environment, write_result
from paged_course.testing import make_paged_inputs
from paged_course.timing import copy_bandwidth_gbps, time_ms, warm_up_gpu
from paged_ref.kernels.triton.decode import KernelConfig, paged_attention_triton
from paged_ref.kernels.triton.split import SplitPlan, SplitScratch, paged_attention_split

DEVICE = "cuda"
SHAPE = dict(num_q_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
             dtype=torch.bfloat16)


@triton.jit
def read_kernel(out_ptr, k_ptr, v_ptr, table_ptr, seq_len, chunk, stride_bt, stride_kb,
                stride_kt, stride_kh, BLOCK_SIZE: tl.constexpr, WORDS: tl.constexpr,
                TILE: tl.constexpr):
    """Program (b, h, c): XOR of the int32 words of K and V rows of tokens [c*chunk, ...)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    c = tl.program_id(2)
    offs_t = tl.arange(0, TILE)
    offs_w = tl.arange(0, WORDS)
    acc = tl.zeros([TILE, WORDS], dtype=tl.int32)
    start = c * chunk
    end = tl.minimum(start + chunk, seq_len)
    for t0 in range(start, end, TILE):
        tok = t0 + offs_t
        blk = tl.load(table_ptr + b * stride_bt + tok // BLOCK_SIZE).to(tl.int64)
        row = blk * stride_kb + (tok % BLOCK_SIZE) * stride_kt + h * stride_kh
        k = tl.load(k_ptr + row[:, None] + offs_w[None, :])
        v = tl.load(v_ptr + row[:, None] + offs_w[None, :])
        acc = acc ^ k ^ v
    tl.store(out_ptr + (b * tl.num_programs(1) + h) * tl.num_programs(2) + c,
             tl.xor_sum(tl.xor_sum(acc, axis=1), axis=0))


def read_case(label, batch, seq_len, row_bytes, heads_per_row, chunks, tile, stages, warps,
              identity, copy_bw):
    """Time the read probe; row_bytes per (token, head) (x heads_per_row heads in one row)."""
    hkv, bs = SHAPE["num_kv_heads"], SHAPE["block_size"]
    blocks_per_seq = seq_len // bs
    num_blocks = batch * blocks_per_seq
    words_per_head = row_bytes // 4
    k = torch.randint(0, 2**30, (num_blocks, bs, hkv, words_per_head), dtype=torch.int32,
                      device=DEVICE)
    v = torch.randint(0, 2**30, (num_blocks, bs, hkv, words_per_head), dtype=torch.int32,
                      device=DEVICE)
    order = (torch.arange(num_blocks, device=DEVICE) if identity
             else torch.randperm(num_blocks, device=DEVICE))
    table = order.view(batch, blocks_per_seq).to(torch.int32).contiguous()
    programs_h = hkv // heads_per_row
    words = words_per_head * heads_per_row
    out = torch.empty(batch * programs_h * chunks, dtype=torch.int32, device=DEVICE)
    chunk = seq_len // chunks

    def run():
        read_kernel[(batch, programs_h, chunks)](
            out, k, v, table, seq_len, chunk, table.stride(0), k.stride(0), k.stride(1),
            k.stride(2) * heads_per_row, BLOCK_SIZE=bs, WORDS=words, TILE=tile,
            num_warps=warps, num_stages=stages)

    run()
    torch.cuda.synchronize()
    ms = time_ms(run)
    nbytes = 2 * k.numel() * 4
    return dict(kind="read", label=label, batch=batch, seq_len=seq_len, row_bytes=row_bytes,
                heads_per_row=heads_per_row, chunks=chunks, tile=tile, stages=stages,
                warps=warps, identity=identity, ms=ms, bytes=nbytes,
                pct_copy_bw=100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw)


def attn_case(label, fmt, batch, seq_len, config, chunks, identity, copy_bw):
    inp = make_paged_inputs([seq_len] * batch, device=DEVICE, seed=0, spare_blocks=0, **SHAPE)
    if identity:  # sequence b holds blocks b*nb .. (b+1)*nb - 1, in order
        nb = seq_len // SHAPE["block_size"]
        table = torch.full_like(inp.block_tables, -1)
        table[:, :nb] = torch.arange(batch * nb, device=DEVICE, dtype=table.dtype).view(batch, nb)
        inp = dataclasses.replace(inp, block_tables=table)
    if fmt != "bf16":
        inp = inp.quantized(fmt)
    args = inp.args()
    out = torch.empty_like(inp.q)
    if chunks == 1:
        def run():
            paged_attention_triton(*args, config=config, out=out)
    else:
        plan = SplitPlan(chunk_size=seq_len // chunks, num_chunks=chunks)
        scratch = SplitScratch.allocate(batch, SHAPE["num_q_heads"], SHAPE["num_kv_heads"],
                                        SHAPE["head_dim"], plan, DEVICE)

        def run():
            paged_attention_split(*args, plan=plan, out=out, scratch=scratch, config=config)
    run()
    torch.cuda.synchronize()
    ms = time_ms(run)
    nbytes = inp.kv_bytes
    return dict(kind="attn", label=label, fmt=fmt, batch=batch, seq_len=seq_len,
                config=vars(config), chunks=chunks, identity=identity, ms=ms, bytes=nbytes,
                pct_copy_bw=100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw)


def start(name: str) -> tuple[str, float] | None:
    """``($OUT/<name>.json, copy bandwidth GB/s)`` after warming the GPU up; ``None`` (said)
    without a CUDA GPU. (tools/gpu/fp8_v_probe.py starts the same way.)"""
    if not torch.cuda.is_available():
        print(f"{name}.py needs a CUDA GPU")
        return None
    warm_up_gpu()
    return os.path.join(os.environ.get("OUT", "."), f"{name}.json"), copy_bandwidth_gbps()


def main() -> int:
    started = start("quant_probe")
    if started is None:
        return 1
    out_path, copy_bw = started
    result = dict(environment(), copy_bw_gbps=copy_bw, shape={**SHAPE, "dtype": "bfloat16"},
                  rows=[])
    rows = result["rows"]

    def add(row):
        rows.append(row)
        extra = {k: row[k] for k in ("tile", "stages", "warps", "config", "chunks", "identity")
                 if k in row}
        print(f"{row['kind']:4s} {row['label']:28s} {row['ms']:.4f} ms "
              f"{row['pct_copy_bw']:5.1f} %  {extra}", flush=True)
        write_result(result, out_path)

    # 1. The access pattern alone.
    for row_bytes, name in ((256, "bf16"), (128, "fp8"), (64, "int4")):
        for tile, stages, warps in ((64, 1, 4), (64, 3, 4), (128, 3, 4), (128, 3, 8),
                                    (256, 2, 8)):
            add(read_case(f"read {name} rows", 64, 4096, row_bytes, 1, 1, tile, stages, warps,
                          False, copy_bw))
        add(read_case(f"read {name} rows sorted", 64, 4096, row_bytes, 1, 1, 128, 3, 4, True,
                      copy_bw))
        add(read_case(f"read {name} rows 4 chunks", 64, 4096, row_bytes, 1, 4, 64, 3, 4,
                      False, copy_bw))
        add(read_case(f"read {name} all heads", 64, 4096, row_bytes, 8, 8, 32, 3, 8, False,
                      copy_bw))
    # 2. The kernels.
    warm_up_gpu()
    add(attn_case("bf16 L4096", "bf16", 64, 4096, KernelConfig(64, 4, 3), 1, False, copy_bw))
    add(attn_case("bf16 L2048 (fp8 bytes)", "bf16", 64, 2048, KernelConfig(64, 4, 3), 1, False,
                  copy_bw))
    add(attn_case("bf16 L1024 (int4 bytes)", "bf16", 64, 1024, KernelConfig(64, 4, 3), 1,
                  False, copy_bw))
    for fmt in ("fp8", "int4"):
        for tile, warps, stages in ((64, 4, 3), (128, 4, 3), (128, 4, 2), (128, 8, 2),
                                    (256, 8, 2), (64, 2, 3), (32, 2, 4), (32, 4, 4)):
            add(attn_case(f"{fmt}", fmt, 64, 4096, KernelConfig(tile, warps, stages), 1, False,
                          copy_bw))
        add(attn_case(f"{fmt} sorted", fmt, 64, 4096, KernelConfig(128, 4, 3), 1, True,
                      copy_bw))
        for chunks in (2, 4, 8):
            for cfg in (KernelConfig(64, 4, 3), KernelConfig(128, 4, 3)):
                add(attn_case(f"{fmt} split", fmt, 64, 4096, cfg, chunks, False, copy_bw))
    print("wrote", out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
