"""Confirmation from the growth since a suspicion's change point (otel_gpu/detect/growth.py):
a clear leak is confirmed within about half an hour of its start, however long the job ran;
a cache that starts filling after a flat stretch (which the fixed windows straddle) is not a
leak, and neither is the next tooth of a slow sawtooth (issue 20 §1)."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from otel_gpu.detect.engine import DetectConfig, Engine
from otel_gpu.detect.floor import FloorLevel, freed_later
from otel_gpu.detect.growth import confirm, slowdown_z
from otel_gpu.detect.model import LEAK, Alert, Point

pytestmark = pytest.mark.unit

MIB = float(1 << 20)
ONSET = 2 * 3600.0  # the growth starts after two flat hours


def points(
    extra: Callable[[float], float], *, hours: float = 6.0, dt: float = 15.0, jitter: float = 0.0
) -> list[Point]:
    rng = random.Random(7)
    out = []
    t = 0.0
    while t <= hours * 3600:
        used = 30e9 + extra(t) + (rng.uniform(0, jitter) if jitter else 0.0)
        used = math.floor(used / (2 * MIB)) * 2 * MIB  # NVML's 2 MiB steps
        out.append(Point(time=t, used_bytes=used, limit_bytes=80e9, procs=1, util=0.9))
        t += dt
    return out


def leak(mb_per_h: float) -> Callable[[float], float]:
    return lambda t: max(0.0, t - ONSET) * mb_per_h * 1e6 / 3600


def cache(cap: float, tau: float) -> Callable[[float], float]:
    return lambda t: cap * (1 - math.exp(-max(0.0, t - ONSET) / tau))


def first_leak(pts: list[Point], cfg: DetectConfig | None = None) -> Alert | None:
    engine = Engine(cfg or DetectConfig())
    for p in pts:
        for a in engine.observe("process:1@GPU-0", p):
            if a.kind == LEAK:
                return a
    return None


def test_a_clear_leak_is_confirmed_half_an_hour_after_it_starts() -> None:
    pts = points(leak(400))
    alert = first_leak(pts)
    assert alert is not None
    assert ONSET + 25 * 60 <= alert.time <= ONSET + 35 * 60, (alert.time - ONSET) / 60
    assert alert.rate_bytes_per_s == pytest.approx(400e6 / 3600, rel=0.1)
    # the alert says when the growth began
    assert abs(float(alert.evidence["rising_since_s"]) - ONSET) <= 5 * 60
    # without the suspicion stage only the fixed windows judge: an hour of growth at least
    quiet = first_leak(pts, DetectConfig(leak_suspect_enabled=False))
    assert quiet is not None and quiet.time - ONSET >= 50 * 60
    # causal: the data up to the alert raise the same alert
    prefix = first_leak([p for p in pts if p.time <= alert.time])
    assert prefix == alert


@pytest.mark.parametrize(
    ("cap", "tau", "jitter"),
    [(8e9, 2400.0, 0.0), (8e9, 2400.0, 0.1e9), (15e9, 1200.0, 0.0), (4e9, 3000.0, 0.0)],
)
def test_a_cache_filling_after_a_flat_stretch_is_no_leak(cap, tau, jitter) -> None:
    pts = points(cache(cap, tau), jitter=jitter)
    engine = Engine()
    suspected = False
    alerts = []
    for p in pts:
        alerts += [a for a in engine.observe("process:1@GPU-0", p) if a.kind == LEAK]
        suspected = suspected or engine.suspected("process:1@GPU-0") is not None
    assert suspected  # it rises: attribution starts ...
    assert alerts == [], [a.message for a in alerts]  # ... but it slows down: no alert


def test_the_next_tooth_of_a_slow_sawtooth_is_no_leak() -> None:
    # 80 min teeth of 2 GB: each rises steadily for longer than the fast path needs, but from
    # a floor that was just released
    assert first_leak(points(lambda t: 2e9 * ((t % 4800) / 4800))) is None


def _level(values: list[float], width: float = 60.0) -> tuple[list[float], list[float]]:
    level = FloorLevel(width, 65)
    for i, y in enumerate(values):
        level.env_t.append(i * width)
        level.env_y.append(y)
    return list(level.env_t), list(level.env_y)


def test_steadiness_tells_a_leak_from_a_cache_of_the_same_initial_rate() -> None:
    cfg = DetectConfig()
    rng = random.Random(1)
    rate = 2e6  # per minute
    linear = _level([30e9 + rate * i + rng.uniform(0, 4 * MIB) for i in range(40)])
    tau = 40.0  # minutes
    filling = _level(
        [30e9 + rate * tau * (1 - math.exp(-i / tau)) + rng.uniform(0, 4 * MIB) for i in range(40)]
    )
    cache_ratio = math.exp(-40 / (2 * 60))  # what a 60 min cache would show over 40 min
    assert slowdown_z(*linear, cache_ratio, cfg, both=True) > 3
    assert slowdown_z(*filling, cache_ratio, cfg, both=True) < 0
    # and a leak that only looks accelerating (a flat start in front) is not steady either
    late = _level([30e9 + rate * max(0, i - 12) for i in range(40)])
    assert slowdown_z(*late, cache_ratio, cfg, both=True) < 3


def test_a_block_freed_later_is_no_step_of_the_floor() -> None:
    stairs = [0.0, 0.0, 20.0, 20.0, 175.0, 175.0, 175.0, 40.0, 40.0, 60.0]
    freed = [False] * 4 + [True] * 3 + [False] * 3
    assert freed_later(stairs, 6.0, 8) == freed
    assert not any(freed_later(stairs, 6.0, 2))  # held longer: the floor fell back
    noisy = [0.0, 3.0, 1.0, 5.0, 2.0, 4.0]  # the floor's own noise is left alone
    assert not any(freed_later(noisy, 6.0, 8))


def test_a_growth_longer_than_the_finest_level_holds_is_judged_on_a_coarser_one() -> None:
    # 70 min of growth: the finest level (64 one-minute values) no longer holds the floor
    # before it; the next (four-minute values) holds both, with a baseline of its own buckets
    cfg = DetectConfig()
    rng = random.Random(3)
    now, origin = 6 * 3600.0, 6 * 3600.0 - 70 * 60
    levels = []
    for width, size in ((60.0, 64), (240.0, 64)):
        level = FloorLevel(width, size)
        for k in range(size, 0, -1):
            t = now - k * width
            rise = max(0.0, t - origin) * 400e6 / 3600
            level.env_t.append(t)
            level.env_y.append(30e9 + rise + rng.uniform(0, 4 * MIB))
        levels.append(level)
    found = confirm(levels, origin, now, 80e9, cfg)
    assert found is not None
    assert found.rate == pytest.approx(400e6 / 3600, rel=0.1)
