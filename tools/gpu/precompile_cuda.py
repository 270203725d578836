"""Compile the CUDA decode kernels' cubins for sm_90 here (nvcc, no GPU needed) so that a GPU
call spends its minutes running, not compiling (each build takes ~10 s): the default build,
the ``WARPS_PER_HEAD`` variants the tests and the probe use (each also for blocks of fewer
than 16 tokens, ``SMALL_BLOCKS=1``), each also with the ``--defines`` a probe will ask for,
and with ``--mutants`` the planted mistakes of ``tests/test_gpu_cuda_fp8.py``. Carry the
folder (compressed: a device call carries at most 64 MiB) and point ``PAGED_REF_CACHE`` at it:

    PAGED_REF_CACHE=$PWD/build/cubins python tools/gpu/precompile_cuda.py --mutants
    tar -C build -cJf build/cubins.tar.xz cubins   # ~100 MB of cubins -> ~2 MB to carry
    # then, on the GPU machine (carry build/cubins.tar.xz): tar -C build -xJf build/cubins.tar.xz
    # and PAGED_REF_CACHE=$PWD/build/cubins ...
"""

from __future__ import annotations

import argparse
import importlib.util
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from paged_course import ROOT
from paged_ref.kernels import cuda_fp8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="sm_90")
    parser.add_argument("--mutants", action="store_true", help="also the tests' planted mistakes")
    parser.add_argument("--stages", default="2,3,4,5",
                        help="ring stages (2, 3: the per-warp rings; 4, 5: the TMA-fed INT4 "
                             "ring, 5 for launches of at most one CTA per SM)")
    parser.add_argument("--read-probe", action="store_true",
                        help="also tools/gpu/read_probe.cu and int4_read_probe.cu")
    parser.add_argument("--defines", default="",
                        help="more macro sets, spelled as the probe's DEFINES: ',A=0+B=1'")
    args = parser.parse_args()
    extra = [tuple(d.split("+")) if d else () for d in args.defines.split(",")]
    jobs = [(int(n), (*x, *d, *small), None) for n in args.stages.split(",") for x in extra
            for d in ((), ("WARPS_PER_HEAD=2",), ("WARPS_PER_HEAD=4",), ("INT4_TMA=0",))
            for small in ((), ("SMALL_BLOCKS=1",))]  # (plan_cuda_for's order of defines)
    if args.mutants:
        spec = importlib.util.spec_from_file_location(
            "gpu_tests", ROOT / "tests" / "test_gpu_cuda_fp8.py")
        tests = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tests)  # (its GPU tests skip themselves; only MUTANTS is read)
        text, folder = cuda_fp8.SOURCE.read_text(), Path(tempfile.mkdtemp())
        for i, (name, (old, new)) in enumerate(tests.MUTANTS.items()):
            source = folder / f"mutant{i}.cu"
            source.write_text(text.replace(old, new))
            jobs += [(int(n), tests.mutant_defines(name), source)
                     for n in args.stages.split(",")]
    if args.read_probe:
        jobs += [(cuda_fp8.DEFAULT_STAGES, (), ROOT / "tools" / "gpu" / probe)
                 for probe in ("read_probe.cu", "int4_read_probe.cu")]
    with ThreadPoolExecutor(2) as pool:
        for cubin in pool.map(lambda j: cuda_fp8.compile_cubin(args.arch, *j), jobs):
            print(cubin)


if __name__ == "__main__":
    main()
