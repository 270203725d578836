"""The CUDA decode kernels' build: ``nvcc`` found, ``decode.cu`` compiled to a cubin per
:class:`Build`, cached on disk.

``decode.cu`` includes the kernel family sources of this folder (``fp8_decode.cu``,
``int4_decode.cu``, ``int4_tma_decode.cu``, ``merge.cu``, their headers) as one translation
unit, so one cubin holds every entry point. A build is compiled once per source and settings:
the cubin is cached under ``~/.cache/paged_ref`` (or ``$PAGED_REF_CACHE``), named by a hash of
every source file of the folder, the architecture and the settings.

    cubin = compile_cubin("sm_90", Build(stages=4))   # a Path; no GPU needed
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

#: The translation unit every build compiles (it includes the family sources beside it).
SOURCE = Path(__file__).with_name("decode.cu")
#: Tiles in each warp's shared-memory ring when a plan is given no ``stages``
#: (:func:`~paged_ref.kernels.cuda.launch.default_stages` picks 2..5 by launch).
DEFAULT_STAGES = 3
# What the sources fix (common.cuh, int4_tma_decode.cu, merge.cu), as the host needs them:
TILE = 16  # tokens a tile
MAX_WARPS = 8  # per decode CTA (its launch bounds)
MAX_GROUP = 8  # query heads per KV head
MAX_MERGE_WARPS = 16  # warps of the merge kernel's CTA: one per chunk, at most this
TMA_HEADS = 8  # KV heads a CTA of the TMA-fed INT4 kernel
HEAD_DIMS = (64, 128, 256)  # the entry points' head_dim


@dataclass(frozen=True)
class Build:
    """The settings of one cubin: the three macros of ``common.cuh`` a plan chooses.

    stages:         tiles in each ring (``STAGES``; 2..8).
    warps_per_head: warps sharing one KV head's tiles of a chunk (``WARPS_PER_HEAD``:
                    1, 2 or 4, as :func:`~paged_ref.kernels.cuda.launch.default_launch` picks).
    small_blocks:   blocks of fewer than 16 tokens (``SMALL_BLOCKS=1``: a block-table entry per
                    token row instead of one per 16-token tile).
    """

    stages: int = DEFAULT_STAGES
    warps_per_head: int = 1
    small_blocks: bool = False

    def defines(self) -> tuple[str, ...]:
        """The ``-D`` defines nvcc gets: ``("STAGES=3", "WARPS_PER_HEAD=1", "SMALL_BLOCKS=0")``."""
        return (f"STAGES={self.stages}", f"WARPS_PER_HEAD={self.warps_per_head}",
                f"SMALL_BLOCKS={int(self.small_blocks)}")


def nvcc_path() -> str | None:
    """The nvcc to compile with: ``$CUDA_HOME/bin/nvcc``, else the one on PATH, else None."""
    home = os.environ.get("CUDA_HOME")
    if home and Path(home, "bin", "nvcc").exists():
        return str(Path(home, "bin", "nvcc"))
    return shutil.which("nvcc")


def cache_dir() -> Path:
    """Where cubins are kept: ``$PAGED_REF_CACHE``, else ``~/.cache/paged_ref``."""
    return Path(os.environ.get("PAGED_REF_CACHE", Path.home() / ".cache" / "paged_ref"))


def source_digest(source: Path) -> str:
    """16 hex digits of a hash over every ``.cu`` / ``.cuh`` file beside ``source`` (names and
    bytes): an edit to any header makes a new cubin."""
    digest = hashlib.sha256()
    for path in sorted(source.parent.glob("*.cu*")):
        if path.suffix in (".cu", ".cuh"):
            digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def compile_cubin(arch: str, build: Build | None = None, source: Path | None = None) -> Path:
    """The cubin of ``source`` (default :data:`SOURCE`) for ``arch`` (e.g. ``"sm_90"``) with
    ``build``'s settings (default ``Build()``), compiled on first use and cached (see the
    module docstring).

    Raises:
        RuntimeError: no nvcc, or nvcc failed (its last 4000 characters of errors).
    """
    source, build = Path(source or SOURCE), build or Build()
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("the CUDA decode kernels need nvcc (set CUDA_HOME or put it on PATH)")
    defines = build.defines()
    tag = "_".join(defines).replace("=", "")
    cubin = cache_dir() / f"decode_{source_digest(source)}_{arch}_{tag}.cubin"
    if not cubin.exists():
        cubin.parent.mkdir(parents=True, exist_ok=True)
        tmp = cubin.with_suffix(f".{os.getpid()}.tmp")  # (written whole, then renamed)
        cmd = [nvcc, "-cubin", f"-arch={arch}", "-O3", "-std=c++17",
               *[f"-D{d}" for d in defines], "-o", str(tmp), str(source)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
        tmp.replace(cubin)
    return cubin
