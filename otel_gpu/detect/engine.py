"""The detection engine: points in per subject, alerts out. Pure, causal, no I/O, no wall clock.

The same engine runs in the agent (on the sampler's snapshots), in ``otel-gpu processor`` (on
OTLP data) and in ``otel-gpu analyze`` (on CSV traces), so a replay judges exactly as live.

    engine = Engine(DetectConfig())
    alerts = engine.observe("gpu:GPU-1234", Point(time=t, used_bytes=..., util=...))
    engine.forget("gpu:GPU-1234")

Time is each point's own data time. A point older than the subject's latest one is ignored,
so an alert at time t depends only on points at or before t. State per subject is a few
hundred floats at most (see ``leak.py``), whatever the job's age.
"""

from __future__ import annotations

import math

from otel_gpu.detect.config import DetectConfig
from otel_gpu.detect.floor import FloorTrend
from otel_gpu.detect.leak import LeakFinding, LeakState
from otel_gpu.detect.model import (
    ANOMALY,
    HARDWARE,
    LEAK,
    NUMERIC_FIELDS,
    STALL,
    THRESHOLD,
    Alert,
    Point,
)
from otel_gpu.detect.stall import SPIN, STEPS, StallFinding, StallState
from otel_gpu.detect.threshold import AnomalyState, Finding, ThresholdState

__all__ = ["DetectConfig", "Engine"]


class _Subject:
    __slots__ = ("last_time", "leak", "stall", "threshold", "anomaly")

    def __init__(self, cfg: DetectConfig) -> None:
        self.last_time = -math.inf
        self.leak = LeakState(cfg) if cfg.leak_enabled else None
        self.stall = StallState(cfg) if cfg.stall_enabled else None
        self.threshold = (
            ThresholdState(cfg) if cfg.threshold_enabled or cfg.hardware_enabled else None
        )
        self.anomaly = AnomalyState(cfg) if cfg.anomaly_metrics else None


class Engine:
    """Runs every enabled detector over each subject's points; one alert per condition start."""

    def __init__(self, config: DetectConfig | None = None) -> None:
        self.config = config if config is not None else DetectConfig()
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
            state = self._subjects[subject] = _Subject(self.config)
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
        ):
            point = _sanitized(point)

        alerts: list[Alert] = []
        if state.leak is not None:
            leak = state.leak.observe(point)
            if leak is not None:
                alerts.append(_leak_alert(subject, point, leak))
        if state.stall is not None:
            stall = state.stall.observe(point)
            if stall is not None:
                alerts.append(_stall_alert(subject, point, stall))
        if state.threshold is not None:
            for found in state.threshold.observe(point):
                alerts.append(_rule_alert(subject, point, found))
        if state.anomaly is not None:
            for found in state.anomaly.observe(point):
                alerts.append(_rule_alert(subject, point, found))
        return alerts

    def floor_trend(self, subject: str) -> FloorTrend | None:
        """The leak detector's view of a subject's memory floor (None: no floor yet), for
        displays and reports; alerts still come only from :meth:`observe`."""
        state = self._subjects.get(subject)
        if state is None or state.leak is None:
            return None
        return state.leak.trend()

    def forget(self, subject: str) -> None:
        """Drop all state of a subject that vanished (its process or GPU is gone)."""
        self._subjects.pop(subject, None)


def _sanitized(p: Point) -> Point:
    """A copy of ``p`` with its NaN and infinite values set to None (the rare slow path; a
    sum of finite values can overflow too, and then the copy is equal to ``p``)."""
    bad = [n for n in NUMERIC_FIELDS if (v := getattr(p, n)) is not None and not math.isfinite(v)]
    values = {name: getattr(p, name) for name in Point.__dataclass_fields__}
    for name in bad:
        values[name] = None
    return Point(**values)


def _gb(n: float) -> str:
    # GiB, as NVML, nvidia-smi and otel-gpu's own view count memory (rates stay in MB/h).
    return f"{n / 2**30:.1f} GiB"


def _duration(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    if s < 172800:
        return f"{s / 3600:.1f} h"
    return f"{s / 86400:.1f} d"


def _leak_alert(subject: str, p: Point, f: LeakFinding) -> Alert:
    mb_per_h = f.rate * 3600 / 1e6
    parts = [
        f"memory leak suspected: floor rising {mb_per_h:.0f} MB/h "
        f"({f.rate:.0f} By/s) steadily over {_duration(f.window_s)}"
    ]
    if p.limit_bytes:
        parts.append(f"at {_gb(f.floor)} of {_gb(p.limit_bytes)}")
    if f.eta_s is not None:
        parts.append(f"limit reached in ~{_duration(f.eta_s)}")
    critical = f.urgent or (f.eta_s is not None and f.eta_s <= 3600)
    return Alert(
        kind=LEAK,
        subject=subject,
        time=p.time,
        severity="critical" if critical else "warning",
        message=", ".join(parts),
        rate_bytes_per_s=f.rate,
        eta_s=f.eta_s,
        window_s=f.window_s,
        confidence=f.confidence,
        evidence={"z": round(f.z, 2), "floor_bytes": f.floor, "urgent": str(f.urgent).lower()},
    )


def _stall_alert(subject: str, p: Point, f: StallFinding) -> Alert:
    held = f" while holding {_gb(f.used_bytes)}" if f.used_bytes else ""
    dur = _duration(f.duration_s)
    if f.mode == SPIN:
        power = f" at {f.power_fraction:.0%} power" if f.power_fraction is not None else ""
        what = (
            f"GPU busy-spinning (util {f.util or 0:.0%}){power} for {dur}{held}: hung collective?"
        )
    elif f.mode == STEPS:
        step = f" at {p.step:g}" if p.step is not None else ""
        what = f"training step stuck{step} for {dur}{held}"
    else:
        util = f" (util {f.util:.0%})" if f.util is not None else ""
        what = f"GPU idle{util} for {dur}{held}"
    evidence: dict[str, float | str] = {"mode": f.mode, "since": f.since}
    if f.util is not None:
        evidence["util"] = round(f.util, 4)
    if f.power_fraction is not None:
        evidence["power_fraction"] = round(f.power_fraction, 4)
    return Alert(
        kind=STALL,
        subject=subject,
        time=p.time,
        severity="critical",
        message=f"stalled: {what}",
        window_s=f.duration_s,
        evidence=evidence,
    )


def _rule_alert(subject: str, p: Point, f: Finding) -> Alert:
    if f.kind in ("ecc", "xid"):
        kind, severity = HARDWARE, "critical"
    elif f.kind == "anomaly":
        kind, severity = ANOMALY, "warning"
    else:
        kind = THRESHOLD
        severity = "critical" if f.kind == "memory" else "warning"
    evidence: dict[str, float | str] = {"rule": f.kind, "value": f.value}
    if f.limit is not None:
        evidence["limit"] = f.limit
    if f.metric is not None:
        evidence["metric"] = f.metric
    return Alert(
        kind=kind,
        subject=subject,
        time=p.time,
        severity=severity,
        message=f.message,
        evidence=evidence,
    )
