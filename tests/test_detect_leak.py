"""Leak detector over generated traces: every benign shape stays quiet, leaks are found."""

from __future__ import annotations

import pytest
from support.tracegen import BENIGN, COLUMNS_FULL, generate

from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.model import LEAK, Point

pytestmark = pytest.mark.unit

NO_PHASE = ("util", "procs", "power_w", "power_limit_w")
HOUR = 3600.0


def alerts_of(points, engine=None, subject="process:1@GPU-0"):
    engine = Engine() if engine is None else engine
    out = []
    for p in points:
        out.extend(engine.observe(subject, p))
    return out


BENIGN_CASES = [
    (shape, interval, noise, cols, 7)
    for shape in BENIGN
    for interval, noise, cols in (
        (15.0, "inproc", COLUMNS_FULL),
        (60.0, "nvml", NO_PHASE),
        (30.0, "inproc", ()),
    )
]


# Regressions found by sweeping seeds: sampling slower than a GC sawtooth (the sampled trough
# drifts upward), a KV cache still filling fast hours in at 2-minute sampling, the tail of a
# warm-up.
BENIGN_CASES += [
    ("gc_sawtooth", 300.0, "nvml", COLUMNS_FULL, 1),
    ("gc_sawtooth", 5.0, "nvml", (), 3),
    ("kvcache", 120.0, "inproc", COLUMNS_FULL, 1),
    ("kvcache", 60.0, "inproc", NO_PHASE, 0),
    ("warmup", 5.0, "inproc", COLUMNS_FULL, 1),
]


@pytest.mark.parametrize(("shape", "interval", "noise", "cols", "seed"), BENIGN_CASES)
def test_benign_shapes_raise_no_alert(shape, interval, noise, cols, seed):
    tr = generate(
        shape, seed=seed, interval_s=interval, noise=noise, columns=cols, duration_s=10 * HOUR
    )
    alerts = alerts_of(tr.points)
    assert alerts == [], [a.message for a in alerts]


# (rate MB/h, noise, interval, max delay after onset)
LEAK_CASES = [
    (5000.0, "inproc", 5.0, 1.5 * HOUR),
    (3000.0, "nvml", 60.0, 1.5 * HOUR),
    (400.0, "inproc", 15.0, 2.5 * HOUR),
    (150.0, "nvml", 30.0, 2.5 * HOUR),
    (60.0, "inproc", 15.0, 5.0 * HOUR),
    (60.0, "nvml", 5.0, 2.5 * HOUR),
    (20.0, "nvml", 60.0, 6.0 * HOUR),
]


@pytest.mark.parametrize(("rate", "noise", "interval", "max_delay"), LEAK_CASES)
def test_leak_found_after_onset_with_rate_and_eta(rate, noise, interval, max_delay):
    onset = 2 * HOUR
    tr = generate(
        "leak",
        seed=3,
        interval_s=interval,
        noise=noise,
        rate_mb_per_h=rate,
        onset_s=onset,
        duration_s=onset + max_delay + 600,
    )
    alerts = alerts_of(tr.points)
    assert alerts, "leak not found"
    first = alerts[0]
    assert first.kind == LEAK
    assert onset <= first.time <= onset + max_delay
    assert first.rate_bytes_per_s == pytest.approx(tr.rate_bytes_per_s, rel=0.35)
    assert first.eta_s is not None and first.eta_s > 0
    assert first.window_s and first.window_s > 0
    assert first.confidence is not None and 0.5 <= first.confidence < 1
    assert [a.kind for a in alerts].count(LEAK) == 1, "a continuing leak alerts once"


def test_leak_without_limit_has_no_eta():
    tr = generate(
        "leak", seed=1, noise="nvml", rate_mb_per_h=800, onset_s=HOUR, duration_s=5 * HOUR
    )
    points = [Point(time=p.time, used_bytes=p.used_bytes) for p in tr.points]
    alerts = alerts_of(points)
    assert [a.kind for a in alerts] == [LEAK]
    assert alerts[0].eta_s is None and alerts[0].rate_bytes_per_s > 0


def test_alerts_are_causal_and_replay_identically():
    tr = generate(
        "leak", seed=2, noise="inproc", rate_mb_per_h=1000, onset_s=HOUR, duration_s=6 * HOUR
    )
    full = alerts_of(tr.points)
    assert full
    cut = full[0].time
    prefix = alerts_of([p for p in tr.points if p.time <= cut])
    assert prefix == full[:1]  # the future does not change what was said at time t
    assert alerts_of(tr.points) == full  # deterministic


def test_fast_leak_near_the_limit_is_urgent():
    # 20 GB/h with 20 GB of headroom: must not wait for the hour-long evidence window.
    limit = 80e9
    pts = [
        Point(
            time=t,
            used_bytes=min(limit, 60e9 + max(0.0, t - 7200) * 20e9 / 3600),
            limit_bytes=limit,
            procs=1,
        )
        for t in range(0, 10800, 10)
    ]
    alerts = [a for a in alerts_of(pts) if a.kind == LEAK]
    assert alerts and alerts[0].severity == "critical"
    assert alerts[0].time - 7200 < 40 * 60
    # confirmed (from the growth since it began, or urgently) with half an hour or so left
    assert alerts[0].eta_s is not None and alerts[0].eta_s <= 2400


def test_tenant_change_resets_evidence():
    # A slow rise that only exists because tenants come and go (procs changes) is not a leak.
    pts = []
    for _i, t in enumerate(range(0, 10 * 3600, 30)):
        procs = 1 + (t // 1800) % 3
        pts.append(
            Point(
                time=t,
                used_bytes=40e9 + procs * 3e9 + (t % 1800) * 2e5,
                limit_bytes=80e9,
                procs=procs,
            )
        )
    assert alerts_of(pts) == []


def test_forget_drops_subject_state():
    engine = Engine()
    tr = generate(
        "leak", seed=4, noise="nvml", rate_mb_per_h=2000, onset_s=HOUR, duration_s=4 * HOUR
    )
    alerts_of(tr.points[: len(tr.points) // 2], engine, "a")
    assert engine.subject_count == 1
    engine.forget("a")
    assert engine.subject_count == 0


def test_late_and_non_finite_points_are_ignored():
    engine = Engine()
    assert engine.observe("s", Point(time=100.0, used_bytes=1e9)) == []
    assert engine.observe("s", Point(time=50.0, used_bytes=9e10, limit_bytes=1e10)) == []
    assert engine.observe("s", Point(time=float("nan"), used_bytes=1e9)) == []
    assert engine.observe("s", Point(time=101.0, used_bytes=float("inf"), util=float("nan"))) == []


def test_leak_can_be_disabled():
    tr = generate(
        "leak", seed=5, noise="nvml", rate_mb_per_h=3000, onset_s=HOUR, duration_s=4 * HOUR
    )
    assert alerts_of(tr.points, Engine(DetectConfig(leak_enabled=False))) == []
