"""How should an FP8 decode kernel compute ``p @ V``? Probes on one GPU.

tools/gpu/fp8_v_probe.py found the slow half of FP8 decode: with FP8 K and bf16 V a stripped
kernel reaches 88 % of copy bandwidth, with FP8 V only 58-68 %. V is converted in registers
(``v.to(float16)``) before ``tl.dot(p, v)``, so the converted tile goes registers -> shared
memory -> MMA and loses the asynchronous copy pipeline a plain 16-bit operand gets. Here K and
V are FP8 (e4m3, one scale each), K token-major (by default converted to float16 for
``q @ K^T``: the path that was fast); the variants differ in how ``p @ V`` is done (``PV``),
how ``q @ K^T`` is done (``QK``) and V's layout:

* ``dot``: V ``.to(float16)``, ``tl.dot(p16, v16)`` (today's kernel); a small launch sweep;
* ``bits``: as ``dot``, but V read as bytes and turned into float16 with integer operations
  (``sign << 8 | magnitude << 7`` is the float16 of e4m3 / 256, exactly);
* ``fma``: no MMA for ``p @ V``: ``tl.sum(p[:, :, None] * v[None, :, :], axis=1)`` on the CUDA
  cores, the 4 query heads of a KV head unpadded; with ``QK=fma`` ``q @ K^T`` too;
* ``dot_t``: the transposed product ``acc^T[D, G] += V^T[D, T] @ p^T[T, G]``: V is the A
  operand (which an MMA may take from registers), the accumulator kept transposed;
* ``fp8``: no conversion of V asked for: ``tl.dot(p8, v8)`` in e4m3 (p scaled by 256 first so
  that small probabilities keep their bits). P in e4m3 has 3 mantissa bits: the error is
  reported next to the time;
* ``fp8_t``: FP8 MMA on the transposed product, ``acc^T += V^T8 @ p8^T``;
* ``QK=dot_t``: scores transposed too, ``s^T[T, G] = K[T, D] @ q^T[D, G]`` (an MMA with M = the
  tile, which Hopper's wgmma wants), p kept as p^T: with ``fp8_t`` no transpose anywhere;
  ``QK=fp8_t``: the same in e4m3 (q rounded to e4m3 with a per-program scale): neither K nor V
  passes through registers, FlashAttention-3's FP8 recipe;
* ``v_layout="dT"``: V stored ``[blocks, kv_heads, head_dim, block_size]`` (tokens contiguous:
  the MMA's reduction dim, as an 8-bit MMA operand wants it) instead of token-major
  ``[blocks, block_size, kv_heads, head_dim]``.

Each row is checked against a float64 reference of the FP8 values (a wrong or failing variant
is recorded as such, and the sweep goes on), then timed with ``time_ms``; % of copy bandwidth
counts the FP8 K + V bytes. Shape B64_L4096: 32 query heads, 8 KV heads, head_dim 128, blocks
of 16, shuffled block tables, full tiles. Writes ``$OUT/fp8_pv_probe.json``.

Run on a GPU machine, from the repository root (under 3 minutes)::

    OUT=/tmp/out PYTHONPATH=$PWD python3 tools/gpu/fp8_pv_probe.py

Without a GPU, ``TRITON_INTERPRET=0 PYTHONPATH=$PWD python3 tools/gpu/fp8_pv_probe.py --ptx``
compiles every variant for sm_90 (H100/H200) and counts PTX instructions (add a part of a
label, e.g. ``--ptx pv=fp8_t``, for some). What Triton 3.6 makes of them there:

* ``dot`` / ``bits`` / ``fp8``, token-major V: V is copied to shared memory asynchronously,
  then read back with many scalar ``ld.shared`` (``ldmatrix`` cannot transpose 8-bit values):
  ~200 of them a tile of 128 against ~50 with V stored ``dT``;
* ``fp8`` (M = 16 query rows): on sm_90 ``mma.sync`` has no e4m3 form, so Triton converts both
  operands to float16: the same code as ``dot`` but for the rounding of p;
* ``fp8_t`` with V ``dT`` (M = head_dim = 128): ``wgmma ... e4m3`` reads V straight from
  shared memory, filled by 16-byte ``cp.async``: V never passes through registers; with
  ``QK=fp8_t`` there is no fp8 -> float16 conversion left at all;
* ``fp8_t`` with token-major V: V is loaded to registers (not asynchronously) and stored to
  shared memory transposed for the wgmma (e4m3 operands must be K-major): no conversion, no
  change of the cache layout, but no asynchronous pipeline for V;
* ``dot_t`` with V ``dT`` does not compile (a 1-byte ``cp.async``): recorded as failed.

On a CPU, tests/test_fp8_pv_probe.py runs every variant in Triton's interpreter at small sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import torch
import triton
import triton.language as tl
from quant_probe import start  # (this folder is on sys.path when the script runs)

from paged_course import sm90
from paged_course.results import environment, write_result
from paged_course.timing import time_ms

DEVICE = "cuda"
B, L, HQ, HKV, D, BS = 64, 4096, 32, 8, 128, 16
#: p is multiplied by this before it is rounded to e4m3 (p <= 1; e4m3's max is 448).
P_SCALE = 256.0
#: Budget for the sweep on the GPU (the script stays under 3 minutes).
SWEEP_SECONDS = 140.0


@triton.jit
def pv_probe_kernel(out_ptr, q_ptr, k_ptr, v_ptr, table_ptr, seq_len, qk_scale, v_scale,
                    stride_bt, skb, skt, skh, svb, svt, svh, svd,
                    BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
                    D: tl.constexpr, TILE: tl.constexpr, QK: tl.constexpr, PV: tl.constexpr,
                    V_T: tl.constexpr, ACC_T: tl.constexpr, P_SCALE: tl.constexpr):
    """Program (b, h): the GROUP query heads of KV head h of sequence b over ``seq_len`` tokens
    (a multiple of TILE). K: FP8 ``[blocks, BLOCK_SIZE, kv_heads, D]``; V: FP8 (uint8 for
    ``PV="bits"``) token-major, or ``[blocks, kv_heads, D, BLOCK_SIZE]`` when ``V_T``."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, D)
    offs_t = tl.arange(0, TILE)
    g_mask = offs_g < GROUP
    rows = (b * GROUP * tl.num_programs(1) + h * GROUP + offs_g)[:, None] * D + offs_d[None, :]
    q = tl.load(q_ptr + rows, mask=g_mask[:, None], other=0.0).to(tl.float16)
    if QK == "fp8_t":  # q in e4m3 too, scaled per program to e4m3's range
        q_max = tl.max(tl.max(tl.abs(q.to(tl.float32)), axis=1), axis=0)
        q8 = (q.to(tl.float32) * (448.0 / q_max)).to(tl.float8e4nv)
    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    if ACC_T:
        acc = tl.zeros([D, GROUP_PAD], dtype=tl.float32)
    else:
        acc = tl.zeros([GROUP_PAD, D], dtype=tl.float32)
    for t0 in range(0, seq_len, TILE):
        tok = t0 + offs_t
        blk = tl.load(table_ptr + b * stride_bt + tok // BLOCK_SIZE).to(tl.int64)
        krow = blk * skb + (tok % BLOCK_SIZE) * skt + h * skh
        k = tl.load(k_ptr + krow[:, None] + offs_d[None, :])  # [TILE, D] fp8
        if QK == "dot_t" or QK == "fp8_t":  # s^T = K q^T: [TILE, GROUP_PAD], softmax on columns
            if QK == "fp8_t":
                st = tl.dot(k, tl.trans(q8)) * (qk_scale * q_max / 448.0)
            else:
                st = tl.dot(k.to(tl.float16), tl.trans(q)) * qk_scale
            m_new = tl.maximum(m, tl.max(st, axis=0))
            alpha = tl.exp2(m - m_new)
            pt = tl.exp2(st - m_new[None, :])
            l = l * alpha + tl.sum(pt, axis=0)
            p = tl.trans(pt)
        else:
            if QK == "fma":
                s = tl.sum(q.to(tl.float32)[:, None, :] * k.to(tl.float32)[None, :, :], axis=2)
            else:
                s = tl.dot(q, tl.trans(k.to(tl.float16)))
            s = s * qk_scale  # [GROUP_PAD, TILE], log2 units
            m_new = tl.maximum(m, tl.max(s, axis=1))
            alpha = tl.exp2(m - m_new)
            p = tl.exp2(s - m_new[:, None])
            l = l * alpha + tl.sum(p, axis=1)
        m = m_new
        if V_T:  # vt: [D, TILE], tokens of a block contiguous for each d
            vt = tl.load(v_ptr + (blk * svb + h * svh + (tok % BLOCK_SIZE) * svt)[None, :]
                         + offs_d[:, None] * svd)
            v = tl.trans(vt)
        else:  # v: [TILE, D], head_dim contiguous
            v = tl.load(v_ptr + (blk * svb + (tok % BLOCK_SIZE) * svt + h * svh)[:, None]
                        + offs_d[None, :])
            vt = tl.trans(v)
        if PV == "dot":
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v.to(tl.float16))
        elif PV == "bits":  # e4m3 byte -> float16 bits of (value / 256), exact
            x = v.to(tl.uint16)
            v16 = (((x & 0x80) << 8) | ((x & 0x7F) << 7)).to(tl.float16, bitcast=True)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), v16)
        elif PV == "fma":
            acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v.to(tl.float32)[None, :, :],
                                                axis=1)
        elif PV == "dot_t":
            acc = acc * alpha[None, :] + tl.dot(vt.to(tl.float16),
                                                tl.trans(p.to(tl.float16)))
        elif PV == "fp8":
            acc = acc * alpha[:, None] + tl.dot((p * P_SCALE).to(tl.float8e4nv), v)
        else:  # "fp8_t"
            acc = acc * alpha[None, :] + tl.dot(vt, tl.trans((p * P_SCALE).to(tl.float8e4nv)))
    if ACC_T:
        acc = tl.trans(acc)
    if PV == "bits":
        acc = acc * 256.0
    if PV == "fp8" or PV == "fp8_t":
        acc = acc / P_SCALE
    o = acc * v_scale / l[:, None]
    tl.store(out_ptr + rows, o.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])


@dataclasses.dataclass(frozen=True)
class Variant:
    """One kernel configuration: how ``p @ V`` and ``q @ K^T`` are done, V's layout
    (``"tok"`` token-major or ``"dT"``), the padded group rows and the launch config."""

    pv: str
    qk: str = "dot"
    v_layout: str = "tok"
    group_pad: int = 16
    tile: int = 64
    warps: int = 4
    stages: int = 3

    @property
    def label(self) -> str:
        return (f"pv={self.pv} qk={self.qk} v={self.v_layout} g{self.group_pad} "
                f"t{self.tile} w{self.warps} s{self.stages}")

    @property
    def fp8_p(self) -> bool:
        """p (and with ``qk="fp8_t"`` q) rounded to e4m3: a larger error is expected."""
        return self.pv in ("fp8", "fp8_t") or self.qk == "fp8_t"

    @property
    def tolerance(self) -> float:
        """Largest relative error vs float64 that counts as right on the GPU, about twice the
        expected: float16 p ~2e-4; e4m3 p (rounded to nearest) ~2.5e-2, e4m3 q and p ~3.7e-2
        (emulated in torch on these random inputs; the e4m3 cache vs bf16 is ~3e-2)."""
        if self.qk == "fp8_t":
            return 7e-2
        return 5e-2 if self.fp8_p else 1e-2


def sweep() -> list[Variant]:
    """The GPU sweep (~40 configs): today's kernel first, then the new ways, the likeliest
    first (so that the time guard, if it bites, cuts the rest of today's launch sweep, at the
    end). (num_stages 4 compiles as 3 for the wgmma variants here, 5 deepens the pipeline.)"""
    v = Variant
    rows = [v("dot", tile=64), v("dot", tile=128), v("dot", v_layout="dT", tile=128)]
    rows += [v("fp8_t", qk="fp8_t", v_layout="dT", tile=t, warps=w, stages=s) for t, w, s in (
        (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 4, 5), (128, 8, 3), (256, 4, 3), (256, 8, 3))]
    rows += [v("fp8_t", v_layout="dT", tile=t, warps=w, stages=s) for t, w, s in (
        (64, 4, 3), (128, 4, 3), (128, 4, 5), (128, 8, 3))]
    rows += [v("fp8_t", qk="dot_t", v_layout="dT", tile=t) for t in (64, 128)]
    rows += [v("fp8_t", tile=128), v("fp8_t", qk="fp8_t", tile=128),
             v("fp8_t", qk="fp8_t", tile=64)]
    rows += [v("fp8", v_layout="dT", tile=t) for t in (64, 128)]
    rows += [v("fp8", v_layout="dT", group_pad=4, tile=128), v("fp8", tile=128)]
    rows += [v("fma", qk="fma", group_pad=4, tile=t, warps=w)
             for t, w in ((16, 4), (32, 4), (16, 8), (32, 8), (64, 8))]
    rows += [v("fma", group_pad=4, tile=32, stages=2)]
    rows += [v("dot_t", tile=t) for t in (64, 128)]
    rows += [v("dot_t", v_layout="dT", tile=128)]
    rows += [v("bits", tile=t) for t in (64, 128)]
    rows += [v("dot", group_pad=4, tile=128)]
    rows += [v("dot", tile=t, warps=w, stages=s) for t, w, s in (
        (32, 4, 3), (64, 4, 2), (64, 8, 3), (128, 4, 2), (128, 4, 4), (128, 8, 3))]
    return rows


def sweep_small() -> list[Variant]:
    """``--small``: the launch shapes tools/gpu/quant_regs_probe.py found best for the library's
    FP8 kernel (64 tokens, 2 warps: 66 % against 54 % at 128 tokens, 4 warps), on the layouts
    and MMAs here: does V stored ``dT`` gain there what it lost at 128 tokens, 4 warps?"""
    v = Variant
    rows = [v("dot", tile=64, warps=2)]
    rows += [v("dot", v_layout="dT", tile=t, warps=w, stages=s) for t, w, s in (
        (64, 2, 3), (64, 2, 4), (32, 2, 3), (64, 4, 3), (128, 2, 3), (32, 1, 3), (64, 1, 3))]
    rows += [v("fp8_t", qk="fp8_t", v_layout="dT", tile=t, warps=w, stages=s) for t, w, s in (
        (64, 4, 4), (64, 4, 5), (128, 4, 4))]
    rows += [v("dot", group_pad=4, v_layout="dT", tile=64, warps=2)]
    return rows


@dataclasses.dataclass
class Inputs:
    """An FP8 paged cache, queries, a shuffled block table and the float64 reference."""

    q: torch.Tensor        # [batch, q_heads, D] bfloat16 (float32 in the interpreter)
    k8: torch.Tensor       # [blocks, BS, kv_heads, D] float8_e4m3fn
    v8: torch.Tensor       # [blocks, BS, kv_heads, D] float8_e4m3fn
    v8t: torch.Tensor      # [blocks, kv_heads, D, BS] float8_e4m3fn, the same values
    k_scale: float
    v_scale: float
    table: torch.Tensor    # [batch, max_blocks] int32, shuffled; unused entries hold garbage
    seq_len: int
    ref: torch.Tensor      # [batch, q_heads, D] float64

    @property
    def kv_bytes(self) -> int:
        return 2 * self.k8.numel() * self.k8.element_size()


def make_inputs(batch: int, seq_len: int, kv_heads: int, group: int, head_dim: int,
                block_size: int, device: str, seed: int = 0, spare_entries: int = 0,
                q_dtype: torch.dtype | None = None) -> Inputs:
    """Random K/V quantised to e4m3 with per-tensor scales; ``seq_len`` tokens per sequence
    (a multiple of ``block_size``); ``spare_entries`` extra table columns of garbage (-1);
    q in ``q_dtype`` (default bfloat16 on a GPU, float32 on a CPU)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    nb_seq = seq_len // block_size
    nb = batch * nb_seq
    shape = (nb, block_size, kv_heads, head_dim)
    k = torch.randn(shape, device=device, generator=gen)
    v = torch.randn(shape, device=device, generator=gen)
    q_dtype = q_dtype or (torch.float32 if device == "cpu" else torch.bfloat16)
    q = torch.randn(batch, kv_heads * group, head_dim, device=device, generator=gen)
    q = q.to(q_dtype)
    k_scale = float(k.abs().max()) / 448
    v_scale = float(v.abs().max()) / 448
    k8 = (k / k_scale).to(torch.float8_e4m3fn)
    v8 = (v / v_scale).to(torch.float8_e4m3fn)
    del k, v
    order = torch.randperm(nb, device=device, generator=gen).view(batch, nb_seq)
    garbage = torch.full((batch, spare_entries), -1, device=device, dtype=order.dtype)
    table = torch.cat([order, garbage], dim=1).to(torch.int32).contiguous()
    kd = (k8.double() * k_scale)[order].reshape(batch, seq_len, kv_heads, head_dim)
    vd = (v8.double() * v_scale)[order].reshape(batch, seq_len, kv_heads, head_dim)
    qd = q.double().view(batch, kv_heads, group, head_dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qd, kd) / head_dim**0.5
    ref = torch.einsum("bhgl,blhd->bhgd", scores.softmax(-1), vd).reshape(q.shape)
    return Inputs(q=q, k8=k8, v8=v8, v8t=v8.permute(0, 2, 3, 1).contiguous(), k_scale=k_scale,
                  v_scale=v_scale, table=table, seq_len=seq_len, ref=ref)


def launcher(var: Variant, inp: Inputs, out: torch.Tensor):
    """A no-argument callable that runs ``var`` on ``inp`` into ``out``."""
    if var.tile % inp.k8.shape[1] and inp.k8.shape[1] % var.tile:
        raise ValueError(f"tile {var.tile} and block_size {inp.k8.shape[1]} do not nest")
    if inp.seq_len % var.tile:
        raise ValueError(f"seq_len {inp.seq_len} is not a multiple of tile {var.tile}")
    batch, q_heads, head_dim = inp.q.shape
    kv_heads = inp.k8.shape[2]
    if var.group_pad < q_heads // kv_heads:
        raise ValueError(f"group_pad {var.group_pad} < {q_heads // kv_heads} query heads a KV head")
    k8 = inp.k8
    if var.v_layout == "dT":
        vc = inp.v8t
        svb, svt, svh, svd = vc.stride(0), vc.stride(3), vc.stride(1), vc.stride(2)
    else:
        vc = inp.v8
        svb, svt, svh, svd = vc.stride(0), vc.stride(1), vc.stride(2), 1
    if var.pv == "bits":
        vc = vc.view(torch.uint8)
    return functools.partial(
        pv_probe_kernel[(batch, kv_heads)],
        out, inp.q, k8, vc, inp.table, inp.seq_len,
        inp.k_scale / head_dim**0.5 * 1.4426950408889634, inp.v_scale,
        inp.table.stride(0), k8.stride(0), k8.stride(1), k8.stride(2), svb, svt, svh, svd,
        BLOCK_SIZE=k8.shape[1], GROUP=q_heads // kv_heads, GROUP_PAD=var.group_pad,
        D=head_dim, TILE=var.tile, QK=var.qk, PV=var.pv, V_T=var.v_layout == "dT",
        ACC_T=var.pv in ("dot_t", "fp8_t"), P_SCALE=P_SCALE, num_warps=var.warps,
        num_stages=var.stages)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


#: PTX instructions counted by ``--ptx``: loads to registers, 16-byte / smaller async copies to
#: shared memory,
#: shared-memory reads, the two MMA kinds, fp8 -> float16 conversions.
PTX_COUNTS = ("ld.global", "cp.async.cg", "cp.async.ca", "ld.shared", "ldmatrix", "mma.sync",
              "wgmma.mma_async", "cvt.rn.f16x2.e4m3x2")


def compile_sm90(var: Variant, inp: Inputs):
    """Compile ``var`` for an H100/H200 (sm_90) without a GPU, specialised as a launch on
    ``inp`` would be (:func:`paged_course.sm90.compile_sm90`). Needs
    ``TRITON_INTERPRET=0``; returns Triton's compiled kernel (``.asm`` holds ``ttgir``, ``ptx``)."""
    run = launcher(var, inp, torch.empty_like(inp.q))
    constexprs = dict(run.keywords)
    options = dict(num_warps=constexprs.pop("num_warps"), num_stages=constexprs.pop("num_stages"))
    values = dict(zip(pv_probe_kernel.arg_names, run.args, strict=False))
    return sm90.compile_sm90(pv_probe_kernel, values, constexprs, options)


def ptx_report(only: str = "") -> list[dict]:
    """Compile the sweep's variants (those whose label contains ``only``) for sm_90 on this
    machine and count PTX instructions of each: which operands pass through registers, which
    MMA is used. Prints a line a variant; a failure to compile is a row too."""
    inp = make_inputs(1, L, HKV, HQ // HKV, D, BS, "cpu", q_dtype=torch.bfloat16)
    rows = []
    for var in sweep():
        if only not in var.label:
            continue
        row = dict(label=var.label)
        try:
            kernel = compile_sm90(var, inp)
            row.update({name: kernel.asm["ptx"].count(name) for name in PTX_COUNTS},
                       shared_bytes=kernel.metadata.shared)
            print(f"{var.label:44s} " + " ".join(f"{k}={v}" for k, v in row.items()
                                                  if k != "label" and v), flush=True)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]}"
            print(f"{var.label:44s} FAILED: {row['error']}", flush=True)
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ptx", metavar="LABEL_PART", nargs="?", const="",
                        help="no GPU needed: compile the variants (whose label contains "
                             "LABEL_PART) for sm_90 and count PTX instructions; run with "
                             "TRITON_INTERPRET=0")
    parser.add_argument("--small", action="store_true",
                        help="run sweep_small() (64-token tiles, 2 warps) into "
                             "fp8_pv_probe_small.json")
    args = parser.parse_args(argv)
    if args.ptx is not None:
        ptx_report(args.ptx)
        return 0
    started = start("fp8_pv_probe_small" if args.small else "fp8_pv_probe")
    if started is None:
        return 1
    out_path, copy_bw = started
    began = time.perf_counter()
    inp = make_inputs(B, L, HKV, HQ // HKV, D, BS, DEVICE)
    result = dict(environment(), copy_bw_gbps=copy_bw,
                  shape=dict(batch=B, seq_len=L, num_q_heads=HQ, num_kv_heads=HKV,
                             head_dim=D, block_size=BS, kv_dtype="float8_e4m3fn"),
                  bytes=inp.kv_bytes, p_scale=P_SCALE, rows=[])
    for var in sweep_small() if args.small else sweep():
        row = dict(label=var.label, **dataclasses.asdict(var))
        result["rows"].append(row)
        if time.perf_counter() - began > SWEEP_SECONDS:
            row["status"] = "skipped (time)"
            print(f"{var.label:44s} skipped (time)", flush=True)
            continue
        out = torch.empty_like(inp.q)
        try:
            run = launcher(var, inp, out)
            run()
            if out.is_cuda:
                torch.cuda.synchronize()
            row["rel_err"] = err = rel_err(out, inp.ref)
            row["ms"] = ms = time_ms(run)  # (a wrong one too: it may be a tolerance off)
        except Exception as exc:  # a variant that does not compile is a result too
            row["status"] = "failed"
            row["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
            print(f"{var.label:44s} FAILED: {row['error'][:200]}", flush=True)
            write_result(result, out_path)
            continue
        row["status"] = "ok" if err <= var.tolerance else "wrong"
        row["pct_copy_bw"] = pct = 100 * inp.kv_bytes / (ms * 1e-3) / 1e9 / copy_bw
        flag = "" if row["status"] == "ok" else f"  WRONG (over {var.tolerance:.0e})"
        print(f"{var.label:44s} {ms:.4f} ms {pct:5.1f} % copy bw  rel err {err:.1e}{flag}",
              flush=True)
        write_result(result, out_path)
    write_result(result, out_path)
    ok = [r for r in result["rows"] if r["status"] == "ok"]
    for r in sorted(ok, key=lambda r: r["ms"])[:5]:
        print(f"best: {r['label']:44s} {r['ms']:.4f} ms {r['pct_copy_bw']:5.1f} %")
    print(f"{time.perf_counter() - began:.0f} s; wrote {out_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
