"""Run a probe script where a crash cannot take the checking process (a notebook's kernel)
down with it, and fast.

Some checks plant a trap that a wrong Triton kernel falls into by crashing: an address that
only 64-bit arithmetic reaches, a table row next to an unreadable page. In Triton's CPU
interpreter the wrong kernel reads real memory and the process dies (SIGSEGV), so the probe
runs in a process of its own. A fresh interpreter costs seconds (importing torch, triton and
paged_ref again), several times the check itself; a fork of this process, which has them
imported already, costs a fraction of that. So:

- on Linux, with Triton on the CPU and CUDA untouched, the probe runs in a fork;
- elsewhere (a GPU: CUDA does not survive a fork), or if the fork does not finish in
  ``fork_timeout`` seconds, it runs in a fresh ``python``, as before.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path


def can_fork() -> bool:
    """True where a fork is safe and worth it: Linux, Triton on the CPU, CUDA not started."""
    if not sys.platform.startswith("linux") or not hasattr(os, "fork"):
        return False
    import torch

    from paged_ref import _device

    return _device.triton_device() == "cpu" and not torch.cuda.is_initialized()


def _child(script: Path, out_fd: int) -> None:
    """In the fork: run ``script`` as ``__main__`` with its output in ``out_fd``; never
    returns (``os._exit``: the parent's atexit handlers, sockets and files stay untouched)."""
    code = 1
    try:
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        sys.stdout = sys.stderr = open(out_fd, "w", buffering=1, closefd=False)  # noqa: SIM115
        # A crash's report goes with the output, not to the parent's terminal (pytest points
        # faulthandler at its own copy of stderr).
        faulthandler.enable(file=sys.stderr)
        import torch

        torch.set_num_threads(1)  # NOTE: a forked OpenMP pool is not usable; one thread is
        env = {"__name__": "__main__", "__file__": str(script), "__builtins__": __builtins__}
        exec(compile(script.read_text(), str(script), "exec"), env)  # noqa: S102
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 (reported through the output, as a fresh python would)
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
        finally:
            os._exit(code)


def _in_fork(script: Path, cwd: Path, timeout: float) -> tuple[int, str] | None:
    """(exit status, output) of ``script`` run in a fork, or None if it did not finish."""
    with tempfile.TemporaryFile() as out:
        with warnings.catch_warnings():  # Python >= 3.12 warns about forking with threads
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            os.chdir(cwd)
            _child(script, out.fileno())
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return None
            time.sleep(0.005)
        out.seek(0)
        return os.waitstatus_to_exitcode(status), out.read().decode(errors="replace")


def run_script(script: Path, cwd: Path, *, timeout: float = 300,
               fork_timeout: float = 30) -> tuple[int, str]:
    """Run the Python file ``script`` in a process of its own; return (exit status, stdout
    and stderr). A crash gives minus the signal's number (-11 for SIGSEGV), as
    :mod:`subprocess` does."""
    if can_fork():
        result = _in_fork(script, cwd, fork_timeout)
        if result is not None:
            return result
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          cwd=cwd, timeout=timeout)
    return proc.returncode, proc.stdout + proc.stderr
