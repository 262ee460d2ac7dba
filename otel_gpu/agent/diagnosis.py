"""Alerts wait for their diagnosis (bounded), then go on to the breaker's actions and the
outputs with it attached (docs/inprocess.md).

The engine and the breaker judge as always, on the sampler thread and in data time, so a
replay (``analyze``, ``report``) sees the same alerts and transitions. What waits is only
what a person reads: the alert listeners (view, summary, recording) and the transitions the
alert caused, which reach the dispatcher (log record, span event, notifications, stop) with
``alert.diagnosis`` set. A diagnosis runs on a worker thread (never the sampler's, never the
job's); an alert is released at the first sweep after its diagnosis is done, or after
``timeout_s`` with ``Diagnosis.error`` saying so. Later transitions of the same subject wait
behind it, so their order is kept.

A diagnoser is registered per alert kind: ``diagnose(alert) -> Diagnosis | None`` (None: nothing
to say). It must bound its own work (reads of other processes, subprocesses) and never raise
into the job; an exception becomes the diagnosis's ``error``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from otel_gpu.detect.breaker import Transition
from otel_gpu.detect.model import Alert, Diagnosis

log = logging.getLogger("otel_gpu.agent")

Diagnose = Callable[[Alert], Diagnosis | None]

MAX_PENDING = 64  # alerts waiting at once; more are released undiagnosed (said so)
MAX_LINES = 20  # lines kept per diagnosis
MAX_LINE = 300  # characters per line


@dataclass
class _Held:
    alert: Alert
    future: Future[Diagnosis | None] | None
    deadline: float
    started: float
    transitions: list[Transition] = field(default_factory=list)


class DiagnosisQueue:
    """Holds diagnosed kinds' alerts and their subject's transitions until released."""

    def __init__(
        self,
        diagnosers: Mapping[str, Diagnose],
        timeout_s: float = 15.0,
        *,
        clock: Callable[[], float] = time.monotonic,
        executor: ThreadPoolExecutor | None = None,
    ) -> None:
        self._diagnosers = dict(diagnosers)
        self._takes: dict[str, Callable[[Alert], bool]] = {}
        self.timeout_s = timeout_s
        self._clock = clock
        self._executor = executor or ThreadPoolExecutor(2, thread_name_prefix="otel-gpu-diagnose")
        self._held: deque[_Held] = deque()
        # The sampler thread feeds and releases; close() (on a shutdown thread) releases too.
        self._lock = threading.Lock()

    def register(
        self, kind: str, diagnose: Diagnose, takes: Callable[[Alert], bool] | None = None
    ) -> None:
        """Diagnose ``kind``'s alerts (only those ``takes`` accepts, when given): one queue for
        every concern (leaks, stalls), so their alerts keep one order."""
        self._diagnosers[kind] = diagnose
        if takes is not None:
            self._takes[kind] = takes

    def takes(self, alert: Alert) -> bool:
        if alert.kind not in self._diagnosers:
            return False
        accepts = self._takes.get(alert.kind)
        return accepts is None or accepts(alert)

    def holds(self, subject: str) -> bool:
        with self._lock:
            return any(h.alert.subject == subject for h in self._held)

    def submit(self, alert: Alert, transitions: list[Transition]) -> None:
        """Start diagnosing ``alert``; it and ``transitions`` wait for :meth:`release`."""
        now = self._clock()
        future: Future[Diagnosis | None] | None = None
        if len(self._held) < MAX_PENDING:
            try:
                future = self._executor.submit(self._diagnosers[alert.kind], alert)
            except RuntimeError:  # shut down: closing
                future = None
        with self._lock:
            self._held.append(_Held(alert, future, now + self.timeout_s, now, list(transitions)))

    def hold(self, t: Transition) -> bool:
        """Keep ``t`` behind its subject's held alert; False when none is held."""
        with self._lock:
            for h in reversed(self._held):
                if h.alert.subject == t.subject:
                    h.transitions.append(t)
                    return True
        return False

    def release(self, *, force: bool = False) -> list[tuple[Alert, list[Transition]]]:
        """The held alerts whose diagnosis is done or timed out (all of them with ``force``),
        oldest first, each with its diagnosis attached and its transitions."""
        now = self._clock()
        out: list[tuple[Alert, list[Transition]]] = []
        while True:
            with self._lock:
                if not self._held:
                    break
                h = self._held[0]
                done = h.future is not None and h.future.done()
                if not (done or force or now >= h.deadline or h.future is None):
                    break  # in order: a later alert never overtakes an earlier one
                self._held.popleft()
            alert = dataclasses.replace(h.alert, diagnosis=self._result(h, now))
            moved = [
                dataclasses.replace(t, alert=alert) if t.alert is h.alert else t
                for t in h.transitions
            ]
            out.append((alert, moved))
        return out

    def _result(self, h: _Held, now: float) -> Diagnosis:
        kind = h.alert.kind
        if h.future is None:
            return Diagnosis(kind, (), error=f"not diagnosed: over {MAX_PENDING} alerts at once")
        if not h.future.done():
            h.future.cancel()
            return Diagnosis(
                kind, (), took_s=now - h.started, error=f"diagnosis took over {self.timeout_s:g} s"
            )
        try:
            found = h.future.result()
        except Exception as exc:  # the diagnoser's bug is this alert's note, nothing more
            log.debug("diagnosis of %s failed", h.alert.subject, exc_info=True)
            return Diagnosis(kind, (), took_s=now - h.started, error=f"diagnosis failed: {exc}")
        if found is None:
            return Diagnosis(kind, (), took_s=now - h.started, error="nothing found")
        lines = tuple(line[:MAX_LINE] for line in found.lines[:MAX_LINES])
        took = found.took_s if found.took_s is not None else now - h.started
        return dataclasses.replace(found, lines=lines, took_s=took)

    def close(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
