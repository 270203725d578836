"""``python -m paged_bench tiers``: a cached prefix back on the GPU from the disk tier, from the
host tier, or recomputed.

For a Llama-3.2-1B-shaped cache (16 layers, 8 KV heads, head_dim 64, bf16, blocks of 16
tokens: 32 KiB of K/V per token, 512 KiB per block) and prefixes of 512, 2k, 8k and 32k
tokens, through the library's own path (``KVCacheManager`` + ``PagedKVCache`` with
``num_host_blocks`` and a ``DiskTier``), rows per prefix (``case`` ``P<tokens>``):

* ``disk_cold``: ``add_sequence`` of a prompt whose prefix sits in the disk tier (its blocks
  read from the file into pinned memory on the tier's threads) + ``apply_block_ops`` (host ->
  GPU), after the file was flushed and its pages dropped (``fsync`` + ``posix_fadvise(fd, 0,
  0, POSIX_FADV_DONTNEED)``): the reads come from the disk, if the file system honours it;
* ``disk_warm``: the same right after the blocks were written (the OS page cache holds them);
* ``host``: the same with the prefix in the host tier (pinned memory -> GPU);
* ``recompute``: what a miss costs instead -- the prefix through 16 decoder layers with random
  bf16 weights (hidden 2048, 32 query heads, MLP 8192): per layer RMSNorm, the QKV projection,
  RoPE, the K/V write into the paged cache, causal ``paged_ref.paged_prefill`` attention, the
  output projection, RMSNorm, the SwiGLU MLP; no embedding lookup, no LM head;
* ``spill_to_disk``: the eviction step that moves the prefix down (GPU -> host -> ``pwrite``
  into the file: page-cache speed), and ``fsync``: flushing it to the disk.

Every prefix brought back is checked bit for bit against the K/V written; each timed call is
one wall-clock run (a GPU synchronised around it), the median of ``--reps``. JSON (``--out``,
default ``results/<gpu kind>/tiers.json``) is stamped with GPU, versions, commit and date, the
file system the disk file lived on (``/proc/mounts``) and the kernel. ``--quick``: a tiny
shape and prefixes of 64 / 256 tokens on whatever device there is (a CPU too): a check of the
suite, not a measurement. Without CUDA and without ``--quick`` it says so and exits with 2.
``--budget-s`` (90): a prefix whose run, scaled from the last one's, would end past it gets one
rep (on the H200 the whole run is expected to take about a minute; a slow disk costs more).
"""

from __future__ import annotations

import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from paged_bench.common import suite_parser
from paged_course.offload import kv_bytes, prefill_flops
from paged_course.results import environment, write_result
from paged_ref import KVCacheManager, PagedKVCache, paged_prefill
from paged_ref.memory.disk_tier import DiskTier

#: The Llama-3.2-1B shape (the keys of ``paged_course.offload``'s shapes).
LLAMA_1B = dict(num_layers=16, hidden=2048, num_q_heads=32, num_kv_heads=8, head_dim=64,
                intermediate=8192, block_size=16, dtype="bfloat16")
PREFIXES = (512, 2048, 8192, 32768)
#: ``--quick``: small enough for a CPU in a test.
QUICK_SHAPE = dict(num_layers=2, hidden=64, num_q_heads=4, num_kv_heads=2, head_dim=16,
                   intermediate=128, block_size=16, dtype="bfloat16")
QUICK_PREFIXES = (64, 256)
RECOMPUTE = ("the prefix through num_layers decoder layers with random bf16 weights: RMSNorm, "
             "QKV projection, RoPE, K/V write into the paged cache, causal paged_prefill, "
             "output projection, RMSNorm, SwiGLU MLP; no embedding lookup, no LM head")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def mount_of(path: str) -> dict:
    """The mount holding ``path`` (from ``/proc/mounts``: the longest matching mount point):
    ``{"mount": ..., "fs_type": ..., "source": ...}``, or ``{}`` where it cannot be read."""
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[:3] for line in f]
    except OSError:
        return {}
    real = os.path.realpath(path)
    found = [(p, t, s) for s, p, t in mounts if real == p or real.startswith(p.rstrip("/") + "/")]
    if not found:
        return {}
    point, fs_type, source = max(found, key=lambda m: len(m[0]))
    return {"mount": point, "fs_type": fs_type, "source": source}


class Tiers:
    """A pool that holds a ``prefix``-token prompt on the GPU, a host tier and (``disk``) a
    disk tier under a one-block host tier; it moves the prefix down and brings it back."""

    def __init__(self, shape: dict, prefix: int, device, folder, *, disk: bool, workers: int):
        bs, dtype = shape["block_size"], getattr(torch, shape["dtype"])
        self.blocks, self.device = prefix // bs, torch.device(device)
        num_blocks = self.blocks + 2  # the prefix, the prompt's last token, a filler
        host = 1 if disk else num_blocks
        geometry = (shape["num_layers"], bs, shape["num_kv_heads"], shape["head_dim"])
        self.disk = DiskTier(folder, num_blocks, (2, *geometry), dtype,
                             workers=workers) if disk else None
        self.m = KVCacheManager(num_blocks, bs, enable_prefix_caching=True,
                                num_host_blocks=host, disk_tier=self.disk)
        self.cache = PagedKVCache(geometry[0], num_blocks, *geometry[1:], dtype=dtype,
                                  device=device, num_host_blocks=host, disk_tier=self.disk)
        gen = torch.Generator().manual_seed(prefix)
        self.prompt = torch.randint(0, 128000, (prefix + 1,), generator=gen).tolist()
        self.filler = torch.randint(0, 128000, (bs + 1,), generator=gen).tolist()
        self.m.add_sequence("q", token_ids=self.prompt)  # held until spill()
        self.cache.apply_block_ops(self.m.take_block_ops())
        table = self.m.block_table("q")[: self.blocks]
        self.cache.kv[:, :, table] = torch.randn(self.cache.kv[:, :, table].shape,
                                                 dtype=dtype, device=device)
        self.expected = self.cache.kv[:, :, table].clone()

    def spill(self) -> float:
        """Free the prompt, then a filler (the most recent block: the host tier's one slot),
        and evict everything: the prefix goes down. Returns the eviction step's seconds."""
        self.m.free_sequence("q")
        self.m.add_sequence("filler", token_ids=self.filler)
        self.cache.apply_block_ops(self.m.take_block_ops())
        self.m.free_sequence("filler")
        sync(self.device)
        start = time.perf_counter()
        self.m.add_sequence("hog", self.m.num_free_blocks * self.m.block_size)
        self.cache.apply_block_ops(self.m.take_block_ops())
        sync(self.device)
        seconds = time.perf_counter() - start
        self.m.free_sequence("hog")
        st = self.m.stats()
        below = st.blocks_on_disk if self.disk else st.blocks_on_host
        assert below >= self.blocks, f"only {below} of {self.blocks} blocks went down"
        return seconds

    def bring_back(self) -> float:
        """Admit the prompt again: its prefix comes back; returns the seconds, checked."""
        sync(self.device)
        start = time.perf_counter()
        hit = self.m.add_sequence("q", token_ids=self.prompt)
        self.cache.apply_block_ops(self.m.take_block_ops())
        sync(self.device)
        seconds = time.perf_counter() - start
        assert hit == self.blocks * self.m.block_size, f"hit {hit} tokens"
        table = self.m.block_table("q")[: self.blocks]
        if not torch.equal(self.cache.kv[:, :, table], self.expected):
            raise AssertionError("the prefix came back with other K/V than were written")
        return seconds

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


class LayerStack:
    """Random bf16 weights of a Llama-shaped decoder stack (``shape``), and its prefill of a
    prompt into a paged cache (what recomputing a prefix costs)."""

    def __init__(self, shape: dict, device, seed: int = 0):
        self.shape, dtype = shape, getattr(torch, shape["dtype"])
        h, inter = shape["hidden"], shape["intermediate"]
        kv = shape["num_kv_heads"] * shape["head_dim"]
        gen = torch.Generator(device=device).manual_seed(seed)

        def weight(*size):
            return (torch.randn(size, generator=gen, device=device) * 0.02).to(dtype)

        self.layers = [(weight(h, h + 2 * kv), weight(h, h), weight(h, 2 * inter),
                        weight(inter, h)) for _ in range(shape["num_layers"])]

    def prefill(self, x: torch.Tensor, cache: PagedKVCache, manager: KVCacheManager):
        """``x`` ``[n, hidden]`` (bf16) through every layer; its K/V land in ``cache`` at the
        slots of ``manager``'s sequence ``"r"`` (``n`` tokens). Returns the hidden states."""
        s, n = self.shape, x.shape[0]
        hq, hkv, d = s["num_q_heads"], s["num_kv_heads"], s["head_dim"]
        slots = torch.tensor(manager.slot_mapping("r"), device=x.device)
        tables, lens = manager.batch_tables(["r"], device=x.device)
        starts = torch.tensor([0, n], dtype=torch.int32, device=x.device)
        inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device=x.device) / d)
        angles = torch.arange(n, device=x.device)[:, None] * inv[None]
        cos, sin = angles.cos()[:, None], angles.sin()[:, None]

        def rope(t):  # [n, heads, d], rotate halves
            a, b = t.float().chunk(2, dim=-1)
            return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1).to(t.dtype)

        def norm(t):
            t32 = t.float()
            return (t32 * torch.rsqrt(t32.pow(2).mean(-1, keepdim=True) + 1e-5)).to(t.dtype)

        for layer, (w_qkv, w_o, w_gate_up, w_down) in enumerate(self.layers):
            q, k, v = (norm(x) @ w_qkv).split([hq * d, hkv * d, hkv * d], dim=-1)
            k_cache, v_cache = cache.layer(layer)
            k_cache.flatten(0, 1)[slots] = rope(k.view(n, hkv, d))
            v_cache.flatten(0, 1)[slots] = v.view(n, hkv, d)
            o = paged_prefill(rope(q.view(n, hq, d)), k_cache, v_cache, tables, lens, starts)
            x = x + o.view(n, hq * d) @ w_o
            gate, up = (norm(x) @ w_gate_up).chunk(2, dim=-1)
            x = x + (torch.nn.functional.silu(gate) * up) @ w_down
        return x


def recompute_seconds(stack: LayerStack, prefix: int, device, reps: int) -> list[float]:
    """Wall-clock seconds of :meth:`LayerStack.prefill` of ``prefix`` tokens, ``reps`` runs
    after one warm-up (kernels compiled, memory allocated)."""
    s = stack.shape
    bs = s["block_size"]
    manager = KVCacheManager(prefix // bs + 1, bs)
    manager.add_sequence("r", prefix)
    cache = PagedKVCache(s["num_layers"], prefix // bs + 1, bs, s["num_kv_heads"], s["head_dim"],
                         dtype=getattr(torch, s["dtype"]), device=device)
    x = torch.randn(prefix, s["hidden"], device=device).to(cache.dtype)
    times = []
    for _ in range(reps + 1):
        sync(torch.device(device))
        start = time.perf_counter()
        stack.prefill(x, cache, manager)
        sync(torch.device(device))
        times.append(time.perf_counter() - start)
    return times[1:]


def row(case: str, backend: str, seconds: list[float], prefix: int, num_bytes: int | None,
        **extra) -> dict:
    ms = statistics.median(seconds) * 1e3
    out = {"case": case, "backend": backend, "label": backend, "ms": ms,
           "ms_all": [t * 1e3 for t in seconds], "reps": len(seconds), "prefix_tokens": prefix}
    if num_bytes is not None:
        out |= {"bytes": num_bytes, "gbps": num_bytes / ms / 1e6}
    return out | extra


def measure_prefix(shape, prefix, device, folder, reps, workers) -> list[dict]:
    """Every row of one prefix length."""
    case, num_bytes = f"P{prefix}", kv_bytes(prefix, shape)
    rows = []
    disk = Tiers(shape, prefix, device, folder, disk=True, workers=workers)
    try:
        cold, warm, spills, flushes = [], [], [], []
        for _ in range(reps):
            spills.append(disk.spill())
            start = time.perf_counter()
            disk.disk.drop_page_cache()
            flushes.append(time.perf_counter() - start)
            cold.append(disk.bring_back())
            spills.append(disk.spill())
            warm.append(disk.bring_back())
        rows += [row(case, "disk_cold", cold, prefix, num_bytes, check="bit-exact"),
                 row(case, "disk_warm", warm, prefix, num_bytes, check="bit-exact"),
                 row(case, "spill_to_disk", spills, prefix, num_bytes),
                 row(case, "fsync", flushes, prefix, num_bytes)]
    finally:
        disk.close()
    del disk
    host = Tiers(shape, prefix, device, folder, disk=False, workers=workers)
    times = []
    for _ in range(reps):
        host.spill()
        times.append(host.bring_back())
    rows.append(row(case, "host", times, prefix, num_bytes, check="bit-exact"))
    del host
    stack = LayerStack(shape, device)
    times = recompute_seconds(stack, prefix, device, reps)
    flops = prefill_flops(prefix, shape)
    rows.append(row(case, "recompute", times, prefix, None, prefill_tflop=flops / 1e12,
                    tflops=flops / statistics.median(times) / 1e12))
    del stack
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    recompute_ms = rows[-1]["ms"]
    for r in rows:
        if r["backend"] in ("disk_cold", "disk_warm", "host"):
            r["recompute_over_this"] = recompute_ms / r["ms"]
    return rows


def main(argv: list[str] | None = None) -> int:
    p = suite_parser("tiers", __doc__, out="tiers.json", out_help="JSON path")
    p.add_argument("--quick", action="store_true",
                   help="tiny shape, prefixes 64 and 256, any device (checks the suite)")
    p.add_argument("--prefixes", default=None, help="comma-separated prefix lengths (tokens)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--workers", type=int, default=8, help="the disk tier's read threads")
    p.add_argument("--budget-s", type=float, default=90.0,
                   help="when the next prefix, scaled from the last one's time, would end past "
                        "this many seconds, it runs 1 rep (its rows say how many)")
    p.add_argument("--disk-path", type=Path, default=None,
                   help="folder for the disk tier's file (default: a new one in the current "
                        "folder, removed after; not /tmp, which may live in memory)")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if not cuda and not args.quick:
        print("paged_bench tiers measures GPU copies and a prefill: it needs a CUDA GPU "
              "(--quick runs tiny sizes on a CPU to check the suite).")
        return 2
    shape = QUICK_SHAPE if args.quick else LLAMA_1B
    prefixes = ([int(x) for x in args.prefixes.split(",")] if args.prefixes
                else QUICK_PREFIXES if args.quick else PREFIXES)
    bad = [n for n in prefixes if n <= 0 or n % shape["block_size"]]
    if bad or not prefixes:
        p.error(f"--prefixes must be positive multiples of {shape['block_size']}: {bad}")
    device = "cuda" if cuda else "cpu"
    folder = Path(tempfile.mkdtemp(prefix="tiers-bench-", dir=args.disk_path or os.getcwd()))
    mount = mount_of(str(folder))
    result = {**environment(), "suite": "tiers", "quick": args.quick, "shape": shape,
              "kv_bytes_per_token": kv_bytes(1, shape), "recompute": RECOMPUTE,
              "disk": {"folder": str(folder), **mount, "kernel": platform.release(),
                       "workers": args.workers, "cold": "fsync + posix_fadvise(fd, 0, 0, "
                       "POSIX_FADV_DONTNEED) before each cold read"},
              "results": []}
    if mount.get("fs_type") in ("tmpfs", "ramfs"):
        print(f"note: {folder} is on {mount['fs_type']} (memory): the disk rows are not a disk")
    start, last = time.perf_counter(), None  # (prefix, seconds) of the last one measured
    try:
        for prefix in prefixes:
            elapsed = time.perf_counter() - start
            guess = 0.0 if last is None else last[1] * prefix / last[0]  # ~ bytes, FLOPs
            reps = args.reps if last is None or elapsed + guess <= args.budget_s else 1
            if reps < args.reps:
                print(f"P{prefix}: 1 rep (about {guess:.0f} s for {args.reps}, {elapsed:.0f} s "
                      f"of the {args.budget_s:.0f} s budget spent)")
            rows = measure_prefix(shape, prefix, device, folder, reps, args.workers)
            last = (prefix, (time.perf_counter() - start - elapsed) * args.reps / reps)
            result["results"] += rows
            result["seconds"] = time.perf_counter() - start
            write_result(result, args.out)
            for r in rows:
                rate = f"{r['gbps']:7.2f} GB/s" if "gbps" in r else f"{r['tflops']:7.1f} TFLOP/s"
                print(f"P{prefix:<6d} {r['backend']:14s} {r['ms']:10.2f} ms  {rate}")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    print(f"{result['gpu']}; disk file on {mount.get('fs_type', '?')} ({mount.get('source', '?')})"
          f"; {result['seconds']:.0f} s; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
