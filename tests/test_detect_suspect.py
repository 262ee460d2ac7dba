"""The leak suspicion stage (otel_gpu/detect/suspect.py): a CUSUM on the floor's rise
whose threshold comes from a target false-suspicion rate; silent (no alert, no condition) and
visible through the engine (issue 20 §1)."""

from __future__ import annotations

import random

import pytest
from support.tracegen import generate

from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.model import Point
from otel_gpu.detect.suspect import Cusum, threshold

pytestmark = pytest.mark.unit

MIB = float(1 << 20)


def test_the_threshold_follows_the_target_false_suspicion_rate() -> None:
    rare, often = threshold(0.01, 60.0), threshold(10.0, 60.0)
    assert rare > threshold(0.1, 60.0) > often > 0
    # coarser buckets: fewer increments a day, so a lower threshold for the same rate
    assert threshold(0.1, 960.0) < threshold(0.1, 60.0)


@pytest.mark.parametrize("noise", ["gauss", "uniform"])
def test_flat_noise_raises_suspicions_near_the_target_rate(noise: str) -> None:
    rng = random.Random(3)
    per_day = 1.0
    c = Cusum(threshold(per_day, 60.0), 1 * MIB)
    days = 30
    started = 0
    for i in range(days * 1440):
        x = rng.gauss(0, 4 * MIB) if noise == "gauss" else rng.uniform(0, 300 * MIB)
        started += c.feed(i * 60.0, 10e9 + x)
    # Siegmund's approximation for Gaussian increments: within a factor of a few of the target
    assert started <= 3 * per_day * days, started


def test_steady_growth_is_suspected_within_minutes_and_flat_floor_ends_it() -> None:
    c = Cusum(threshold(0.1, 60.0), 1 * MIB)
    rng = random.Random(1)
    floor = 10e9
    for i in range(60):  # an hour flat: nothing
        assert not c.feed(i * 60.0, floor + rng.gauss(0, MIB))
    started = None
    for i in range(60, 120):  # 300 MB/h: 5 MB a minute
        floor += 5e6
        if c.feed(i * 60.0, floor + rng.gauss(0, MIB)):
            started = i * 60.0
    assert started is not None and started - 3600 <= 15 * 60, started
    assert c.since == started
    for i in range(120, 400):  # the leak stops
        c.feed(i * 60.0, floor + rng.gauss(0, MIB))
    assert c.since is None


def test_a_suspicion_is_silent_and_visible_through_the_engine() -> None:
    tr = generate("leak", seed=2, interval_s=60.0, noise="nvml", duration_s=8 * 3600.0)
    engine, quiet = Engine(DetectConfig()), Engine(DetectConfig(leak_suspect_enabled=False))
    subject = "process:1@GPU-0"
    first_suspicion = first_alert = quiet_alert = None
    for p in tr.points:
        a, b = engine.observe(subject, p), quiet.observe(subject, p)
        if b and quiet_alert is None:
            quiet_alert = p.time
        if first_alert is None:
            # until it is confirmed, a suspicion raises nothing and holds no breaker open
            assert [x.time for x in a] == [x.time for x in b] or a
            assert engine.active_kinds(subject) == quiet.active_kinds(subject) or a
        if a and first_alert is None:
            first_alert = p.time
        if first_suspicion is None and engine.suspected(subject) is not None:
            first_suspicion = p.time
    assert first_suspicion is not None and tr.onset_s is not None
    assert tr.onset_s <= first_suspicion
    assert first_alert is not None and first_suspicion < first_alert  # attribution starts first
    # ... and confirmation comes sooner with it (growth.py) than from the fixed windows alone
    assert quiet_alert is not None and first_alert < quiet_alert
    assert quiet.suspected(subject) is None


def test_the_change_point_is_where_the_floor_began_to_rise() -> None:
    c = Cusum(threshold(0.1, 60.0), 1 * MIB)
    rng = random.Random(5)
    floor = 10e9
    for i in range(90):
        c.feed(i * 60.0, floor + rng.uniform(0, 30 * MIB))
    for i in range(90, 150):  # 600 MB/h from t = 5340 s (bucket 89 was the last flat one)
        floor += 10e6
        c.feed(i * 60.0, floor + rng.uniform(0, 30 * MIB))
    assert c.since is not None and c.origin is not None
    assert 88 * 60.0 <= c.origin <= 92 * 60.0, c.origin


def test_a_step_that_ended_ends_the_suspicion() -> None:
    c = Cusum(threshold(0.1, 60.0), 1 * MIB)
    for i in range(60):
        c.feed(i * 60.0, 10e9)
    suspected = ended = None
    for i in range(60, 200):
        c.feed(i * 60.0, 12e9)  # a curriculum step: suspected at once ...
        if suspected is None and c.since is not None:
            suspected = i
        if suspected is not None and c.since is None:
            ended = i
            break
    assert suspected is not None and suspected - 60 <= 2, suspected
    assert ended is not None and ended - suspected <= 20, ended  # ... over once it stays flat


def test_a_block_held_for_minutes_and_freed_leaves_the_suspicion_standing() -> None:
    # a 20 MiB staircase (150 MB/h in NVML-sized chunks): a 155 MB block held for 5 minutes
    # and freed does not end the suspicion of the floor under it, which still rises
    c = Cusum(threshold(0.1, 60.0), 1 * MIB)
    for i in range(60):
        c.feed(i * 60.0, 50e9)
    for i in range(60, 150):
        floor = 50e9 + 20 * MIB * ((i - 60) // 8 + 1)
        if 95 <= i < 100:
            floor += 155e6
        c.feed(i * 60.0, floor)
        if i >= 75:
            assert c.since is not None, i


def test_a_reset_clears_the_suspicion() -> None:
    engine = Engine()
    subject = "process:1@GPU-0"
    t, used = 0.0, 20e9
    while engine.suspected(subject) is None and t < 4 * 3600:
        t += 60.0
        used += 20e6 if t > 3600 else 0.0
        engine.observe(subject, Point(t, used_bytes=used, limit_bytes=80e9, procs=1))
    assert engine.suspected(subject) is not None
    engine.observe(subject, Point(t + 60, used_bytes=used, limit_bytes=80e9, procs=2))
    assert engine.suspected(subject) is None  # another tenant arrived: evidence reset
