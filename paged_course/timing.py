"""Timers, in one place for the benchmark, the tuning script and the notebooks.

On a GPU (:func:`gpu_timing_available`):

* :func:`time_ms`: median milliseconds of a call, ``triton.testing.do_bench`` (warm-up, the L2
  flushed before each run, CUDA events); what every GPU number of the course is;
* :func:`clean_l2_ms`: the same with a flush that leaves the L2 *clean* (do_bench's leaves it
  full of dirty lines, whose write-back a kernel that only reads then pays for);
* :func:`graph_ms`: the same call replayed from a CUDA graph (no Python launch cost);
* :func:`events_ms`: median milliseconds of a call timed with CUDA events, with one's own
  step (an L2 flush of another kind, or none) before each call; for the probes in tools/gpu;
* :func:`cpu_us_per_call`: host microseconds per call (the Python launch path);
* :func:`copy_bandwidth_gbps`: the device-to-device copy bandwidth, the practical ceiling;
* :func:`matmul_tflops`: the dense bf16 matmul rate, the compute ceiling;
* :func:`print_timings`: time a few labelled calls that move the same bytes, print ms and GB/s.

Anywhere: :func:`wall_ms`, the median wall-clock time of a call (what a CPU lesson can
measure; in Triton's interpreter it measures Python, not a kernel), and :func:`median_ms`,
:func:`time_ms` where there is a GPU and :func:`wall_ms` elsewhere (a tool's smoke run).
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable

import torch

from paged_ref import _device


def gpu_timing_available() -> bool:
    """True on a CUDA GPU with compiled Triton kernels (not the interpreter)."""
    return torch.cuda.is_available() and not _device.INTERPRET


def time_ms(fn: Callable[[], object]) -> float:
    """Median milliseconds of ``fn`` (triton's do_bench: warm-up, L2 flush, CUDA events)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def events_ms(fn: Callable[[], object], before: Callable[[], object] | None = None,
              reps: int = 100, warmup: int = 10) -> float:
    """Median milliseconds of ``fn`` timed with CUDA events, ``before()`` (not timed) ahead of
    each call: ``time_ms`` with a flush of the caller's choosing, or back to back (``None``).
    The first ``warmup`` calls are not counted. All calls are queued before waiting for any
    (as do_bench does): waiting after each call would leave the GPU idle between a call's
    start event and its kernels while Python launches them, and count that too."""
    events = []
    for _ in range(warmup + reps):
        if before is not None:
            before()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        events.append((start, end))
    events[-1][1].synchronize()  # (the stream's last event: every call has finished)
    return sorted(start.elapsed_time(end) for start, end in events[warmup:])[reps // 2]


FLUSH_BYTES = 256 * 2**20  #: what do_bench zeroes before each call (more than any GPU's L2)


@functools.cache
def _flush_buffer(device: int) -> torch.Tensor:
    return torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=f"cuda:{device}")


def read_flush() -> None:
    """Evict the L2 by *reading* 256 MB (``torch.amax`` of a buffer): the L2 is left holding
    clean lines, which a later kernel's reads can replace without writing anything back."""
    torch.amax(_flush_buffer(torch.cuda.current_device()))


def zero_flush() -> None:
    """Evict the L2 as do_bench does, by zeroing 256 MB: the L2 is left full of dirty lines."""
    _flush_buffer(torch.cuda.current_device()).zero_()


def clean_l2_ms(fn: Callable[[], object], warmup_ms: float = 25, rep_ms: float = 200) -> float:
    """Median milliseconds of ``fn`` after :func:`read_flush` before each call (CUDA events,
    :func:`events_ms`; as many calls as do_bench makes: ``warmup_ms`` of warm-up, then
    ``rep_ms`` of timed calls), where :func:`time_ms` zeroes 256 MB. Zeroing leaves the L2 full of
    dirty lines, and a kernel that only reads (decode attention) pays for writing an L2's
    worth of them back while it streams: 6-9 us on the H200
    (``results/h200/short_calls_study.json``, part ``clean_l2``), a tenth of an INT4 decode step of
    300 MB. A copy pays 3-4 us (its own writes stay dirty in the L2, for the next flush to
    write back). In a serving step the L2 holds few dirty lines (a step's activations are
    small), so this is the nearer measure of what decode costs there."""
    estimate = events_ms(fn, read_flush, reps=5, warmup=1)
    return events_ms(fn, read_flush, reps=max(100, int(rep_ms / estimate)),
                     warmup=max(10, int(warmup_ms / estimate)))


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
    """Host microseconds per call of ``fn`` (the Python launch path), GPU work not awaited.
    One call first, so compilation and caches are out of the way."""
    fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - start
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def warm_up_gpu(seconds: float = 0.3) -> None:
    """Keep the GPU busy for a moment (large copies) so its clocks are up before timing."""
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


def matmul_tflops(n: int = 8192, device: str = "cuda") -> float:
    """Dense bf16 matmul rate in TFLOP/s (``2 n^3`` FLOPs over the :func:`median_ms` of
    ``a @ b``, after a GPU warm-up): the compute ceiling of the roofline."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
    if torch.device(device).type == "cuda":
        warm_up_gpu()
    return 2 * n**3 / (median_ms(lambda: a @ b) * 1e-3) / 1e12


def gbps(num_bytes: int, ms: float) -> float:
    """Bytes per millisecond as GB/s (1e9 bytes per second)."""
    return num_bytes / (ms * 1e-3) / 1e9


def wall_ms(fn: Callable[[], object], repeat: int = 5) -> float:
    """Median wall-clock milliseconds of ``fn`` over ``repeat`` calls (waits for a GPU)."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def median_ms(fn: Callable[[], object]) -> float:
    """:func:`time_ms` on a GPU (:func:`gpu_timing_available`), else :func:`wall_ms`: for tools
    that also run a smoke test on a CPU."""
    return time_ms(fn) if gpu_timing_available() else wall_ms(fn)


def print_timings(runs: dict[str, Callable[[], object]], num_bytes: int) -> dict[str, float]:
    """Time each labelled call with :func:`time_ms` and print ms and ``num_bytes / time``.

    A call that fails (e.g. a backend this GPU lacks) prints its error and is left out of
    the returned ``{label: ms}``.
    """
    width = max(map(len, runs), default=0)
    print(f"{'':{width}s} {'ms':>8s} {'bytes / time':>14s}")
    measured = {}
    for label, fn in runs.items():
        try:
            measured[label] = ms = time_ms(fn)
        except Exception as err:
            print(f"{label:{width}s} failed: {type(err).__name__}: {str(err)[:80]}")
            continue
        finally:
            torch.cuda.empty_cache()
        print(f"{label:{width}s} {ms:8.3f} {gbps(num_bytes, ms):9.0f} GB/s")
    return measured


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
