"""``/readyz``: may this replica take traffic? (pure; time is the data's own time)

A replica is not ready while a *serving-fatal* condition holds on one of its subjects:

* a GPU the pod was given is lost (NVML reports it failed: fallen off the bus, reset required);
* an Xid that needs a GPU reset arrived (:data:`DEFAULT_FATAL_XIDS`, ``OTEL_GPU_READY_XIDS``),
  or one NVIDIA's catalog does not know;
* a memory leak projected to exhaust memory within ``OTEL_GPU_READY_EXHAUSTION`` seconds;
* a serving stall (requests waiting while the GPUs idle; :mod:`otel_gpu.inference.serving`).

Each condition is an alert fed to a circuit breaker of its own (the same :class:`Breaker` and
``OTEL_GPU_BREAKER_*`` settings as the agent's), so readiness follows it: not ready while any
subject is OPEN or HALF_OPEN, ready again once HALF_OPEN probation passed without the condition
(a lost GPU raises it again every sweep, so it cannot close while the GPU is still gone).
Unknown is not fatal: without fresh data the replica stays ready (``/healthz`` reports that).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from otel_gpu.core import xid
from otel_gpu.core.errors import UsageError
from otel_gpu.core.settings import Setting, number, resolve
from otel_gpu.detect.breaker import CLOSED, OPEN, Breaker, BreakerConfig, Transition
from otel_gpu.detect.model import HARDWARE, LEAK, Alert
from otel_gpu.sampling.snapshot import STATUS_FAILED, Snapshot

# The reset-class Xids of NVIDIA's catalog and DCGM's fatal list (otel_gpu/core/xid.py): 48
# double-bit ECC error, 74 NVLink error, 79 GPU has fallen off the bus, 94/95 contained /
# uncontained ECC error, 119/120 GSP RPC timeout / GSP error, 140 unrecovered ECC error, ...
# A code the catalog does not know is fatal too, unless the list is `none`.
DEFAULT_FATAL_XIDS = xid.RESET_CODES
XIDS_ENV = "OTEL_GPU_READY_XIDS"
EXHAUSTION_ENV = "OTEL_GPU_READY_EXHAUSTION"
DEFAULT_EXHAUSTION_S = 900.0  # a leak with less time than this to exhaustion is fatal


@dataclass(frozen=True, slots=True)
class ReadinessConfig:
    """Which conditions are serving-fatal."""

    fatal_xids: frozenset[int] = DEFAULT_FATAL_XIDS
    exhaustion_s: float = DEFAULT_EXHAUSTION_S

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> ReadinessConfig:
        """``OTEL_GPU_READY_XIDS`` and ``OTEL_GPU_READY_EXHAUSTION`` (:data:`DECLARED`) over
        the defaults; UsageError naming the variable."""
        values, _origin = resolve(DECLARED, env=environ)
        return cls(**values)


DECLARED = (
    Setting(
        "fatal_xids", XIDS_ENV, lambda raw, source: parse_xids(str(raw), source),
        "Xids that make the replica not ready; `none` for none",
        ",".join(str(x) for x in sorted(DEFAULT_FATAL_XIDS)),
    ),
    Setting(
        "exhaustion_s", EXHAUSTION_ENV,
        number(0, 7 * 86400, low_open=True, accepted="use a number of seconds from 1 to 604800"),
        "a leak projected to exhaust memory within this many seconds makes it not ready",
        f"{DEFAULT_EXHAUSTION_S:g}",
    ),
)  # fmt: skip


def parse_xids(raw: str, source: str) -> frozenset[int]:
    """``79,48,95`` → the set; ``none`` → empty (no Xid gates readiness)."""
    if raw.strip().lower() == "none":
        return frozenset()
    try:
        xids = frozenset(int(part) for part in raw.split(",") if part.strip())
    except ValueError:
        xids = frozenset({-1})
    if not xids or min(xids) < 1:
        raise UsageError(
            f"{source}={raw!r}: use Xid numbers separated by commas (e.g. 79,48,95) or none"
        )
    return xids


class Readiness:
    """Serving-fatal conditions → one breaker per subject → a ready/not-ready verdict.

    ``observe`` (after each sweep) and ``on_alert`` (the agent's detector alerts) run on the
    sampler's thread; ``verdict`` on the health server's. A lock guards what they share.
    """

    def __init__(
        self, config: ReadinessConfig | None = None, breaker: BreakerConfig | None = None
    ) -> None:
        self.config = config if config is not None else ReadinessConfig()
        self._breaker = Breaker(breaker if breaker is not None else BreakerConfig())
        self._lock = threading.Lock()
        self._causes: dict[str, str] = {}  # subject -> the sentence that opened its breaker
        self._states: dict[str, str] = {}
        self._pending: list[Transition] = []  # since the last observe()

    def on_alert(self, alert: Alert) -> None:
        """A detector alert from the agent: a leak close to exhaustion is serving-fatal."""
        eta = alert.eta_s
        if alert.kind == LEAK and eta is not None and eta <= self.config.exhaustion_s:
            self._record(alert)

    def observe(self, snap: Snapshot, serving: Iterable[Alert] = ()) -> list[Transition]:
        """One sweep: lost GPUs, fatal Xids and the serving conditions that hold now. Returns
        the readiness transitions since the last call (leak alerts' included), oldest first."""
        for gpu in snap.gpus:
            subject = f"gpu:{gpu.uuid}"
            if gpu.status == STATUS_FAILED:
                self._record(_hardware(subject, snap.time, f"GPU {gpu.uuid} is lost", "lost"))
            listed = self.config.fatal_xids
            fatal = [
                x
                for x in gpu.xid_codes
                if x in listed or (listed and xid.classify(x).cls == xid.SEVERE)
            ]
            if fatal:
                codes = ", ".join(str(x) for x in fatal)
                self._record(
                    _hardware(
                        subject,
                        snap.time,
                        f"GPU {gpu.uuid}: Xid {codes} (needs a reset: drain / reset the GPU)",
                        "xid",
                    )
                )
        for alert in serving:
            self._record(alert)
        self._apply(self._breaker.advance_all(snap.time))
        with self._lock:
            done, self._pending = self._pending, []
        return done

    def verdict(self) -> tuple[bool, str]:
        """(ready, one-line reason)."""
        with self._lock:
            sick = {s: st for s, st in self._states.items() if st != CLOSED}
            causes = dict(self._causes)
        if not sick:
            return True, "ready: no serving-fatal condition"
        parts = []
        for subject, state in sorted(sick.items()):
            waiting = "open" if state == OPEN else "on probation (half-open)"
            parts.append(f"{causes.get(subject, subject)}; breaker {waiting}")
        return False, "not ready: " + "; ".join(parts)

    def _record(self, alert: Alert) -> None:
        with self._lock:
            if self._breaker.state(alert.subject) == CLOSED:
                self._causes[alert.subject] = alert.message
        self._apply(self._breaker.record_alert(alert))

    def _apply(self, transitions: list[Transition]) -> None:
        with self._lock:
            for t in transitions:
                if t.to_state == CLOSED:
                    self._causes.pop(t.subject, None)
                    self._breaker.forget(t.subject)  # bounded: exited processes do not pile up
            self._pending.extend(transitions)
            self._states = {s: self._breaker.state(s) for s in self._breaker.subjects()}


def _hardware(subject: str, time: float, message: str, rule: str) -> Alert:
    return Alert(
        kind=HARDWARE,
        subject=subject,
        time=time,
        severity="critical",
        message=message,
        evidence={"rule": rule},
    )
