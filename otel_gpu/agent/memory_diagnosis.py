"""Leak alerts carry where the memory is held (issue 20 §4, docs/inprocess.md).

The diagnoser of ``leak`` alerts on the watchdog's :class:`~otel_gpu.agent.diagnosis.
DiagnosisQueue`: it asks the subject's process (``process:<pid>@<gpu>``, ``rss:<pid>``) over
its control channel for the growth of its live tensors by holder (``memory.census``), since
the census taken when the leak was first *suspected* (``baseline: "last"``) and over a few
seconds more. The top growing holders become the alert's diagnosis: one line each (notifiers
show three), and the holders as data (``--summary-json``).

On a suspicion (``Engine.suspected``) the same process is asked for that baseline census,
once per suspicion, on the diagnosis worker thread (never the sampler's, never the job's).
A subject that is a whole GPU, or a process without the in-process part, gets no diagnosis
(its error says why). Tensor values are never read; every string is redacted where it leaves.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from otel_gpu.agent.diagnosis import DiagnosisQueue
from otel_gpu.core.channel import ChannelError, process_socket, request
from otel_gpu.core.redact import redact_text
from otel_gpu.detect.engine import Engine
from otel_gpu.detect.model import LEAK, Alert, Diagnosis, Point
from otel_gpu.diagnose import memory

log = logging.getLogger("otel_gpu.agent")

OVER_S = 4.0  # seconds of growth measured at the alert (besides the suspicion's baseline)
HOLDERS_KEPT = 10  # holders in the diagnosis's data
_PID = re.compile(r"^(?:process|rss):(\d+)(?:@|$)")

Ask = Callable[..., dict[str, Any]]


def subject_pid(subject: str) -> int | None:
    """The process a subject is about: ``process:123@GPU-..`` and ``rss:123`` -> 123."""
    m = _PID.match(subject)
    return int(m.group(1)) if m else None


def of_one_process(alert: Alert) -> bool:
    """Only the leak alerts of one process are held (a GPU's leak has no one process to ask)."""
    return subject_pid(alert.subject) is not None


class MemoryAttribution:
    """The leak diagnoser and the suspicion baselines of one watchdog."""

    def __init__(self, *, over_s: float = OVER_S, ask: Ask = request) -> None:
        self.over_s = over_s
        self._ask = ask
        self._suspected: dict[str, float] = {}  # subject -> start of the suspicion asked for
        self._asking = threading.Lock()  # one baseline census at a time

    def _census(self, pid: int, **args: Any) -> dict[str, Any]:
        return self._ask(process_socket(pid), "memory.census", timeout_s=60.0, **args)

    def on_sweep(self, engine: Engine, judged: list[tuple[str, Point]]) -> None:
        """After each sweep: a baseline census for each newly suspected process subject."""
        for subject, _point in judged:
            since = engine.suspected(subject)
            if since is None:
                self._suspected.pop(subject, None)
                continue
            if subject not in self._suspected:
                # the suspicion's visible trace: one log record (logger otel_gpu.agent), no
                # notification, no breaker
                log.info("leak suspected on %s since t=%g s: attribution started", subject, since)
                self._suspected[subject] = -1.0  # seen; its census is asked below when it can be
            pid = subject_pid(subject)
            if pid is None or self._suspected.get(subject) == since:
                continue
            if not self._asking.acquire(blocking=False):
                continue  # one is running: this subject is asked at a later sweep
            self._suspected[subject] = since
            # A daemon thread: a trainer slow to answer never holds up the agent's exit.
            threading.Thread(
                target=self._baseline, args=(pid,), name="otel-gpu-census", daemon=True
            ).start()

    def _baseline(self, pid: int) -> None:
        try:
            self._census(pid, over_s=0, top=1, sites="suspect")  # CUDA: allocator history on
        except ChannelError as exc:
            log.debug("no census baseline from pid %s: %s", pid, exc)
        finally:
            self._asking.release()

    def diagnose(self, alert: Alert) -> Diagnosis | None:
        """The holders that grew in ``alert``'s subject process (see the module docstring)."""
        pid = subject_pid(alert.subject)
        if pid is None:
            return Diagnosis(memory.KIND, (), error="the subject is not one process")
        started = time.monotonic()
        try:
            # baseline, now, and over_s later: three censuses within the queue's timeout
            reply = self._census(
                pid, over_s=self.over_s, samples=2, baseline="last", top=HOLDERS_KEPT,
                sites="confirm",
            )  # fmt: skip
        except ChannelError as exc:
            return Diagnosis(
                memory.KIND, (), took_s=time.monotonic() - started,
                error=redact_text(f"pid {pid} answered no census: {exc}"),
            )  # fmt: skip
        return diagnosis_from(pid, reply, time.monotonic() - started)

    def queue(self, timeout_s: float = 15.0) -> DiagnosisQueue:
        """A queue of its own (tests); the watchdog registers on its one queue (:meth:`attach`)."""
        queue = DiagnosisQueue({}, timeout_s)
        self.attach(queue)
        return queue

    def attach(self, queue: DiagnosisQueue) -> None:
        queue.register(LEAK, self.diagnose, of_one_process)


def diagnosis_from(pid: int, reply: Mapping[str, Any], took_s: float) -> Diagnosis:
    """A census reply as an alert's diagnosis (pure): the growing holders' lines, then the GPU
    allocation sites that grew (CUDA processes, ``site_lines``)."""
    holders = list(reply.get("holders") or [])
    sites = [str(line) for line in reply.get("site_lines") or []]
    lines = [str(line) for line in reply.get("lines") or []]
    data: dict[str, Any] = {
        "pid": pid,
        "over_s": reply.get("over_s"),
        "holders": holders[:HOLDERS_KEPT],
        "growing": [h["path"] for h in holders if h.get("growing")],
    }
    if reply.get("sites") is not None:
        data["sites"] = [r for r in reply["sites"] if r.get("growth_bytes", 0) > 0][:HOLDERS_KEPT]
    if not lines and not sites:
        return Diagnosis(
            memory.KIND, (), data, took_s,
            error=f"no tensor holder of pid {pid} grew over {reply.get('over_s', 0):.0f} s "
            "(the growth may be outside Python's tensors: allocator cache, C++ or another "
            "library)",
        )  # fmt: skip
    # Notifiers show the first three: the top holders, and the top site when there is room.
    return Diagnosis(
        memory.KIND, tuple(lines[:2] + sites[:1] + lines[2:] + sites[1:]), data, took_s
    )
