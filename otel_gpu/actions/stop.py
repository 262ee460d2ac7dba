"""Stopping the watched job: in-process graceful request first, else a signal to its trainers.

Opt-in only. The signal goes to PIDs the caller vouches for (the watched job's trainer
processes) and to nothing else: each PID is checked against a fresh ``allowed_pids()`` right
before sending, and PIDs 0, 1, negatives (process groups) and the agent's own PID are refused.
Where Linux pidfds exist the process is pinned before that check, so a PID recycled between
the check and the send cannot be hit.
"""

from __future__ import annotations

import logging
import os
import signal as _signal
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from otel_gpu.core.errors import UsageError
from otel_gpu.detect.model import Alert
from otel_gpu.sampling.procfs import read_stat

log = logging.getLogger("otel_gpu.actions")

# Signals a trainer can catch to checkpoint and stop (ms-swift's graceful_exit traps
# SIGTERM/SIGINT/SIGUSR1/SIGUSR2; transformers' jit checkpoint uses SIGTERM). SIGKILL and
# SIGSTOP are refused: they would lose the work the stop is meant to save.
ALLOWED_SIGNALS = ("SIGUSR1", "SIGUSR2", "SIGTERM", "SIGINT", "SIGHUP")


def parse_signal(name: str | int | _signal.Signals) -> _signal.Signals:
    """``"SIGTERM"``, ``"term"``, ``15`` or ``signal.SIGTERM`` -> ``signal.SIGTERM``."""
    accepted = ", ".join(ALLOWED_SIGNALS)
    try:
        if isinstance(name, int):
            sig = _signal.Signals(name)
        else:
            s = str(name).strip().upper()
            s = s if s.startswith("SIG") else "SIG" + s
            sig = _signal.Signals[s]
    except (KeyError, ValueError):
        raise UsageError(f"unknown stop signal {name!r}: use one of {accepted}") from None
    if sig.name not in ALLOWED_SIGNALS:
        raise UsageError(f"stop signal {sig.name} is not allowed: use one of {accepted}")
    return sig


@dataclass(frozen=True, slots=True)
class StopResult:
    """What a stop did: handled in-process, or which PIDs got the signal and which were refused."""

    requested: bool  # the in-process request_fn took it
    signalled: tuple[int, ...] = ()
    refused: tuple[
        int, ...
    ] = ()  # PIDs named but not signalled (unsafe, gone, or no longer allowed)


class JobStopper:
    """Asks the watched job to checkpoint and stop.

    ``allowed_pids`` returns the PIDs of the job's trainer processes (never a launcher that
    would orphan them). ``request_fn(reason)`` is the in-process graceful mechanism; it returns
    True when it took the request. ``not_the_jobs(alert)`` says why an alert is not the job's
    own problem (another tenant's memory on a shared GPU), or None when it is: such an alert
    stops nothing.
    """

    def __init__(
        self,
        allowed_pids: Callable[[], Iterable[int]],
        signal: str | int | _signal.Signals = "SIGUSR1",
        request_fn: Callable[[str], bool] | None = None,
        not_the_jobs: Callable[[Alert], str | None] | None = None,
    ) -> None:
        self._allowed = allowed_pids
        self.signal = parse_signal(signal)
        self._request_fn = request_fn
        self._not_the_jobs = not_the_jobs
        self._own_pid = os.getpid()

    def refusal(self, alert: Alert) -> str | None:
        """Why ``alert`` must not stop the job (None: it may). Never raises."""
        if self._not_the_jobs is None:
            return None
        try:
            return self._not_the_jobs(alert)
        except Exception as e:  # a bug here must not stop a job on a stranger's account
            return f"whose problem it is could not be told ({type(e).__name__})"

    def stop(self, reason: str) -> StopResult:
        """Request a graceful stop; falls back to the signal. Never raises."""
        if self._request_fn is not None:
            try:
                if self._request_fn(reason):
                    log.warning("asked the job to checkpoint and stop: %s", reason)
                    return StopResult(requested=True)
            except Exception as e:  # the job's mechanism must not break the agent
                log.warning(
                    "in-process stop request failed (%s); sending a signal", type(e).__name__
                )
        return self._signal_all(reason)

    def _safe(self, pid: object) -> bool:
        own = os.getpid()
        return (
            isinstance(pid, int)
            and not isinstance(pid, bool)
            and pid > 1
            and pid not in (own, self._own_pid)
        )

    def _current(self) -> set[int]:
        try:
            return {p for p in self._allowed() if self._safe(p)}
        except Exception as e:
            log.warning("could not list the job's processes (%s); no signal sent", type(e).__name__)
            return set()

    def _signal_all(self, reason: str) -> StopResult:
        try:
            named = list(self._allowed())
        except Exception as e:
            log.warning("could not list the job's processes (%s); no signal sent", type(e).__name__)
            return StopResult(requested=False)
        candidates = sorted({p for p in named if self._safe(p)})
        refused = {p for p in named if isinstance(p, int) and not self._safe(p)}
        # Pin each process first, then re-check membership: after this the PID cannot be
        # recycled to a stranger before the send.
        pinned: dict[int, int | None] = {}
        for pid in candidates:
            try:
                pinned[pid] = _pidfd_open(pid)
            except ProcessLookupError:
                refused.add(pid)  # already gone: its PID may belong to a stranger next
        candidates = [p for p in candidates if p in pinned]
        try:
            still = self._current()
            sent: list[int] = []
            for pid in candidates:
                if pid not in still:
                    refused.add(pid)
                    continue
                if _send(pid, pinned[pid], self.signal):
                    sent.append(pid)
                else:
                    refused.add(pid)
        finally:
            for fd in pinned.values():
                if fd is not None:
                    os.close(fd)
        if sent:
            log.warning("sent %s to the job's processes %s: %s", self.signal.name, sent, reason)
        else:
            log.warning("no job process to signal (%s not sent): %s", self.signal.name, reason)
        return StopResult(False, tuple(sent), tuple(sorted(refused)))


def start_ticks(pid: int, proc_root: str = "/proc") -> int | None:
    """The process's start time in clock ticks after boot (``/proc/PID/stat`` field 22), or
    None when it is gone. With the PID, an exact identity: a PID reused even within the same
    second by another process has a different value (a float start time compared with a
    tolerance would not tell them apart)."""
    st = read_stat(proc_root, pid)
    return None if st is None else st.starttime


def _pidfd_open(pid: int) -> int | None:
    """A pidfd for ``pid``; None where pidfds are unsupported. ProcessLookupError if gone."""
    opener = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return int(opener(pid))
    except ProcessLookupError:
        raise
    except OSError:
        return None  # kernel < 5.3 or a sandbox without pidfd_open: plain kill after the check


def _send(pid: int, fd: int | None, sig: _signal.Signals) -> bool:
    try:
        if fd is not None and hasattr(_signal, "pidfd_send_signal"):
            _signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
        return True
    except (ProcessLookupError, PermissionError, OSError):
        return False
