"""Threshold, hardware and anomaly detectors: simple rules with hysteresis, one alert per episode.

A memory or temperature rule stays active (a Condition) until its value falls back past the
hysteresis; an anomaly until the metric is back inside its band. Hardware errors are events:
each increase alerts, and nothing stays active.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from otel_gpu.core import xid
from otel_gpu.detect.detector import NO_ALERTS, Condition
from otel_gpu.detect.model import (
    ANOMALY,
    BREAKER,
    HARDWARE,
    NO_BREAKER,
    THRESHOLD,
    Alert,
    Point,
)
from otel_gpu.detect.settings import DetectConfig


@dataclass(frozen=True, slots=True)
class Finding:
    """A rule that just started holding."""

    kind: str  # "memory", "temperature", "ecc", "xid" or "anomaly"
    message: str
    value: float
    limit: float | None = None
    metric: str | None = None
    xid_class: str | None = None  # an Xid's class (otel_gpu/core/xid.py)
    xid_code: int | None = None


class ThresholdDetector:
    """Memory utilization high and rising; temperature high; ECC and Xid counters increasing
    (one subject's rules, a detector.Detector)."""

    KINDS: ClassVar[tuple[str, ...]] = (THRESHOLD, HARDWARE)
    __slots__ = (
        "cfg", "mem_base", "mem_alerted", "temp_alerted", "ecc", "xid", "xid_reset",
        "xid_severe", "since",
    )  # fmt: skip

    def __init__(self, cfg: DetectConfig) -> None:
        self.cfg = cfg
        self.since = 0.0  # data time of the latest threshold alert
        self.mem_base: float | None = None  # lowest usage since crossing the limit
        self.mem_alerted = False
        self.temp_alerted = False
        self.ecc: float | None = None
        self.xid: float | None = None
        self.xid_reset: float | None = None
        self.xid_severe: float | None = None

    @classmethod
    def enabled(cls, cfg: DetectConfig) -> bool:
        return cfg.threshold_enabled or cfg.hardware_enabled

    def conditions(self, now: float) -> Sequence[Condition]:
        active = self.mem_alerted or self.temp_alerted
        return (Condition(THRESHOLD, self.since),) if active else ()

    def observe(self, subject: str, p: Point) -> Sequence[Alert]:
        if (
            p.limit_bytes is None
            and p.temperature_c is None
            and p.ecc_uncorrected is None
            and p.xid_errors is None
            and p.xid_reset is None
        ):
            return NO_ALERTS  # nothing any rule here reads (a process's memory without its limit)
        out: list[Finding] = []
        cfg = self.cfg
        if cfg.threshold_enabled:
            mem = self._memory(p)
            if mem is not None:
                out.append(mem)
            temp = self._temperature(p)
            if temp is not None:
                out.append(temp)
        if cfg.hardware_enabled:
            self.ecc, ecc = _counter(self.ecc, p.ecc_uncorrected)
            if ecc:
                out.append(
                    Finding("ecc", f"{ecc:g} new uncorrected ECC error(s)", p.ecc_uncorrected or 0)
                )
            out.extend(self._xids(p))
        if not out:
            return NO_ALERTS
        alerts = [rule_alert(subject, p, f) for f in out]
        if any(a.kind == THRESHOLD for a in alerts):
            self.since = p.time
        return alerts

    def _xids(self, p: Point) -> list[Finding]:
        """New Xids by class: the application's annotate, reset-class and unknown ones are the
        GPU's fault. Without per-class counts (older reporters, CSV traces) every new Xid is
        judged by the latest code, or as severe when that is unknown too."""
        self.xid, total = _counter(self.xid, p.xid_errors)
        self.xid_reset, reset = _counter(self.xid_reset, p.xid_reset)
        self.xid_severe, severe = _counter(self.xid_severe, p.xid_severe)
        last = None if p.xid_last is None else int(p.xid_last)
        if p.xid_reset is None and p.xid_severe is None:
            if not total:
                return []
            cls = xid.SEVERE if last is None else xid.classify(last).cls
            return [_xid_finding(cls, total, last, p)]
        out = []
        for cls, n in ((xid.RESET, reset), (xid.SEVERE, severe)):
            if n:
                out.append(_xid_finding(cls, n, last, p))
        application = total - reset - severe
        if application > 0 and not out:
            out.append(_xid_finding(xid.APPLICATION, application, last, p))
        return out

    def _memory(self, p: Point) -> Finding | None:
        used, limit = p.used_bytes, p.limit_bytes
        if used is None or limit is None or limit <= 0:
            return None
        cfg = self.cfg
        frac = used / limit
        # Hysteresis of two points of utilization so a value sitting on the limit alerts once.
        if frac < cfg.memory_utilization_limit - 0.02:
            self.mem_base = None
            self.mem_alerted = False
            return None
        if frac < cfg.memory_utilization_limit:
            return None
        if self.mem_base is None or used < self.mem_base:
            self.mem_base = used
        if self.mem_alerted or used - self.mem_base < cfg.memory_rise_fraction * limit:
            return None
        self.mem_alerted = True
        return Finding(
            "memory",
            f"memory {frac:.1%} of the limit and rising",
            frac,
            cfg.memory_utilization_limit,
        )

    def _temperature(self, p: Point) -> Finding | None:
        temp = p.temperature_c
        if temp is None:
            return None
        cfg = self.cfg
        if temp < cfg.temperature_limit_c - cfg.temperature_hysteresis_c:
            self.temp_alerted = False
            return None
        if temp < cfg.temperature_limit_c or self.temp_alerted:
            return None
        self.temp_alerted = True
        return Finding(
            "temperature",
            f"temperature {temp:g} Cel above the limit {cfg.temperature_limit_c:g} Cel",
            temp,
            cfg.temperature_limit_c,
        )


def _xid_finding(cls: str, n: float, last: int | None, p: Point) -> Finding:
    """One class's new Xids; the latest code names them when it is of that class."""
    code = last if last is not None and xid.classify(last).cls == cls else None
    what = f"{n:g} new Xid error(s)"
    if code is not None:
        entry = xid.classify(code)
        name = "" if entry.mnemonic == "unknown" else f" ({entry.mnemonic})"
        what = f"Xid {code}{name}" + (f" and {n - 1:g} more of its class" if n > 1 else "")
    return Finding(
        "xid", f"{what}: {xid.ACTION[cls]}", p.xid_errors or n, xid_class=cls, xid_code=code
    )


def _counter(prev: float | None, value: float | None) -> tuple[float | None, float]:
    """(new remembered value, increase). The first value is a baseline; a reset is a new one."""
    if value is None:
        return prev, 0.0
    if prev is None or value < prev:
        return value, 0.0
    return value, value - prev


class AnomalyDetector:
    """EWMA mean and variance per configured metric (``anomaly_metrics``); alert leaving the
    mean +- k sigma band (one subject's, a detector.Detector)."""

    KINDS: ClassVar[tuple[str, ...]] = (ANOMALY,)
    __slots__ = ("cfg", "stats", "since")

    def __init__(self, cfg: DetectConfig) -> None:
        self.cfg = cfg
        # metric -> [count, mean, variance, alerted(0/1)]
        self.stats: dict[str, list[float]] = {}
        self.since = 0.0

    @classmethod
    def enabled(cls, cfg: DetectConfig) -> bool:
        return bool(cfg.anomaly_metrics)

    def conditions(self, now: float) -> Sequence[Condition]:
        outside = any(st[3] for st in self.stats.values())
        return (Condition(ANOMALY, self.since),) if outside else ()

    def observe(self, subject: str, p: Point) -> Sequence[Alert]:
        cfg = self.cfg
        out: list[Finding] = []
        for name in cfg.anomaly_metrics:
            x = p.extra.get(name)
            if x is None or not math.isfinite(x):
                continue
            st = self.stats.get(name)
            if st is None:
                self.stats[name] = [1.0, x, 0.0, 0.0]
                continue
            count, mean, var, alerted = st
            sigma = math.sqrt(var)
            dev = abs(x - mean)
            # Scale floor: a perfectly flat metric must not alert on rounding noise.
            floor = 1e-9 * max(1.0, abs(mean))
            outside = count >= cfg.anomaly_warmup and dev > cfg.anomaly_k * max(sigma, floor)
            inside = dev <= (cfg.anomaly_k - 1.0) * max(sigma, floor)
            if outside and not alerted:
                alerted = 1.0
                out.append(
                    Finding(
                        "anomaly",
                        f"{name} = {x:g} outside {mean:g} +- {cfg.anomaly_k:g} sigma ({sigma:g})",
                        x,
                        metric=name,
                    )
                )
            elif inside:
                alerted = 0.0
            # Outliers update the band clamped at its edge so one spike does not blow it open.
            a = cfg.anomaly_alpha
            edge = cfg.anomaly_k * max(sigma, floor)
            xc = min(max(x, mean - edge), mean + edge) if count >= cfg.anomaly_warmup else x
            diff = xc - mean
            mean += a * diff
            var = (1 - a) * (var + a * diff * diff)
            self.stats[name] = [count + 1, mean, var, alerted]
        if not out:
            return NO_ALERTS
        self.since = p.time
        return [rule_alert(subject, p, f) for f in out]


def rule_alert(subject: str, p: Point, f: Finding) -> Alert:
    """The alert for a rule that started holding at point ``p``."""
    if f.kind == "xid" and f.xid_class == xid.APPLICATION:
        kind, severity = HARDWARE, "warning"
    elif f.kind in ("ecc", "xid"):
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
    if f.xid_class is not None:
        evidence["xid_class"] = f.xid_class
        evidence["action"] = xid.ACTION[f.xid_class]
        if f.xid_code is not None:
            evidence["xid"] = f.xid_code
        if f.xid_class == xid.APPLICATION:
            evidence[BREAKER] = NO_BREAKER
    return Alert(
        kind=kind,
        subject=subject,
        time=p.time,
        severity=severity,
        message=f.message,
        evidence=evidence,
    )
