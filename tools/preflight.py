"""Is this machine ready for the course? Run it on every learner machine before a workshop.

    make preflight            # or: .venv/bin/python tools/preflight.py

Prints one line per check (ok / FAIL / note) and ends with READY or NOT READY and the reasons.
Exit code 0 when ready, 1 when not. Only the standard library is needed to start, so it also
explains what is missing on a machine where `make install` has not run or failed.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MIN_PYTHON = (3, 10)
MIN_FREE_GB = 2.0


class Report:
    def __init__(self) -> None:
        self.problems: list[str] = []

    def ok(self, what: str, detail: str = "") -> None:
        print(f"  ok    {what}{': ' + detail if detail else ''}")

    def note(self, what: str, detail: str) -> None:
        print(f"  note  {what}: {detail}")

    def fail(self, what: str, why: str) -> None:
        print(f"  FAIL  {what}: {why}")
        self.problems.append(f"{what}: {why}")


def check_python(r: Report) -> None:
    v = sys.version_info
    if v[:2] < MIN_PYTHON:
        r.fail("python", f"{v.major}.{v.minor} is too old; need >= 3.10")
    else:
        r.ok("python", f"{v.major}.{v.minor}.{v.micro} ({sys.executable})")
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        r.note("python", "not this checkout's .venv: run `make install` (or `make preflight`)")


def check_packages(r: Report) -> bool:
    """torch, numpy < 2.4, triton (Linux), matplotlib, ipywidgets, jupyterlab; False if unusable."""
    usable = True
    for name, why in (("torch", "run `make install`"), ("numpy", "run `make install`"),
                      ("matplotlib", "run `make install`"), ("ipywidgets", "run `make install`"),
                      ("jupyterlab", "the lab extra: `make install`")):
        try:
            module = importlib.import_module(name)
            r.ok(name, getattr(module, "__version__", "installed"))
        except Exception as err:  # noqa: BLE001 (any import failure is the answer)
            r.fail(name, f"cannot import ({type(err).__name__}: {err}); {why}")
            usable = usable and name not in ("torch", "numpy")
    try:
        import numpy

        major, minor = (int(x) for x in numpy.__version__.split(".")[:2])
        if (major, minor) >= (2, 4):
            r.fail("numpy", f"{numpy.__version__} breaks Triton 3.6's interpreter; need < 2.4 "
                   "(`make install` pins it)")
    except ImportError:
        pass
    if sys.platform.startswith("linux"):
        try:
            import paged_ref  # noqa: F401, I001  (first: TRITON_INTERPRET=1 without a GPU)
            import triton

            r.ok("triton", triton.__version__)
        except Exception as err:  # noqa: BLE001
            r.fail("triton", f"cannot import ({type(err).__name__}: {err}); run `make install`")
            usable = False
    else:
        r.note("triton", f"no Triton wheels for {sys.platform}: lessons 00-03 run fully, the "
               "kernel exercises of 04-05 need Linux (WSL2 on Windows, a container on macOS)")
    return usable


def check_paged_ref(r: Report) -> None:
    """paged_ref imports from this checkout and its reference answers a tiny decode step."""
    try:
        import torch

        import paged_ref
        from paged_course.testing import make_paged_inputs
    except Exception as err:  # noqa: BLE001
        r.fail("paged_ref", f"cannot import ({type(err).__name__}: {err}); run `make install`")
        return
    where = Path(paged_ref.__file__).resolve().parents[1]
    if where != ROOT:
        r.fail("paged_ref", f"imported from {where}, not this checkout {ROOT}: "
               "`make install` here (pip install -e .)")
        return
    inputs = make_paged_inputs([5, 17], num_q_heads=4, num_kv_heads=2, head_dim=16,
                               block_size=4, dtype=torch.float32, seed=0)
    start = time.perf_counter()
    out = paged_ref.paged_attention(inputs.q, inputs.k_cache, inputs.v_cache,
                                    inputs.block_tables, inputs.seq_lens, backend="torch")
    if not torch.isfinite(out).all():
        r.fail("paged_ref", "the torch reference returned non-finite values")
    else:
        r.ok("paged_ref", f"torch reference ran in {1000 * (time.perf_counter() - start):.0f} ms")


def check_triton_kernel(r: Report) -> None:
    """A tiny Triton kernel runs (interpreter on a CPU, compiled on a GPU) and is right."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import paged_ref  # noqa: F401, I001  (before triton)
        import torch
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 (already reported)
        return

    @triton.jit
    def add(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask)
                 + tl.load(y_ptr + offs, mask=mask), mask=mask)

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mode = "compiled on the GPU" if device == "cuda" else "in the interpreter"
    try:
        x = torch.rand(1000, device=device)
        y = torch.rand(1000, device=device)
        out = torch.empty_like(x)
        start = time.perf_counter()
        add[(triton.cdiv(1000, 256),)](x, y, out, 1000, BLOCK=256)
        seconds = time.perf_counter() - start
        if torch.equal(out, x + y):
            r.ok("triton kernel", f"ran {mode} in {seconds:.2f} s")
        else:
            r.fail("triton kernel", f"ran {mode} but gave wrong numbers")
    except Exception as err:  # noqa: BLE001
        r.fail("triton kernel", f"failed {mode}: {type(err).__name__}: {err}")


def check_jupyter(r: Report) -> None:
    """JupyterLab from this Python runs the notebooks' ``python3`` kernel with this Python."""
    try:
        from jupyter_client.kernelspec import KernelSpecManager
    except ImportError:
        r.fail("jupyter kernel", "jupyter_client missing: run `make install`")
        return
    try:
        spec = KernelSpecManager().get_kernel_spec("python3")
    except Exception as err:  # noqa: BLE001
        r.fail("jupyter kernel", f"no python3 kernel ({err}): run `make install`")
        return
    exe = spec.argv[0]
    same = exe in ("python", "python3", "{python}") or Path(exe).resolve() == Path(
        sys.executable).resolve()
    if same:
        r.ok("jupyter kernel", f"python3 runs {sys.executable} under `make lab`")
    else:
        r.fail("jupyter kernel", f"python3 is redirected to {exe} (by {spec.resource_dir}); "
               "remove that kernelspec or set JUPYTER_PREFER_ENV_PATH=1")


def check_disk_and_cpu(r: Report) -> None:
    free_gb = shutil.disk_usage(ROOT).free / 1e9
    if free_gb < MIN_FREE_GB:
        r.fail("disk", f"{free_gb:.1f} GB free next to the course; need {MIN_FREE_GB} GB")
    else:
        r.ok("disk", f"{free_gb:.0f} GB free")
    cores = os.cpu_count() or 1
    r.ok("cpu", f"{cores} cores") if cores >= 2 else r.note("cpu", "1 core: lessons run slowly")


def check_gpu(r: Report) -> None:
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        r.ok("gpu", f"{torch.cuda.get_device_name(0)}: kernels compile, timing cells run")
    else:
        r.note("gpu", "none: Triton runs in its interpreter (slow, fine for the lessons); "
               "timing cells show the committed H200 results")


def main() -> int:
    print(f"Pre-flight for the paged attention course in {ROOT}")
    r = Report()
    check_python(r)
    if check_packages(r):
        check_paged_ref(r)
        check_triton_kernel(r)
    check_jupyter(r)
    check_disk_and_cpu(r)
    check_gpu(r)
    if r.problems:
        print("NOT READY:\n" + "\n".join(f"  - {p}" for p in r.problems))
        return 1
    print("READY: `make lab` opens lesson 00.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
