"""Each checkout has its own Jupyter kernel name; the notebooks ask for the standard python3."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))
import jupyter_kernel  # noqa: E402

from tests.conftest import need  # noqa: E402


def test_two_checkouts_never_share_a_kernel_name(tmp_path):
    a, b = tmp_path / "course", tmp_path / "course-copy"
    assert jupyter_kernel.kernel_name(a) != jupyter_kernel.kernel_name(b)
    assert jupyter_kernel.kernel_name(a) == jupyter_kernel.kernel_name(a)
    assert jupyter_kernel.kernel_name(a).startswith("paged-ref-")
    assert str(a) in jupyter_kernel.display_name(a)


def test_python3_kernel_of_this_environment_runs_this_python():
    """What `make lab` starts for the notebooks: this venv's Python, not a registered one."""
    kernelspec = need("jupyter_client.kernelspec", "the lab extra (`make install`)")

    spec = kernelspec.KernelSpecManager().get_kernel_spec("python3")
    exe = spec.argv[0]
    assert exe in ("python", "python3", "{python}") or Path(exe).resolve() == Path(
        sys.executable).resolve(), f"python3 runs {exe}, not {sys.executable}"
