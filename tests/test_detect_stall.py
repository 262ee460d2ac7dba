"""Stall detector: idle and spinning hangs are found; saves, loads, slow jobs and the end are not."""

from __future__ import annotations

import pytest
from support.tracegen import COLUMNS_FULL, generate

from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.model import STALL, Point

pytestmark = pytest.mark.unit

NO_PHASE = ("util", "procs", "power_w", "power_limit_w")
NO_POWER = ("util", "procs", "phase")
HOUR = 3600.0


def alerts_of(points, engine=None):
    engine = Engine() if engine is None else engine
    out = []
    for p in points:
        out.extend(engine.observe("gpu:GPU-0", p))
    return out


STALL_CASES = [
    ("stall_idle", 5.0, COLUMNS_FULL),
    ("stall_idle", 60.0, NO_PHASE),
    ("stall_idle", 15.0, NO_POWER),
    ("stall_spin", 15.0, COLUMNS_FULL),
    ("stall_spin", 30.0, NO_PHASE),
]


@pytest.mark.parametrize(("shape", "interval", "cols"), STALL_CASES)
def test_stall_found_once_after_onset(shape, interval, cols):
    tr = generate(shape, seed=11, interval_s=interval, columns=cols, duration_s=6 * HOUR)
    alerts = alerts_of(tr.points)
    assert [a.kind for a in alerts] == [STALL], [a.message for a in alerts]
    delay = alerts[0].time - tr.onset_s
    assert 0 <= delay <= 900 + 4 * interval + 120
    assert ("spinning" in alerts[0].message) == (shape == "stall_spin")


@pytest.mark.parametrize("shape", ["longsave", "inputbound", "finished", "flat"])
@pytest.mark.parametrize("cols", [COLUMNS_FULL, NO_PHASE], ids=["phase", "nophase"])
def test_working_or_finished_jobs_are_not_stalled(shape, cols):
    tr = generate(shape, seed=5, interval_s=15.0, columns=cols, duration_s=8 * HOUR)
    assert [a.message for a in alerts_of(tr.points)] == []


def _job(segments, interval=30.0, limit=80e9, used=40e9):
    """Points from (duration_s, util, power_w, phase) segments after a short working start."""
    pts, t = [], 0.0
    for duration, util, power, phase in segments:
        end = t + duration
        while t < end:
            pts.append(
                Point(
                    time=t,
                    used_bytes=used,
                    limit_bytes=limit,
                    util=util,
                    procs=1,
                    phase=phase,
                    power_w=power,
                    power_limit_w=700.0,
                )
            )
            t += interval
    return pts


def test_checkpoint_save_without_phase_shorter_than_window_is_quiet():
    pts = _job([(3600, 0.9, 600, None), (12 * 60, 0.01, 75, None), (3600, 0.9, 600, None)])
    assert alerts_of(pts) == []


def test_known_save_phase_suppresses_but_not_forever():
    quiet = _job([(3600, 0.9, 600, "train"), (40 * 60, 0.0, 70, "save"), (600, 0.9, 600, "train")])
    assert alerts_of(quiet) == []
    cfg = DetectConfig(stall_phase_max_s=3600)
    stuck = _job([(3600, 0.9, 600, "train"), (3 * HOUR, 0.0, 70, "save")])
    alerts = alerts_of(stuck, Engine(cfg))
    assert [a.kind for a in alerts] == [STALL]
    # The save began at 1 h; the phase excuses it for 1 h, then it is plainly stalled.
    assert 2 * 3600 <= alerts[0].time <= 2 * 3600 + 120


def test_recovered_pauses_stretch_the_window():
    # Hourly 20-minute pauses (no phase info) that always recover teach the detector.
    seg = [(3600, 0.9, 600, None)]
    first = _job(seg + [(20 * 60, 0.01, 75, None)])
    assert [a.kind for a in alerts_of(first)] == [STALL]  # the first one is alarming
    cfg = DetectConfig(stall_window_s=25 * 60)
    pts = _job((seg + [(20 * 60, 0.01, 75, None)]) * 3 + seg + [(40 * 60, 0.01, 75, None)])
    alerts = alerts_of(pts, Engine(cfg))
    # 20-min pauses pass; the 40-min one exceeds 1.5 x 20 min and alarms.
    assert [a.kind for a in alerts] == [STALL]
    assert alerts[0].time >= 4 * 3600 + 3 * 1200 + 30 * 60


def test_steps_that_stop_advancing_are_a_stall_even_at_full_util():
    pts, step = [], 0.0
    for t in range(0, 4 * 3600, 10):
        if t < 2 * 3600:
            step += 2
        pts.append(Point(time=t, used_bytes=40e9, limit_bytes=80e9, util=0.95, procs=1, step=step))
    alerts = alerts_of(pts)
    assert [a.kind for a in alerts] == [STALL]
    assert "step stuck" in alerts[0].message
    assert 2 * 3600 - 10 + 900 <= alerts[0].time <= 2 * 3600 + 1000


def test_slow_steps_with_low_util_are_working():
    pts = []
    for i, t in enumerate(range(0, 3 * 3600, 20)):
        pts.append(
            Point(time=t, used_bytes=40e9, limit_bytes=80e9, util=0.03, procs=1, step=i // 3)
        )
    assert alerts_of(pts) == []


def test_stall_clears_and_can_alert_again():
    seg_work = (1800, 0.9, 600, None)
    seg_hang = (30 * 60, 0.0, 70, None)
    pts = _job([seg_work, seg_hang, seg_work, seg_hang])
    assert [a.kind for a in alerts_of(pts)] == [STALL, STALL]


def test_released_memory_is_not_a_stall():
    pts = _job([(1800, 0.9, 600, None)]) + [
        Point(time=1800 + i * 30, used_bytes=0, limit_bytes=80e9, util=0.0, procs=0)
        for i in range(200)
    ]
    assert alerts_of(pts) == []


def test_activity_blips_do_not_hide_a_hang():
    # Hung job: one sample of 40% util every 5 minutes (a watchdog kernel), otherwise idle.
    pts = _job([(1800, 0.9, 600, None)])
    t = 1800.0
    while t < 1800 + 3600:
        blip = int(t) % 300 == 0
        pts.append(
            Point(
                time=t,
                used_bytes=40e9,
                limit_bytes=80e9,
                util=0.4 if blip else 0.02,
                procs=1,
                power_w=120 if blip else 75,
                power_limit_w=700.0,
            )
        )
        t += 30
    alerts = alerts_of(pts)
    assert [a.kind for a in alerts] == [STALL]
    assert alerts[0].time <= 1800 + 900 + 120
