"""This checkout's own Jupyter kernel, for Jupyter front-ends other than `make lab`.

    python tools/jupyter_kernel.py name       # paged-ref-<8 hex digits of this folder's path>
    python tools/jupyter_kernel.py install    # register it for this user (make install does)

`make lab` needs no registered kernel: the notebooks ask for the standard ``python3`` kernel,
and JupyterLab started from ``.venv`` runs it with ``.venv``'s Python, so each checkout's
notebooks use that checkout's ``paged_ref`` and ``exercises/``. VS Code or a Jupyter installed
elsewhere list kernels per user instead; each checkout registers one named after its own path
(display name "Python (paged-ref: <folder>)"), so two checkouts never share or repoint a kernel.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def kernel_name(root: Path = ROOT) -> str:
    """``paged-ref-`` and 8 hex digits of the checkout's absolute path."""
    digest = hashlib.sha1(str(root.resolve()).encode()).hexdigest()[:8]
    return f"paged-ref-{digest}"


def display_name(root: Path = ROOT) -> str:
    return f"Python (paged-ref: {root.resolve()})"


LEGACY_NAME = "paged-ref"  # one kernel for every checkout, as older versions registered it


def install() -> str:
    """Register this interpreter as this checkout's kernel (per user); return its folder.

    Also removes the old shared ``paged-ref`` kernel when it runs this checkout's Python (it
    was registered from here, and would be repointed by the next checkout's install).
    """
    from ipykernel.kernelspec import install as install_kernelspec
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    manager = KernelSpecManager()
    try:
        legacy = manager.get_kernel_spec(LEGACY_NAME)
        if Path(legacy.argv[0]).resolve() == Path(sys.executable).resolve():
            manager.remove_kernel_spec(LEGACY_NAME)
            print(f"removed the old shared kernel {LEGACY_NAME!r}")
    except (NoSuchKernel, OSError, IndexError):
        pass
    return install_kernelspec(user=True, kernel_name=kernel_name(), display_name=display_name())


def main(argv: list[str]) -> int:
    if argv == ["name"]:
        print(kernel_name())
    elif argv == ["install"]:
        print(f"Jupyter kernel {display_name()!r} ({kernel_name()}) in {install()}")
    else:
        print(__doc__)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
