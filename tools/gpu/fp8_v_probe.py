"""Which half of an FP8 decode is slow, K or V? And does a transposed V layout fix it?

tools/gpu/quant_probe.py showed that reading an FP8 cache with the kernel's addressing runs
at 90 % of copy bandwidth, but the FP8 kernel at 55 %, slower per token than bf16. A
hypothesis: in ``p @ V`` the reduction runs over tokens, but V's bytes are contiguous along
head_dim, so the MMA's B operand must be transposed on its way from shared memory; Hopper's
``ldmatrix.trans`` moves 16-bit elements only, so 8-bit V takes a slow path (K is fine: its
reduction dim, head_dim, is the contiguous one). vLLM's first paged kernel stored V as
``[num_blocks, num_kv_heads, head_dim, block_size]`` for this reason.

A stripped attention kernel (full tiles, B64_L4096 shape, shuffled tables) with K and V each
in one of: ``bf16``, ``fp8`` (token-major, ``.to(float16)``), ``fp8t`` (V only: stored
``[blocks, heads, head_dim, block_size]``). Checked against float64, then timed.
Writes ``$OUT/fp8_v_probe.json``.
"""

from __future__ import annotations

import functools
import sys

import torch
import triton
import triton.language as tl
from quant_probe import start  # (this folder is on sys.path when the script runs)

from paged_course.results import environment, write_result
from paged_course.timing import time_ms

DEVICE = "cuda"
B, L, HQ, HKV, D, BS = 64, 4096, 32, 8, 128, 16


@triton.jit
def probe_kernel(out_ptr, q_ptr, k_ptr, v_ptr, table_ptr, seq_len, qk_scale, v_scale,
                 stride_bt, skb, skt, skh, svb, svt, svh, svd,
                 BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                 D: tl.constexpr, TILE: tl.constexpr, K_FP8: tl.constexpr,
                 V_FP8: tl.constexpr, V_T: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, TILE)
    g_mask = offs_g < GROUP
    q = tl.load(q_ptr + (b * GROUP * tl.num_programs(1) + h * GROUP + offs_g)[:, None] * D
                + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    if K_FP8 or V_FP8:
        q = q.to(tl.float16)
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, D], dtype=tl.float32)
    for t0 in range(0, seq_len, TILE):
        tok = t0 + offs_t
        blk = tl.load(table_ptr + b * stride_bt + tok // BLOCK_SIZE).to(tl.int64)
        krow = blk * skb + (tok % BLOCK_SIZE) * skt + h * skh
        k = tl.load(k_ptr + krow[:, None] + offs_d[None, :]).to(q.dtype)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if V_T:  # [blocks, heads, D, BLOCK_SIZE]: tokens of a block contiguous for each d
            vrow = blk * svb + h * svh + (tok % BLOCK_SIZE) * svt
            v = tl.load(v_ptr + vrow[:, None] + offs_d[None, :] * svd)
        else:
            vrow = blk * svb + (tok % BLOCK_SIZE) * svt + h * svh
            v = tl.load(v_ptr + vrow[:, None] + offs_d[None, :])
        v = v.to(q.dtype)
        acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v)
        m = m_new
    o = acc * v_scale / l[:, None]
    tl.store(out_ptr + (b * GROUP * tl.num_programs(1) + h * GROUP + offs_g)[:, None] * D
             + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


def main() -> int:
    started = start("fp8_v_probe")
    if started is None:
        return 1
    out_path, copy_bw = started
    torch.manual_seed(0)
    nb = B * L // BS
    k16 = torch.randn(nb, BS, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    v16 = torch.randn(nb, BS, HKV, D, device=DEVICE, dtype=torch.bfloat16)
    q = torch.randn(B, HQ, D, device=DEVICE, dtype=torch.bfloat16)
    table = torch.randperm(nb, device=DEVICE).view(B, L // BS).to(torch.int32).contiguous()
    sk = float(k16.abs().max()) / 448
    sv = float(v16.abs().max()) / 448
    k8 = (k16.float() / sk).to(torch.float8_e4m3fn)
    v8 = (v16.float() / sv).to(torch.float8_e4m3fn)
    v8t = v8.permute(0, 2, 3, 1).contiguous()  # [nb, HKV, D, BS]
    # float64 reference on the fp8 values
    kd = (k8.double() * sk)[table.long()].reshape(B, L, HKV, D)
    vd = (v8.double() * sv)[table.long()].reshape(B, L, HKV, D)
    g = HQ // HKV
    qd = q.double().view(B, HKV, g, D)
    scores = torch.einsum("bhgd,blhd->bhgl", qd, kd) / D**0.5
    ref = torch.einsum("bhgl,blhd->bhgd", scores.softmax(-1), vd).reshape(B, HQ, D)
    del kd, vd, scores
    result = dict(environment(), copy_bw_gbps=copy_bw, rows=[])
    for label, kc, vc, kfp8, vfp8, vt, tile, warps, stages in (
        ("bf16 K, bf16 V", k16, v16, 0, 0, 0, 64, 4, 3),
        ("fp8 K, bf16 V", k8, v16, 1, 0, 0, 64, 4, 3),
        ("bf16 K, fp8 V", k16, v8, 0, 1, 0, 64, 4, 3),
        ("fp8 K, fp8 V", k8, v8, 1, 1, 0, 64, 4, 3),
        ("fp8 K, fp8 V", k8, v8, 1, 1, 0, 128, 4, 3),
        ("fp8 K, fp8 V^T", k8, v8t, 1, 1, 1, 64, 4, 3),
        ("fp8 K, fp8 V^T", k8, v8t, 1, 1, 1, 128, 4, 3),
        ("fp8 K, fp8 V^T", k8, v8t, 1, 1, 1, 128, 8, 3),
        ("fp8 K, fp8 V^T", k8, v8t, 1, 1, 1, 64, 4, 4),
        ("fp8 K, fp8 V^T", k8, v8t, 1, 1, 1, 32, 4, 4),
        ("fp8 K, fp8 V^T", k8, v8t, 1, 1, 1, 64, 2, 3),
    ):
        out = torch.empty_like(q)
        ks = sk if kfp8 else 1.0
        vs = sv if vfp8 else 1.0
        if vt:
            svb, svt, svh, svd = vc.stride(0), vc.stride(3), vc.stride(1), vc.stride(2)
        else:
            svb, svt, svh, svd = vc.stride(0), vc.stride(1), vc.stride(2), 1

        run = functools.partial(
            probe_kernel[(B, HKV)],
            out, q, kc, vc, table, L, ks / D**0.5 * 1.4426950408889634, vs,
            table.stride(0), kc.stride(0), kc.stride(1), kc.stride(2), svb, svt, svh, svd,
            BLOCK_SIZE=BS, GROUP=g, GROUP_PAD=16, D=D, TILE=tile, K_FP8=kfp8, V_FP8=vfp8,
            V_T=vt, num_warps=warps, num_stages=stages)
        try:
            run()
            torch.cuda.synchronize()
        except Exception as exc:
            print(label, tile, warps, stages, "failed:", type(exc).__name__, str(exc)[:300])
            continue
        # bf16 K/V rows are compared with the fp8 reference: error is the rounding (~3e-2)
        err = float((out.double() - ref).norm() / ref.norm())
        ms = time_ms(run)
        nbytes = kc.numel() * kc.element_size() + vc.numel() * vc.element_size()
        row = dict(label=label, tile=tile, warps=warps, stages=stages, ms=ms, bytes=nbytes,
                   pct_copy_bw=100 * nbytes / (ms * 1e-3) / 1e9 / copy_bw, rel_err=err)
        result["rows"].append(row)
        print(f"{label:16s} t{tile} w{warps} s{stages}: {ms:.4f} ms "
              f"{row['pct_copy_bw']:5.1f} % err {err:.1e}", flush=True)
        write_result(result, out_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
