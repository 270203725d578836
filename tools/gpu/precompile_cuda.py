"""Compile the CUDA decode kernels' cubins for sm_90 here (nvcc, no GPU needed) so that a GPU
call spends its minutes running, not compiling (each build takes ~10-40 s): every build a plan
or a GPU test asks for (``paged_ref.kernels.cuda.Build``: ring stages x warps per head 1, 2, 4
x blocks of >= 16 tokens or fewer), and with ``--mutants`` the planted mistakes of
``tests/kernels/cuda/test_decode_gpu.py``. Carry the folder (compressed: a device call carries
at most 64 MiB) and point ``PAGED_REF_CACHE`` at it:

    PAGED_REF_CACHE=$PWD/build/cubins python tools/gpu/precompile_cuda.py --mutants
    tar -C build -cJf build/cubins.tar.xz cubins   # ~100 MB of cubins -> a few MB to carry
    # then, on the GPU machine (carry build/cubins.tar.xz): tar -C build -xJf build/cubins.tar.xz
    # and PAGED_REF_CACHE=$PWD/build/cubins ...

Cubins are named by a hash of the sources: after any edit under ``paged_ref/kernels/cuda/``
run this again (old cubins are simply never asked for).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from paged_course import ROOT
from paged_ref.kernels.cuda import build

GPU_TESTS = ROOT / "tests" / "kernels" / "cuda" / "test_decode_gpu.py"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--mutants", action="store_true", help="also the tests' planted mistakes")
    parser.add_argument("--stages", default="2,3,4,5",
                        help="ring stages (2, 3: the per-warp rings; 4, 5: the TMA-fed INT4 "
                             "ring, 5 for launches of at most one CTA per SM)")
    args = parser.parse_args()
    stages = [int(n) for n in args.stages.split(",")]
    jobs = [(build.Build(n, warps, small), None) for n in stages for warps in (1, 2, 4)
            for small in (False, True)]
    if args.mutants:
        sys.path.insert(0, str(ROOT))  # (the tests import tests.mutations)
        spec = importlib.util.spec_from_file_location("gpu_tests", GPU_TESTS)
        tests = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tests)  # (its GPU tests skip themselves; only MUTANTS is read)
        folder = Path(tempfile.mkdtemp())
        for i, name in enumerate(tests.MUTANTS):  # (the mutant tests' plans: one warp a head)
            source = tests.mutant_source(name, folder / f"mutant{i}")
            jobs += [(build.Build(n), source) for n in stages]
    with ThreadPoolExecutor(2) as pool:
        for cubin in pool.map(lambda job: build.compile_cubin(args.arch, *job), jobs):
            print(cubin)


if __name__ == "__main__":
    main()
