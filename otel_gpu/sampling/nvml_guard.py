"""One dedicated thread for NVML calls, and a caller that never waits on it for long.

NVML calls can hang (a GPU falling off the bus, a wedged driver). The sampler hands a whole
sweep to :class:`CallGuard`, which runs it on its own daemon thread; every NVML call inside the
sweep stamps its start through :meth:`CallGuard.enter`. The caller waits until the sweep ends,
until the current call passes its deadline, or until the sweep's budget is spent, whichever
comes first; then it takes what the sweep has gathered so far. The sweep learns at its next
call that it was abandoned and stops, so calls never pile up behind a hung one: while the
thread is still stuck, :meth:`run` refuses new work at once.

One hand-off per sweep (not per call) keeps the cost at a few microseconds per sweep.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Hashable

log = logging.getLogger("otel_gpu.nvml")


class Abandoned(BaseException):
    """Raised inside a sweep whose caller stopped waiting; ends the sweep quietly.

    A ``BaseException`` so that ``except Exception`` blocks in sweep code never swallow it.
    """


class CallGuard:
    """Runs jobs on one daemon thread with a per-call deadline and a per-job budget."""

    def __init__(self, call_timeout_s: float, budget_s: float, name: str = "otel-gpu-nvml"):
        if call_timeout_s <= 0 or budget_s <= 0:
            raise ValueError("call_timeout_s and budget_s must be > 0")
        self.call_timeout_s = call_timeout_s
        self.budget_s = budget_s
        self._name = name
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._busy = False
        self._abandon = False
        self._call_started: float | None = None  # time.monotonic() of the call in flight
        self._call_key: Hashable = None  # what the call in flight reads (for reports)
        self.hung_key: Hashable = None  # key of the call that overran, while it is stuck

    @property
    def busy(self) -> bool:
        """True while a job (possibly an abandoned, stuck one) still runs."""
        return self._busy

    # -- worker side -------------------------------------------------------------------------

    def enter(self, key: Hashable) -> None:
        """Called by the job before each NVML call: stops an abandoned job, stamps the start."""
        if self._abandon:
            raise Abandoned
        self._call_key = key
        self._call_started = time.monotonic()

    def leave(self) -> None:
        """Called by the job after each NVML call; a late result of an abandoned job is dropped."""
        self._call_started = None
        if self._abandon:
            raise Abandoned

    def _loop(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            job()

    # -- caller side -------------------------------------------------------------------------

    def run(self, job: Callable[[], None]) -> bool:
        """Run ``job`` on the NVML thread; True when it finished, False when it was abandoned
        (or refused because an earlier job is still stuck). Returns within ``budget_s``."""
        if self._busy:
            return False
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
            self._thread.start()
        done = threading.Event()

        def wrapped() -> None:
            try:
                job()
            except Abandoned:
                pass
            except BaseException:  # a bug in a sweep must not kill the NVML thread
                log.exception("NVML sweep failed")
            finally:
                self._call_started = None
                self.hung_key = None
                self._busy = False  # before done is set: the caller may submit right away
                done.set()

        self._abandon = False
        self._busy = True
        self._jobs.put(wrapped)
        now = time.monotonic()
        budget_end = now + self.budget_s
        while True:
            started = self._call_started
            call_end = (started if started is not None else now) + self.call_timeout_s
            if done.wait(max(0.0, min(call_end, budget_end) - now)):
                return True
            now = time.monotonic()
            started = self._call_started
            overran = started is not None and now - started >= self.call_timeout_s
            if overran or now >= budget_end:
                self._abandon = True
                if done.is_set():  # finished in the meantime after all
                    return True
                self.hung_key = self._call_key if started is not None else None
                return False

    def stuck_seconds(self) -> float:
        """How long the call of an abandoned, still running job has run (0: nothing stuck)."""
        started = self._call_started
        if not (self._busy and self._abandon) or started is None:
            return 0.0
        return max(0.0, time.monotonic() - started)

    def stop(self) -> None:
        """Let the thread exit after its current job (it is a daemon: a stuck call never blocks
        interpreter exit)."""
        self._abandon = True
        if self._thread is not None:
            self._jobs.put(None)
