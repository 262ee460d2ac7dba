"""The detection engine: points in per subject, alerts out. Pure, causal, no I/O, no wall clock.

The same engine runs in the agent (on the sampler's snapshots), in ``otel-gpu processor`` (on
OTLP data) and in ``otel-gpu analyze`` (on CSV traces), so a replay judges exactly as live.

    engine = Engine(DetectConfig())
    alerts = engine.observe("gpu:GPU-1234", Point(time=t, used_bytes=..., util=...))
    engine.conditions("gpu:GPU-1234")  # what still holds: a leak until its floor stops rising
    engine.forget("gpu:GPU-1234")

Time is each point's own data time. A point older than the subject's latest one is ignored,
so an alert at time t depends only on points at or before t. State per subject is a few
hundred floats at most (see ``leak.py``), whatever the job's age.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from otel_gpu.detect.detector import Condition, Detector
from otel_gpu.detect.floor import FloorTrend
from otel_gpu.detect.leak import LeakDetector
from otel_gpu.detect.model import NUMERIC_FIELDS, RAW_FIELDS, Alert, Point
from otel_gpu.detect.numerics import NumericsDetector
from otel_gpu.detect.settings import DetectConfig
from otel_gpu.detect.stall import StallDetector
from otel_gpu.detect.threshold import AnomalyDetector, ThresholdDetector

__all__ = ["ALERT_KINDS", "DETECTORS", "DetectConfig", "Engine"]

# Every detector the engine runs, in the order their alerts are reported. A new detector is a
# class implementing detector.Detector plus one entry here (tests/test_detect_registry.py
# fails for a class of that shape in otel_gpu.detect that is not listed).
DETECTORS: tuple[type[Detector], ...] = (
    LeakDetector,
    StallDetector,
    ThresholdDetector,
    AnomalyDetector,
    NumericsDetector,
)
# Every alert kind the registered detectors raise, in their order: the kinds an alert may stop
# the job for (OTEL_GPU_STOP_KINDS, actions/settings.py).
ALERT_KINDS: tuple[str, ...] = tuple(dict.fromkeys(k for d in DETECTORS for k in d.KINDS))


class _Subject:
    __slots__ = ("last_time", "detectors", "observers")

    def __init__(self, detectors: list[Detector]) -> None:
        self.last_time = -math.inf
        self.detectors = detectors
        self.observers = tuple(d.observe for d in detectors)  # bound once: called per point


class Engine:
    """Runs every enabled detector over each subject's points; one alert per condition start,
    and the conditions that still hold."""

    def __init__(
        self,
        config: DetectConfig | None = None,
        detectors: Sequence[type[Detector]] = DETECTORS,
    ) -> None:
        self.config = config if config is not None else DetectConfig()
        self._kinds = tuple(d for d in detectors if d.enabled(self.config))
        self._subjects: dict[str, _Subject] = {}

    @property
    def subject_count(self) -> int:
        """Subjects with state (callers cap this with ``forget``)."""
        return len(self._subjects)

    def observe(self, subject: str, point: Point) -> list[Alert]:
        """Feed one point of ``subject``; returns the alerts that start at this point."""
        t = point.time
        if not math.isfinite(t):
            return []
        state = self._subjects.get(subject)
        if state is None:
            cfg = self.config
            state = self._subjects[subject] = _Subject([d(cfg) for d in self._kinds])
        if t < state.last_time:
            return []  # late point: judging it would let the past depend on the future
        state.last_time = t
        # NaN and infinities mean "unknown" (never 0). The common case in one expression:
        # None counts as 0, and NaN or an infinity (truthy) makes the sum non-finite.
        if not math.isfinite(
            (point.used_bytes or 0.0)
            + (point.limit_bytes or 0.0)
            + (point.util or 0.0)
            + (point.power_w or 0.0)
            + (point.power_limit_w or 0.0)
            + (point.step or 0.0)
            + (point.temperature_c or 0.0)
            + (point.ecc_uncorrected or 0.0)
            + (point.xid_errors or 0.0)
            + (point.xid_reset or 0.0)
            + (point.xid_severe or 0.0)
            + (point.xid_last or 0.0)
        ):
            point = _sanitized(point)

        alerts: list[Alert] = []
        for observe in state.observers:
            found = observe(subject, point)
            if found:
                alerts.extend(found)
        return alerts

    def floor_trend(self, subject: str) -> FloorTrend | None:
        """The leak detector's view of a subject's memory floor (None: no floor yet), for
        displays and reports; alerts still come only from :meth:`observe`."""
        leak = self._leak_detector(subject)
        return None if leak is None else leak.trend()

    def suspected(self, subject: str) -> float | None:
        """The data time a standing leak suspicion of ``subject`` began (None: none stands).
        A suspicion notifies nobody and moves no breaker (detect/suspect.py): callers start
        attribution on it and show it."""
        leak = self._leak_detector(subject)
        return None if leak is None else leak.suspected()

    def _leak_detector(self, subject: str) -> LeakDetector | None:
        """The leak detector of ``subject`` (None: unknown subject, or leaks turned off)."""
        state = self._subjects.get(subject)
        if state is None:
            return None
        for d in state.detectors:
            if isinstance(d, LeakDetector):
                return d
        return None

    def conditions(self, subject: str) -> list[Condition]:
        """The conditions active for ``subject`` after its latest point (none if unknown)."""
        state = self._subjects.get(subject)
        if state is None:
            return []
        now = state.last_time
        return [c for d in state.detectors for c in d.conditions(now)]

    def active_kinds(self, subject: str) -> frozenset[str]:
        """The alert kinds with an active condition for ``subject`` (what holds a breaker)."""
        return frozenset(c.kind for c in self.conditions(subject))

    def forget(self, subject: str) -> None:
        """Drop all state of a subject that vanished (its process or GPU is gone)."""
        self._subjects.pop(subject, None)


def _sanitized(p: Point) -> Point:
    """A copy of ``p`` with its NaN and infinite values set to None (the rare slow path; a
    sum of finite values can overflow too, and then the copy is equal to ``p``)."""
    bad = [
        n
        for n in NUMERIC_FIELDS
        if n not in RAW_FIELDS and (v := getattr(p, n)) is not None and not math.isfinite(v)
    ]
    values = {name: getattr(p, name) for name in Point.__dataclass_fields__}
    for name in bad:
        values[name] = None
    return Point(**values)
