"""The wire between two ranks: every message of a transfer, each wait bounded by a timeout.

A :class:`Link` sends and receives the tensors of one transfer call through
``torch.distributed`` point-to-point operations (``isend`` / ``irecv`` and a ``wait``), and
turns whatever the backend raises -- the peer closed the connection (it died), nothing came
within ``timeout`` seconds -- into one :class:`TransferError` that names the peer and the phase.
After such an error the two ranks no longer agree on which message comes next: make a new
process group before the next transfer between them. (A *refusal* keeps them in step: both
sides know the call ended there.)

Control messages are two int64 words, ``(code, number)``: code :data:`OK` (0) or a reason from
:data:`REASONS`, and a number (the receiver's answer: tokens already cached).
"""

from __future__ import annotations

import math
from datetime import timedelta
from numbers import Real

import torch
import torch.distributed as dist

#: Seconds each wait of a transfer may take by default (a header, an answer, a message).
DEFAULT_TIMEOUT = 60.0

OK = 0
NO_ROOM, OTHER_SHAPE, SEQ_HELD, NO_PREFIX_CACHING, NOT_COMPUTED, OTHER_CALL, FAILED = range(1, 8)
#: Why a rank refused or gave up, by code (the code travels in the messages).
REASONS = {
    NO_ROOM: "it has no free blocks",
    OTHER_SHAPE: "its pool's shape differs",
    SEQ_HELD: "it holds that seq_id already",
    NO_PREFIX_CACHING: "its manager has prefix caching off",
    NOT_COMPUTED: "the prompt's blocks are not in its prefix cache (compute the prompt first)",
    OTHER_CALL: "it runs the other kind of call (send_sequence / recv_prefix, or "
                "send_prefix / recv_sequence, do not pair)",
    FAILED: "it failed (its own error says why)",
}


def reason(code: int) -> str:
    """The words for a code another rank sent (an unknown code says so)."""
    return REASONS.get(code, f"it sent the unknown code {code}")


class TransferError(RuntimeError):
    """A transfer broke off: the peer died, did not answer within the timeout, or failed
    half-way and said so. Nothing is held for the transfer on the rank that raises it.

    Attributes:
        peer: the other rank.
        phase: what this rank was doing ("waiting for the answer", "receiving the payload"...).
    """

    def __init__(self, message: str, *, peer: int, phase: str) -> None:
        super().__init__(message)
        self.peer = peer
        self.phase = phase


def check_timeout(timeout) -> float | None:
    """``timeout`` as a float > 0, or None (the process group's own timeout)."""
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, Real):
        raise TypeError(f"timeout must be a number of seconds or None, got "
                        f"{type(timeout).__name__}")
    if not (timeout > 0 and math.isfinite(timeout)):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout}")
    return float(timeout)


def _cause(error: BaseException, timeout: float | None) -> str:
    """What the backend's error means, in words."""
    text = str(error)
    if "Timed out" in text or "timed out" in text:
        return f"did not answer within {timeout:g} s" if timeout else "did not answer in time"
    if "closed" in text or "reset" in text or "Broken pipe" in text:
        return "closed the connection (did it die?)"
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"could not be reached ({type(error).__name__}: {first[:200]})"


class Link:
    """One transfer call's messages to and from rank ``peer``.

    Args:
        peer: the other rank (global rank, as ``torch.distributed`` takes it).
        group: the process group (None: the default one).
        device: where control messages live (the cache's device: NCCL needs CUDA tensors).
        timeout: seconds each wait may take (None: the group's timeout).
        call: the call and its subject, for messages ("recv_sequence('req')").

    Waits that the CPU needs (control messages; every message on a CPU) block for at most
    ``timeout``. On a GPU the payload's waits between messages only order the streams (no
    CPU stall, so the next gather still overlaps the send); the last one is bounded.
    """

    def __init__(self, peer: int, group, device: torch.device, timeout: float | None,
                 call: str) -> None:
        self.peer, self.group, self.device, self.call = peer, group, device, call
        self.timeout = timeout
        self._wait_for = timedelta(0) if timeout is None else timedelta(seconds=timeout)
        self._works: list = []  # in flight, by handle; dropped (None) once waited for
        self.broken = False

    # ---- messages ---------------------------------------------------------------------------

    def post_send(self, tensor: torch.Tensor, phase: str) -> int:
        """Start sending ``tensor``; a handle for :meth:`wait`."""
        return self._post(dist.isend, tensor, phase)

    def post_recv(self, tensor: torch.Tensor, phase: str) -> int:
        """Start receiving into ``tensor``; a handle for :meth:`wait`."""
        return self._post(dist.irecv, tensor, phase)

    def wait(self, handle: int, phase: str, *, bounded: bool = True) -> None:
        """Wait for the operation ``handle``: at most ``timeout`` seconds if ``bounded`` or the
        tensors are on a CPU; otherwise (a GPU payload message) only order the streams."""
        work, self._works[handle] = self._works[handle], None
        try:
            if bounded or self.device.type != "cuda":
                work.wait(self._wait_for)
            else:
                work.wait()
            return
        except Exception as e:  # noqa: BLE001 -- each backend raises its own error type
            error = e
        # NOTE: no frame may keep the work alive: a receive abandoned after a timeout must not
        # land in its tensor later (a pool block the caller gets back).
        del work
        self._fail(phase, error)

    def send(self, tensor: torch.Tensor, phase: str) -> None:
        self.wait(self.post_send(tensor, phase), phase)

    def recv(self, tensor: torch.Tensor, phase: str) -> None:
        self.wait(self.post_recv(tensor, phase), phase)

    def say(self, code: int, number: int = 0, *, phase: str) -> None:
        """Send a control message ``(code, number)``."""
        self.send(torch.tensor([code, number], dtype=torch.int64, device=self.device), phase)

    def hear(self, phase: str) -> tuple[int, int]:
        """Receive a control message: ``(code, number)``."""
        words = torch.empty(2, dtype=torch.int64, device=self.device)
        self.recv(words, phase)
        code, number = (int(x) for x in words.tolist())
        return code, number

    def words(self, values: list[int], phase: str) -> None:
        """Send a list of ints (a header, token ids) as one int64 message."""
        self.send(torch.tensor(values, dtype=torch.int64, device=self.device), phase)

    def hear_words(self, n: int, phase: str) -> list[int]:
        words = torch.empty(n, dtype=torch.int64, device=self.device)
        self.recv(words, phase)
        return [int(x) for x in words.tolist()]

    # ---- failure ----------------------------------------------------------------------------

    def abandon(self) -> None:
        """Drop every operation in flight (after a failure; see :meth:`wait`)."""
        self._works.clear()
        self.broken = True

    def _post(self, op, tensor: torch.Tensor, phase: str) -> int:
        try:
            work = op(tensor, self.peer, group=self.group)
        except Exception as e:  # noqa: BLE001 -- each backend raises its own error type
            self._fail(phase, e)
        self._works.append(work)
        return len(self._works) - 1

    def _fail(self, phase: str, error: BaseException):
        self.abandon()
        raise TransferError(
            f"{self.call}: rank {self.peer} {_cause(error, self.timeout)} while this rank was "
            f"{phase}. Nothing is held for this transfer here; the two ranks are out of step "
            "now: make a new process group before the next transfer between them.",
            peer=self.peer, phase=phase) from error
