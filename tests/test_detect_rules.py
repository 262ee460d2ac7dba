"""Threshold, hardware and anomaly rules, and DetectConfig validation."""

from __future__ import annotations

import pytest

from otel_gpu.core.errors import UsageError
from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.model import ANOMALY, HARDWARE, THRESHOLD, Point

pytestmark = pytest.mark.unit


def run(points, cfg=None):
    engine = Engine(cfg)
    return [a for p in points for a in engine.observe("gpu:GPU-0", p)]


def test_memory_high_and_rising_alerts_once_per_episode():
    limit = 80e9
    used = [0.90, 0.955, 0.956, 0.97, 0.975, 0.97, 0.90, 0.955, 0.97, 0.98]
    pts = [
        Point(time=i * 10.0, used_bytes=u * limit, limit_bytes=limit) for i, u in enumerate(used)
    ]
    alerts = [a for a in run(pts) if a.kind == THRESHOLD]
    assert [a.time for a in alerts] == [30.0, 80.0]
    assert "97.0%" in alerts[0].message


def test_memory_high_but_flat_is_quiet():
    pts = [Point(time=i * 10.0, used_bytes=0.97 * 80e9, limit_bytes=80e9) for i in range(100)]
    assert run(pts) == []


def test_temperature_with_hysteresis():
    temps = [70, 88, 90, 86, 88, 83, 88]
    alerts = run([Point(time=float(i), temperature_c=c) for i, c in enumerate(temps)])
    assert [(a.kind, a.time) for a in alerts] == [(THRESHOLD, 1.0), (THRESHOLD, 6.0)]


def test_ecc_and_xid_increments_are_hardware_alerts():
    ecc = [3, 3, 4, 4, 6]
    xid = [None, 0, 0, 1, 1]
    pts = [
        Point(time=float(i), ecc_uncorrected=e, xid_errors=x)
        for i, (e, x) in enumerate(zip(ecc, xid, strict=True))
    ]
    alerts = run(pts)
    assert [(a.kind, a.time, a.evidence["rule"]) for a in alerts] == [
        (HARDWARE, 2.0, "ecc"),
        (HARDWARE, 3.0, "xid"),
        (HARDWARE, 4.0, "ecc"),
    ]


def test_anomaly_band_only_for_configured_metrics():
    values = [10.0 + (i % 5) * 0.1 for i in range(100)] + [25.0, 25.0, 10.1, 10.2, 30.0]
    pts = [Point(time=float(i), extra={"loss": v, "other": v}) for i, v in enumerate(values)]
    assert run(pts) == []  # off unless configured
    alerts = run(pts, DetectConfig(anomaly_metrics=("loss",)))
    assert [(a.kind, a.time) for a in alerts] == [(ANOMALY, 100.0), (ANOMALY, 104.0)]
    assert alerts[0].evidence["metric"] == "loss"


def test_config_from_env_overrides_and_validates():
    cfg = DetectConfig.from_env(
        {
            "OTEL_GPU_DETECT_STALL_WINDOW_S": "1200",
            "OTEL_GPU_DETECT_LEAK_ENABLED": "false",
            "OTEL_GPU_DETECT_ANOMALY_METRICS": "loss, grad_norm",
            "OTHER": "x",
        }
    )
    assert cfg.stall_window_s == 1200.0 and cfg.leak_enabled is False
    assert cfg.anomaly_metrics == ("loss", "grad_norm")
    with pytest.raises(UsageError, match="OTEL_GPU_DETECT_STALL_WINDOW_S"):
        DetectConfig.from_env({"OTEL_GPU_DETECT_STALL_WINDOW_S": "-5"})
    with pytest.raises(UsageError, match="OTEL_GPU_DETECT_LEAK_MIN_Z.*expected a number"):
        DetectConfig.from_env({"OTEL_GPU_DETECT_LEAK_MIN_Z": "lots"})
    with pytest.raises(UsageError, match="OTEL_GPU_DETECT_STAL_WINDOW_S is not a detection"):
        DetectConfig.from_env({"OTEL_GPU_DETECT_STAL_WINDOW_S": "5"})
    with pytest.raises(UsageError, match="stall_util_idle"):
        DetectConfig(stall_util_idle=1.5)
